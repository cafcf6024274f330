"""The model drafter's runner, loaded beside the target's before the KV budget is measured: a
draft model's (its vocabulary checked against the target's) or an EAGLE-3 head's (checked
against the target, its taps set on the target model)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.execution.runner import ModelRunner
from engine.models.bundled import resolve_model
from engine.models.config import ModelConfig
from engine.models.eagle3.checkpoint import load_head
from engine.models.eagle3.config import Eagle3Config
from engine.models.llama import LlamaForCausalLM
from engine.runtime.startup import startup_phase
from engine.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


def load_draft_runner(
    config: EngineConfig,
    spec: SpeculativeConfig | None,
    target: ModelRunner,
    max_positions: int,
    tokenizer: Any,
) -> ModelRunner | None:
    """The model drafter's runner (weights only) when the speculative config has one, in
    spec.draft_dtype or the target's dtype: the draft model, which must share the target's
    tokenizer, or the EAGLE-3 head (load_head_runner)."""
    if spec is None or spec.model_drafter is None:
        return None
    if spec.model_drafter == "eagle3":
        return load_head_runner(config, spec, target, max_positions)
    assert spec.model is not None
    with startup_phase(f"model files {spec.model}"):
        draft_path = resolve_model(spec.model)
    draft_config = ModelConfig.from_path(draft_path)
    check_draft_vocabulary(draft_config.vocab_size, target.model_config.vocab_size, tokenizer)
    dtype = target.dtype if spec.draft_dtype is None else getattr(torch, spec.draft_dtype)
    with startup_phase(f"load weights {draft_path.name} (draft)"):
        return ModelRunner(config, draft_config, max_positions, dtype)


def load_head_runner(
    config: EngineConfig, spec: SpeculativeConfig, target: ModelRunner, max_positions: int
) -> ModelRunner:
    """The EAGLE-3 head's runner: the head directory (spec.model: a path, or a name the model
    resolver knows) checked against the target, loaded in spec.draft_dtype or the target's dtype,
    sharing the target's embedding when it has none; the target then keeps the tapped layers'
    inputs of every forward (model.aux_layers)."""
    assert spec.model is not None
    path = Path(spec.model).expanduser()
    if not path.is_dir():
        with startup_phase(f"model files {spec.model}"):
            path = resolve_model(spec.model)
    head = Eagle3Config.from_path(path)
    head.check_target(target.model_config)
    target_model = target.model
    assert isinstance(target_model, LlamaForCausalLM), "a head taps a Llama-family target"
    layers = head.aux_layers(target.model_config.num_layers)
    dtype = target.dtype if spec.draft_dtype is None else getattr(torch, spec.draft_dtype)
    if spec.draft_quantization:
        if target.device.torch.type != "cpu":
            raise ValueError(
                f"draft_quantization {spec.draft_quantization} runs on the CPU kernels, not on "
                "a GPU."
            )
        dtype = torch.float32  # the kernels' activations
    cfg = head.as_model_config(target.model_config)
    with startup_phase(f"load weights {path.name} (EAGLE-3 head)"):
        model = load_head(head, cfg, len(layers), dtype, target.device.torch)
        if model.embed_tokens is None:
            if head.hidden_size != target.model_config.hidden_size:
                raise ValueError(
                    f"EAGLE-3 head {path} has no embed_tokens and hidden_size "
                    f"{head.hidden_size}; the target's embedding it would share is "
                    f"{target.model_config.hidden_size} wide."
                )
            model.share_embedding(target_model.embed_tokens)
        if spec.draft_quantization:
            model.quantize(spec.draft_quantization, config.gguf_activations == "int8")
        runner = ModelRunner(config, cfg, max_positions, dtype, model=model)
    target_model.aux_layers = layers
    return runner


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
