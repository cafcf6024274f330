"""A user request's n sequences (`RequestGroup`) and the outputs users see: each refresh a new,
immutable `RequestOutput` carrying only what the sequences added since the last one."""

from __future__ import annotations

import copy

from engine.core.counters import SpecStats
from engine.core.request import Request
from engine.outputs import CompletionOutput, RequestOutput


class RequestGroup:
    """The n sequences of one user request, and how much of each its outputs have carried."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        requests: list[Request],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids  # never changed: every output shares it
        self.requests = requests
        self._num_sent = [0] * len(requests)  # output tokens (and logprobs) already carried
        self._final_stats: list[SpecStats | None] = [None] * len(requests)

    def refresh(self) -> RequestOutput:
        """A new output holding what the sequences added since the last refresh: the engine
        calls this once per step for every group the step advanced."""
        completions = [self._advance(i, request) for i, request in enumerate(self.requests)]
        finished = all(c.finished for c in completions)
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, finished
        )

    def _advance(self, index: int, request: Request) -> CompletionOutput:
        start = self._num_sent[index]
        end = self._num_sent[index] = request.num_output_tokens
        text, request.unsent_text = request.unsent_text, ""
        finish_reason = request.status.value if request.is_finished else None
        if finish_reason is not None and self._final_stats[index] is None:
            # Taken once, when the counters are final; this group's later outputs share it.
            self._final_stats[index] = copy.deepcopy(request.spec_stats)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=request.output_token_ids[start:end],
            logprobs=None if request.logprobs is None else request.logprobs[start:end],
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            num_output_tokens=end,
            num_cached_tokens=request.num_cached_tokens,
            spec_stats=self._final_stats[index],
        )


def new_group(
    request_id: str, prompt: str | None, prompt_token_ids: list[int], requests: list[Request]
) -> RequestGroup:
    return RequestGroup(request_id, prompt, prompt_token_ids, requests)
