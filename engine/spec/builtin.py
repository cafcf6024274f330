"""Factories of the built-in proposers, registered by name; each imports its module lazily."""

from __future__ import annotations

from typing import Any

from engine.spec.config import SpeculativeConfig
from engine.spec.proposer import Proposer, register_proposer


@register_proposer("ngram")
def _ngram(spec: SpeculativeConfig, context: Any) -> Proposer:
    from engine.spec.ngram import NgramProposer

    return NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min)


@register_proposer("prediction")
def _prediction(spec: SpeculativeConfig | None, context: Any) -> Proposer:
    from engine.spec.prediction import PredictionProposer

    return PredictionProposer()


@register_proposer("draft_model")
def _draft_model(spec: SpeculativeConfig, context: Any) -> Proposer:
    import torch

    from engine.config import ModelConfig
    from engine.models.bundled import resolve_model
    from engine.runner import ModelRunner
    from engine.sampler import Sampler
    from engine.spec.draft_model import DraftModelProposer

    engine = context.engine
    assert spec.model is not None
    draft_config = ModelConfig.from_path(resolve_model(spec.model))
    if draft_config.vocab_size != engine.model_config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft_config.vocab_size}) differs from the "
            f"target's ({engine.model_config.vocab_size}); they must share a tokenizer."
        )
    dtype = engine.runner.dtype if spec.draft_dtype is None else getattr(torch, spec.draft_dtype)
    runner = ModelRunner(
        engine.config, draft_config, engine.max_model_len, engine.block_manager.num_blocks, dtype
    )
    return DraftModelProposer(
        runner,
        Sampler(draft_config.vocab_size, engine.eos_token_ids),
        engine.block_manager,
        spec.draft_min_confidence,
    )
