"""The proposers by name: one explicit table of factories, each building its proposer from a
typed `DrafterContext` (what the engine has built by then: the runners, the block manager, the
tokenizer). Nothing registers itself on import; a new drafter is a line here and a name in
`engine.speculative_config.METHODS` (tests/unit/test_proposers.py holds the two together).

`prediction` (a request's Predicted Outputs) and `grammar` (the text a request's grammar
forces) are also sources every engine has, whatever its config names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from engine.drafters.draft_model import DraftModelProposer
from engine.drafters.eagle3 import Eagle3Proposer
from engine.drafters.grammar import GrammarProposer
from engine.drafters.ngram import NgramProposer
from engine.drafters.prediction import PredictionProposer
from engine.drafters.proposer import Proposer
from engine.execution.runner import ModelRunner
from engine.sampling.sampler import Sampler
from engine.scheduling.block_manager import BlockManager
from engine.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class DrafterContext:
    """What a proposer's factory may read: the speculative config (None: only a request's own
    sources draft), the target's vocabulary and stop ids, its tokenizer (None for a checkpoint
    without one), and for the model drafters the target's runner, the drafter's runner (loaded
    before the KV budget is measured, its KV under the target's block ids) and the block
    manager whose tables index both."""

    spec: SpeculativeConfig | None
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None
    target: ModelRunner | None = None
    draft_runner: ModelRunner | None = None
    block_manager: BlockManager | None = None

    def model_parts(self) -> tuple[SpeculativeConfig, ModelRunner, ModelRunner, BlockManager]:
        """The spec and the runners and block manager a model drafter needs (all built)."""
        spec, target, runner, blocks = (
            self.spec,
            self.target,
            self.draft_runner,
            self.block_manager,
        )
        assert spec is not None and target is not None and runner is not None, (
            "the engine loads the drafter's runner when a method names one"
        )
        assert blocks is not None
        return spec, target, runner, blocks


ProposerFactory = Callable[[DrafterContext], Proposer]


def _ngram(context: DrafterContext) -> Proposer:
    spec = context.spec
    assert spec is not None, "ngram is a configured method"
    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)


def _prediction(context: DrafterContext) -> Proposer:
    return PredictionProposer()


def _grammar(context: DrafterContext) -> Proposer:
    return GrammarProposer(context.tokenizer)


def _draft_model(context: DrafterContext) -> Proposer:
    spec, _, runner, blocks = context.model_parts()
    follows = spec.draft_follows_prefill
    return DraftModelProposer(
        runner,
        Sampler(runner.model_config.vocab_size, context.eos_token_ids),
        blocks,
        spec.draft_min_confidence,
        vocab_size=context.vocab_size,
        follows_prefill=runner.device.is_cuda if follows is None else follows,
    )


def _eagle3(context: DrafterContext) -> Proposer:
    spec, target, runner, blocks = context.model_parts()
    return Eagle3Proposer(
        runner,
        target,
        Sampler(context.vocab_size, context.eos_token_ids),
        blocks,
        spec.draft_min_confidence,
    )


PROPOSERS: Mapping[str, ProposerFactory] = MappingProxyType(
    {
        "ngram": _ngram,
        "draft_model": _draft_model,
        "eagle3": _eagle3,
        "prediction": _prediction,
        "grammar": _grammar,
    }
)


def make_proposer(name: str, context: DrafterContext) -> Proposer:
    """The proposer `name` names, built from `context`."""
    if name not in PROPOSERS:
        raise ValueError(f"unknown speculative method {name!r}; choose from {sorted(PROPOSERS)}.")
    return PROPOSERS[name](context)
