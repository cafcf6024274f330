"""Appending a step's emitted tokens to a request, and the stop conditions.

A step may emit several tokens for one request (accepted drafts + one); they are appended one by
one, and the first stop condition (a stop token, EOS, a stop string, max_tokens or the context
length) ends the output there: nothing after it is emitted. Under a grammar, every appended
token advances it, and the grammar's end (it accepted a stop token) ends the output too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine.core.request import Request, RequestStatus
from engine.outputs import TokenLogprob

logger = logging.getLogger(__name__)


def append_tokens(
    request: Request,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprob] | None,
    eos_token_ids: Sequence[int],
    max_model_len: int,
) -> tuple[RequestStatus | None, int]:
    """Append tokens until a stop condition. Returns (the finishing status or None, how many of
    the tokens were dropped because the output stopped before them)."""
    for i, token_id in enumerate(token_ids):
        request.append_token(token_id)
        if request.logprobs is not None and logprobs is not None:
            entry = logprobs[i]
            num_top = request.params.logprobs or 0
            request.logprobs.append(
                TokenLogprob(
                    entry.token_id,
                    entry.logprob,
                    entry.top_token_ids[:num_top],
                    entry.top_logprobs[:num_top],
                )
            )
        status = _check_stop(request, eos_token_ids, max_model_len)
        if request.grammar is not None:
            status = _advance_grammar(request, token_id, status)
        if status is not None:
            if request.detokenizer is not None and request.stop_reason is None:
                request.unsent_text += request.detokenizer.flush()
            return status, len(token_ids) - i - 1
    return None, 0


def _advance_grammar(
    request: Request, token_id: int, status: RequestStatus | None
) -> RequestStatus | None:
    """Advance the request's grammar by its new token; a finished grammar ends the output."""
    if not request.grammar.accept(token_id):
        # Every token was sampled under the grammar's mask: this is a bug, not bad input. End
        # the output rather than emit past what the grammar allows.
        logger.error("request %s: token %d is outside its grammar", request.request_id, token_id)
        return status or RequestStatus.FINISHED_STOPPED
    if status is None and request.grammar.is_terminated:
        return RequestStatus.FINISHED_STOPPED
    return status


def _check_stop(
    request: Request, eos_token_ids: Sequence[int], max_model_len: int
) -> RequestStatus | None:
    token_id = request.output_token_ids[-1]
    params = request.params
    is_stop_token = token_id in params.stop_token_ids or (
        not params.ignore_eos and token_id in eos_token_ids
    )
    if is_stop_token and request.num_output_tokens >= params.min_tokens:
        request.stop_reason = token_id if token_id in params.stop_token_ids else None
        return RequestStatus.FINISHED_STOPPED
    if not is_stop_token and request.detokenizer is not None:
        update = request.detokenizer.append([token_id])
        request.unsent_text += update.text
        if update.stop_string is not None:
            request.stop_reason = update.stop_string
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
