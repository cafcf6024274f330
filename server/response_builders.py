"""Engine outputs -> OpenAI responses and stream chunks (the bodies of `server/response_bodies.py`).

Response builders read whole outputs (an `OutputAccumulator`'s); stream builders read the
engine's per-step outputs, each once and in order, and send what each one adds (see
`engine.outputs`). Logprob token strings come from a `TokenDecoder` (build one per model). An
aborted completion (finish_reason "abort") has no OpenAI form: the builders raise ValueError for
it, and the route answers with an error instead.

Given a tool parser, chat choices are read through it (`server/tool_calls.py`): tool calls in
the message or as `delta.tool_calls` fragments, finish reason "tool_calls" ("stop" for a named
function); a choice cut by max_tokens is read as cut (no markup in its content).

With `include_spec_stats` every choice carries `speculative_decoding_stats` (our extension), read
from the completion's own counters: on each choice of a response, and in a stream on the chunk
that carries the choice's finish reason (the output that finishes a completion brings them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.counters import SpecStats
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.response_bodies import (
    SYSTEM_FINGERPRINT,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionDelta,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionTokensDetails,
    FinishReason,
    MethodStats,
    PromptTokensDetails,
    SpeculativeDecodingStats,
    TopLogprob,
    Usage,
)
from server.token_bytes import TextOffsets, TokenDecoder
from server.tool_calls import ToolDeltas, reply_message, with_calls
from server.tool_parsers import ToolParser


@dataclass(frozen=True)
class ResponseMeta:
    """What every response and chunk of one request repeats."""

    id: str
    model: str
    created: int
    system_fingerprint: str = SYSTEM_FINGERPRINT

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseMeta:
        """A fresh id ("chatcmpl" for chat, "cmpl" for completions) stamped with the time now."""
        return cls(f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()))


def finish_reason_of(reason: str) -> FinishReason:
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    raise ValueError(f"finish reason {reason!r} has no OpenAI equivalent.")


def usage_of(outputs: Sequence[RequestOutput]) -> Usage:
    """Usage of one or more finished engine requests (several prompts of one completions call),
    from their whole or their last outputs: both hold the counts."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completions = [c for o in outputs for c in o.outputs]
    completion_tokens = sum(c.num_output_tokens for c in completions)
    stats = [c.spec_stats for c in completions if c.spec_stats is not None]
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in outputs)
        ),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=sum(s.num_prediction_accepted for s in stats),
            rejected_prediction_tokens=sum(s.num_prediction_rejected for s in stats),
        ),
    )


def spec_stats_of(stats: SpecStats | None) -> SpeculativeDecodingStats:
    """One completion's speculation counters in the response's words (no counters: zeros)."""
    stats = stats or SpecStats()
    return SpeculativeDecodingStats(
        mean_acceptance_length=stats.mean_acceptance_length,
        draft_acceptance_rate=stats.acceptance_rate,
        num_spec_steps=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_draft_tokens=stats.num_accepted_tokens,
        acceptance_histogram=list(stats.acceptance_histogram),
        by_method={
            source: MethodStats(num_draft_tokens=n, num_accepted_draft_tokens=a)
            for source, (n, a) in sorted(stats.by_source.items())
        },
    )


def _stats_if(include: bool, c: CompletionOutput) -> SpeculativeDecodingStats | None:
    return spec_stats_of(c.spec_stats) if include else None


def chat_logprobs(entries: Sequence[TokenLogprob], tokens: TokenDecoder) -> ChatChoiceLogprobs:
    content = []
    for e in entries:
        top = [
            TopLogprob(token=tokens.token_text(t), logprob=lp, bytes=list(tokens.token_bytes(t)))
            for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)
        ]
        content.append(
            ChatTokenLogprob(
                token=tokens.token_text(e.token_id),
                logprob=e.logprob,
                bytes=list(tokens.token_bytes(e.token_id)),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)


def completion_logprobs(
    entries: Sequence[TokenLogprob], tokens: TokenDecoder, offsets: TextOffsets
) -> CompletionLogprobs:
    """Legacy logprobs; each position's top map also holds the sampled token, as OpenAI's does."""
    top_maps = []
    for e in entries:
        top: dict[str, float] = {}
        for token_id, logprob in zip(e.top_token_ids, e.top_logprobs, strict=True):
            top.setdefault(tokens.token_text(token_id), logprob)
        top.setdefault(tokens.token_text(e.token_id), e.logprob)
        top_maps.append(top)
    return CompletionLogprobs(
        tokens=[tokens.token_text(e.token_id) for e in entries],
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=top_maps,
        text_offset=offsets.advance(e.token_id for e in entries),
    )


def build_chat_response(
    meta: ResponseMeta,
    output: RequestOutput,
    tokens: TokenDecoder | None,
    include_spec_stats: bool = False,
    tool_parser: ToolParser | None = None,
) -> ChatCompletionResponse:
    """The body of a finished, non-streamed chat completion."""
    choices = []
    for c in output.outputs:
        reason = finish_reason_of(c.finish_reason or "unfinished")
        message = reply_message(c.text, tool_parser, is_cut=reason == "length")
        if tool_parser is not None:
            reason = with_calls(reason, bool(message.tool_calls), tool_parser)
        choices.append(
            ChatCompletionChoice(
                index=c.index,
                message=message,
                logprobs=None if c.logprobs is None else chat_logprobs(c.logprobs, _needed(tokens)),
                finish_reason=reason,
                speculative_decoding_stats=_stats_if(include_spec_stats, c),
            )
        )
    return ChatCompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        system_fingerprint=meta.system_fingerprint,
        choices=choices,
        usage=usage_of([output]),
    )


def build_completion_response(
    meta: ResponseMeta,
    outputs: Sequence[RequestOutput],
    tokens: TokenDecoder | None,
    include_spec_stats: bool = False,
) -> CompletionResponse:
    """The body of finished, non-streamed completions: outputs[p] is prompt p's request."""
    choices = []
    for prompt_index, output in enumerate(outputs):
        for c in output.outputs:
            logprobs = None
            if c.logprobs is not None:
                decoder = _needed(tokens)
                logprobs = completion_logprobs(c.logprobs, decoder, TextOffsets(decoder))
            choices.append(
                CompletionChoice(
                    index=prompt_index * len(output.outputs) + c.index,
                    text=c.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason_of(c.finish_reason or "unfinished"),
                    speculative_decoding_stats=_stats_if(include_spec_stats, c),
                )
            )
    return CompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        system_fingerprint=meta.system_fingerprint,
        choices=choices,
        usage=usage_of(outputs),
    )


def _needed(tokens: TokenDecoder | None) -> TokenDecoder:
    """The token texts logprobs are written with. A model served without a tokenizer has none:
    its logprobs fail as an internal error."""
    if tokens is None:
        raise RuntimeError("logprobs need the served model's tokenizer")
    return tokens


@dataclass
class _Sent:
    """Where one choice of a stream stands."""

    is_started: bool = False
    is_finished: bool = False
    offsets: TextOffsets | None = None
    tools: ToolDeltas | None = None  # a chat choice read through a tool parser


@dataclass
class _Stream:
    meta: ResponseMeta
    tokens: TokenDecoder | None  # None: a model served without a tokenizer (no logprobs)
    include_usage: bool = False
    include_spec_stats: bool = False
    _sent: dict[int, _Sent] = field(default_factory=dict)
    _last: dict[int, RequestOutput] = field(default_factory=dict)  # by prompt index

    def _finish(self, sent: _Sent, c: CompletionOutput) -> FinishReason | None:
        """The finish reason the first time an output of the choice has one (later outputs of
        the request repeat it)."""
        if c.finish_reason is None or sent.is_finished:
            return None
        sent.is_finished = True
        return finish_reason_of(c.finish_reason)


@dataclass
class ChatStream(_Stream):
    """Chunks of one streamed chat completion: per choice a role chunk, content chunks (and
    tool call fragments, given a `tool_parser`), and a final chunk with an empty delta and the
    finish reason; then `usage_chunk()`."""

    tool_parser: ToolParser | None = None

    def chunks(self, output: RequestOutput, prompt_index: int = 0) -> list[ChatCompletionChunk]:
        """Chunks for what the output adds. A chat has one prompt: prompt_index is always 0 and
        only there so chat and completions streams share one interface."""
        self._last[0] = output
        chunks = []
        for c in output.outputs:
            sent = self._sent.setdefault(c.index, _Sent())
            if not sent.is_started:
                sent.is_started = True
                if self.tool_parser is not None:
                    sent.tools = ToolDeltas(self.tool_parser)
                delta = ChatCompletionDelta(role="assistant", content="")
                chunks.append(self._chunk(ChatCompletionStreamChoice(index=c.index, delta=delta)))
            entries = c.logprobs or []
            if sent.tools is None:
                deltas = [ChatCompletionDelta(content=c.text)] if c.text or entries else []
            else:
                deltas = sent.tools.deltas(c.text, c.finish_reason)
                if entries and not deltas:
                    deltas = [ChatCompletionDelta()]
            for i, delta in enumerate(deltas):
                # The step's logprobs ride on its first chunk.
                has_logprobs = c.logprobs is not None and i == 0
                logprobs = chat_logprobs(entries, _needed(self.tokens)) if has_logprobs else None
                choice = ChatCompletionStreamChoice(index=c.index, delta=delta, logprobs=logprobs)
                chunks.append(self._chunk(choice))
            reason = self._finish(sent, c)
            if reason is not None and sent.tools is not None:
                reason = with_calls(reason, sent.tools.has_calls, sent.tools.parser)
            if reason is not None:
                choice = ChatCompletionStreamChoice(
                    index=c.index,
                    delta=ChatCompletionDelta(),
                    finish_reason=reason,
                    speculative_decoding_stats=_stats_if(self.include_spec_stats, c),
                )
                chunks.append(self._chunk(choice))
        return chunks

    def usage_chunk(self) -> ChatCompletionChunk | None:
        """The last chunk when the client asked for usage: no choices, the whole usage."""
        if not self.include_usage:
            return None
        return self._chunk(None, usage_of(list(self._last.values())))

    def _chunk(
        self, choice: ChatCompletionStreamChoice | None, usage: Usage | None = None
    ) -> ChatCompletionChunk:
        m = self.meta
        choices = [] if choice is None else [choice]
        return ChatCompletionChunk(
            id=m.id,
            created=m.created,
            model=m.model,
            system_fingerprint=m.system_fingerprint,
            choices=choices,
            usage=usage,
        )


class CompletionStream(_Stream):
    """Chunks of one streamed completions call; each prompt's engine request is fed with its
    index. `n` (choices per prompt) numbers choices as prompt_index * n + index."""

    def __init__(
        self,
        meta: ResponseMeta,
        tokens: TokenDecoder | None,
        n: int = 1,
        include_usage: bool = False,
        include_spec_stats: bool = False,
    ) -> None:
        super().__init__(meta, tokens, include_usage, include_spec_stats)
        self.n = n

    def chunks(self, output: RequestOutput, prompt_index: int = 0) -> list[CompletionChunk]:
        self._last[prompt_index] = output
        chunks = []
        for c in output.outputs:
            index = prompt_index * self.n + c.index
            sent = self._sent.setdefault(index, _Sent())
            text, entries = c.text, c.logprobs or []
            reason = self._finish(sent, c)
            if not (text or entries or reason):
                continue
            logprobs = None
            if c.logprobs is not None:
                decoder = _needed(self.tokens)
                if sent.offsets is None:  # a choice's outputs all have logprobs or none do
                    sent.offsets = TextOffsets(decoder)
                logprobs = completion_logprobs(entries, decoder, sent.offsets)
            choice = CompletionStreamChoice(
                index=index,
                text=text,
                logprobs=logprobs,
                finish_reason=reason,
                speculative_decoding_stats=_stats_if(self.include_spec_stats and bool(reason), c),
            )
            chunks.append(self._chunk([choice]))
        return chunks

    def usage_chunk(self) -> CompletionChunk | None:
        """The last chunk when the client asked for usage: no choices, the whole usage."""
        if not self.include_usage:
            return None
        return self._chunk([], usage_of([self._last[p] for p in sorted(self._last)]))

    def _chunk(
        self, choices: list[CompletionStreamChoice], usage: Usage | None = None
    ) -> CompletionChunk:
        m = self.meta
        return CompletionChunk(
            id=m.id,
            created=m.created,
            model=m.model,
            system_fingerprint=m.system_fingerprint,
            choices=choices,
            usage=usage,
        )
