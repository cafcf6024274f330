"""A request's mutable state: a small class of counters with derived properties.

The scheduler counts tokens, not phases: a request has `num_computed_tokens` (tokens whose KV is in
the cache) and `num_tokens` (prompt + output so far). Every step computes some of the difference:
a prompt chunk, or the last sampled token. A step that reaches `num_tokens` samples a new token.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.core.counters import SpecStats
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(*values: int) -> int:
    """A well-spread 63-bit seed from several integers (torch seeds must fit in int64)."""
    x = 0
    for value in values:
        x = _splitmix64(x ^ (value & _MASK64))
    return x >> 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Request:
    """One sequence being generated (a user request with n > 1 owns n of these)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        sampling_seed: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what fits in the context
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens sampled by a step still on the device (an overlapped step: 0 or 1): counted by
        # the scheduler as known, appended once the step's results reach the host.
        self.num_in_flight = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # Randomness is keyed by output position (see `random_key`), never drawn from a stream
        # that other steps or other requests advance.
        self.sampling_seed = params.seed if params.seed is not None else (sampling_seed or 0)
        self.detokenizer: Any = None  # set by the engine when a tokenizer is present
        self.unsent_text = ""  # decoded, not yet in an output (the next one takes it)
        # time.monotonic() stamps, like arrival_time (the engine's metrics set them).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # OpenAI Predicted Outputs: the client's guess of the output, a draft source.
        self.prediction_token_ids: tuple[int, ...] = ()
        # Structured outputs: the sequence's GrammarState (set by the engine), advanced by every
        # token appended.
        self.grammar: Any = None
        self.spec_stats = SpecStats()

    def random_key(self, output_index: int, stream: int = 0) -> int:
        """The key of the randomness (`engine/sampling/counter_rng.py`) for the token at output position
        output_index (stream 0: sampling it; other streams: the verifier's and the draft
        model's draws for that position).

        Keying randomness by position makes a seeded request sample the same tokens whatever
        else shares its batch, and whether or not its tokens were drafted: with one-hot drafts
        the verifier draws each position's token exactly as plain sampling would. The uniforms
        of a key are the same on every device."""
        return _mix(self.sampling_seed, output_index, stream)

    def generator(
        self, output_index: int, device: torch.device, stream: int = 0
    ) -> torch.Generator:
        """A torch generator on `device` seeded with the same key: the per-request reference
        that tests hold the counter-based draws against (the engine draws from the keys)."""
        generator = torch.Generator(device=device)
        generator.manual_seed(self.random_key(output_index, stream))
        return generator

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past num_output_tokens (a stop string ended the text earlier)."""
        drop = self.num_output_tokens - num_output_tokens
        if drop > 0:
            del self.output_token_ids[-drop:]
            del self.all_token_ids[-drop:]
            if self.logprobs is not None:
                del self.logprobs[num_output_tokens:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
