"""Appending emitted tokens to requests, stop conditions, and the outputs users see.

A step may emit several tokens for one request (accepted drafts + one); they are appended one by
one, and the first stop condition (a stop token, EOS, a stop string, max_tokens or the context
length) ends the output there: nothing after it is emitted.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.request import Request, RequestStatus


class RequestGroup:
    """The n sequences of one user request and the output object they fill."""

    def __init__(self, output: RequestOutput, requests: list[Request]) -> None:
        self.output = output
        self.requests = requests

    def refresh(self) -> RequestOutput:
        """Bring the output up to date with the sequences; `new_*` hold what changed."""
        for request, completion in zip(self.requests, self.output.outputs, strict=True):
            num_old = len(completion.token_ids)
            completion.new_token_ids = request.output_token_ids[num_old:]
            completion.new_text = request.output_text[len(completion.text) :]
            completion.token_ids = list(request.output_token_ids)
            completion.text = request.output_text
            if completion.logprobs is not None and request.logprobs is not None:
                completion.logprobs = list(request.logprobs)
            completion.num_cached_tokens = request.num_cached_tokens
            completion.spec_stats = request.spec_stats
            if request.is_finished:
                completion.finish_reason = request.status.value
                completion.stop_reason = request.stop_reason
        self.output.finished = all(r.is_finished for r in self.requests)
        return self.output


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
        if status is not None:
            if request.detokenizer is not None and request.stop_reason is None:
                request.output_text += request.detokenizer.flush()
            return status, len(token_ids) - i - 1
    return None, 0


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
        request.output_text += update.text
        if update.stop_string is not None:
            request.stop_reason = update.stop_string
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def new_group(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], requests: list[Request]
) -> RequestGroup:
    params = requests[0].params
    output = RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        outputs=[
            CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
            for i in range(len(requests))
        ],
    )
    return RequestGroup(output, requests)
