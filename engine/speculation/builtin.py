"""Factories of the built-in proposers, registered by name; each imports its module lazily."""

from __future__ import annotations

from typing import Any

from engine.speculation.config import SpeculativeConfig
from engine.speculation.proposer import Proposer, register_proposer


@register_proposer("ngram")
def _ngram(spec: SpeculativeConfig, context: Any) -> Proposer:
    from engine.speculation.ngram import NgramProposer

    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)


@register_proposer("prediction")
def _prediction(spec: SpeculativeConfig | None, context: Any) -> Proposer:
    from engine.speculation.prediction import PredictionProposer

    return PredictionProposer()


@register_proposer("draft_model")
def _draft_model(spec: SpeculativeConfig, context: Any) -> Proposer:
    """The draft model's runner is built by the engine (its weights load before the KV budget is
    measured, and its KV shares the target's budget and block ids); this wires it up."""
    from engine.sampler import Sampler
    from engine.speculation.draft_model import DraftModelProposer

    engine = context.engine
    runner = engine.draft_runner
    assert runner is not None, "the engine loads the draft model when a method names it"
    return DraftModelProposer(
        runner,
        Sampler(runner.model_config.vocab_size, engine.eos_token_ids),
        engine.block_manager,
        spec.draft_min_confidence,
        vocab_size=engine.model_config.vocab_size,
    )


@register_proposer("eagle3")
def _eagle3(spec: SpeculativeConfig, context: Any) -> Proposer:
    """The head's runner is built by the engine like a draft model's (engine/loading.py)."""
    from engine.sampler import Sampler
    from engine.speculation.eagle3 import Eagle3Proposer

    engine = context.engine
    assert engine.draft_runner is not None, "the engine loads the head when a method names it"
    return Eagle3Proposer(
        engine.draft_runner,
        engine.runner,
        Sampler(engine.model_config.vocab_size, engine.eos_token_ids),
        engine.block_manager,
        spec.draft_min_confidence,
    )


@register_proposer("grammar")
def _grammar(spec: SpeculativeConfig | None, context: Any) -> Proposer:
    from engine.speculation.grammar import GrammarProposer

    return GrammarProposer(context.engine.tokenizer)
