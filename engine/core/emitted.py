"""What one request emitted in a step (`StepTokens`): the verifier's result, which the engine
appends to the request and a drafter that reads the target's states (an EAGLE-3 head) extends
over."""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import TokenLogprob


@dataclass(frozen=True)
class StepTokens:
    """What one request emitted this step."""

    token_ids: list[int]  # 1 + num_accepted tokens
    num_draft_tokens: int  # drafts verified
    num_accepted: int  # drafts accepted (the recovered or bonus token excluded)
    logprobs: list[TokenLogprob] | None
