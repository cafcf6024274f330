"""What the engine loads besides the target's runner: the draft model's runner (its vocabulary
checked against the target's) and the tokenizer, where the checkpoint has one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig, ModelConfig
from engine.models.bundled import resolve_model
from engine.runner import ModelRunner
from engine.speculation.config import SpeculativeConfig
from engine.startup import startup_phase
from engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def load_draft_runner(
    config: EngineConfig,
    spec: SpeculativeConfig | None,
    target: ModelRunner,
    max_positions: int,
    tokenizer: Any,
) -> ModelRunner | None:
    """The draft model's runner (weights only) when the speculative config has one, in
    spec.draft_dtype or the target's dtype; it must share the target's tokenizer."""
    if spec is None or "draft_model" not in spec.methods:
        return None
    assert spec.model is not None
    with startup_phase(f"model files {spec.model}"):
        draft_path = resolve_model(spec.model)
    draft_config = ModelConfig.from_path(draft_path)
    check_draft_vocabulary(draft_config.vocab_size, target.model_config.vocab_size, tokenizer)
    dtype = target.dtype if spec.draft_dtype is None else getattr(torch, spec.draft_dtype)
    with startup_phase(f"load weights {draft_path.name} (draft)"):
        return ModelRunner(config, draft_config, max_positions, dtype)


def check_draft_vocabulary(draft_vocab: int, target_vocab: int, tokenizer: Any) -> None:
    """Checkpoints of one family pad their embedding tables differently (Qwen2.5-Coder: 152,064
    rows at 7B, 151,936 at 1.5B), so the two vocabulary sizes may differ as long as both cover
    every id the shared tokenizer makes; the draft never proposes an id past the target's."""
    if draft_vocab == target_vocab:
        return
    num_ids = len(tokenizer) if tokenizer is not None else None
    if num_ids is None or num_ids > min(draft_vocab, target_vocab):
        covers = f"the tokenizer's {num_ids} ids" if num_ids else "a tokenizer's ids"
        raise ValueError(
            f"the draft model's vocabulary ({draft_vocab}) differs from the target's "
            f"({target_vocab}) and they do not both cover {covers}; they must share a tokenizer."
        )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def maybe_load_tokenizer(path: Any) -> Any:
    """The model's tokenizer, or None for a checkpoint without one (prompts are then token ids)."""
    path = Path(path)
    if path.is_dir() and not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.info("no tokenizer in %s: prompts must be token ids", path)
        return None
    return load_tokenizer(path)
