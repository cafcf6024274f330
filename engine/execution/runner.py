"""The model runner: owns a model and its paged KV tensors; runs one flattened forward.

A step is ONE forward over the query tokens of every scheduled sequence back to back (prompt
chunks, decode tokens and draft tokens to verify alike), with logits only for the rows that
sample. The target model and a draft model each have a runner; they share block tables.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.attention import get_attention_backend
from engine.attention.base import flatten_step
from engine.config import EngineConfig
from engine.core.chunks import SeqChunk
from engine.execution.carry import Carry
from engine.execution.cuda_graphs import NOT_CAPTURED, make_cuda_graphs
from engine.models.config import ModelConfig
from engine.models.eagle3.head import Eagle3Head
from engine.models.gguf import load_quantized
from engine.models.linears import enable_batch_invariant
from engine.models.llama import ForwardContext, LlamaForCausalLM
from engine.models.loader import load_model, quantization_of
from engine.models.rope import RotaryEmbedding
from engine.runtime.device import Device

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs one model (the target, or a draft) over paged KV.

    Built in two steps so one budget can size the KV of every model: `__init__` loads the weights
    (and the attention backend and RoPE tables), then, once every model is loaded and the budget
    measured, `allocate_kv_cache` allocates the per-layer KV tensors."""

    fused = False  # the fused Triton layer kernels (set from the config in __init__)

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_positions: int,
        dtype: torch.dtype | None = None,
        model: Eagle3Head | None = None,
    ) -> None:
        self.config = config
        self.device = Device(config.torch_device())
        self.model_config = model_config
        self.name = model_config.path.name
        self.block_size = config.block_size
        # The target (or a draft model) from its checkpoint, or an EAGLE-3 head its owner built.
        self.model: LlamaForCausalLM | Eagle3Head
        if model is not None:  # built and loaded by its owner (an EAGLE-3 head), in dtype
            assert dtype is not None
            self.dtype, self.int8_activations, self.model = dtype, False, model
        else:
            quantized = load_quantized(
                model_config.path,
                model_config.num_heads,
                model_config.num_kv_heads,
                config.quantization,
                self.device.torch,
            )
            self.dtype = dtype or config.torch_dtype(model_config, quantized=bool(quantized))
            self.int8_activations = bool(quantized) and config.gguf_activations == "int8"
            self.model = load_model(
                model_config, self.dtype, self.device.torch, quantized, self.int8_activations
            )
        if config.batch_invariant and self.device.is_cuda:
            # The CPU kernels are batch-invariant as they are; on CUDA, Triton's (config.py
            # has made the attention backend Triton's too).
            enable_batch_invariant(self.model)
        # "none", or "gguf (Q4_K + Q6_K)": the formats of the blocks the linears multiply by.
        self.quantization = quantization_of(self.model)
        self.backend = get_attention_backend(config.attention_backend, self.device.torch)
        # The CUDA path's fused Triton layer kernels (engine/kernels/triton_layer.py), as the
        # config resolved them once at start: on CUDA with Triton unless turned off.
        self.fused = config.fused_layers
        # Sized for the longest context the engine may allow (max_model_len is settled only
        # after the KV budget), and built before the budget is measured so it counts.
        self.rope = RotaryEmbedding(
            model_config.hf_config, model_config.head_dim, max_positions, self.device.torch
        )
        self.kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        self.num_blocks = 0
        # Captured CUDA graphs of small steps, made once the KV exists (None: run eagerly).
        self.graphs: Any = None
        # The last forward ran eagerly where a step of as many tokens replays a graph.
        self.last_off_graph = False

    @property
    def weight_format(self) -> str:
        """What the linears multiply by: 'gguf (Q4_K + Q6_K)', or the dense dtype."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.quantization == "none":
            return dtype
        activations = "int8" if self.int8_activations else dtype
        return f"{self.quantization}, {activations} activations"

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of K and V one block takes across all layers."""
        return self.model_config.kv_bytes_per_token * self.dtype.itemsize * self.block_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters and buffers."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def pad_block(self) -> int:
        """The physical block after the last one the block manager hands out: no request owns
        it, so padded tokens of a captured CUDA graph write their K/V there."""
        assert self.kv_caches, "allocate_kv_cache first"
        return self.num_blocks

    def allocate_kv_cache(self, num_blocks: int, max_query_len: int | None = None) -> None:
        """Per layer, K and V of [num_blocks + 1, block_size, num_kv_heads, head_dim]: the
        num_blocks the block manager owns, then `pad_block`. Zeroed, so a slot never written
        holds no NaN for a masked attention weight of 0 to multiply. Then, on CUDA, capture the
        small steps' graphs (`max_query_len`: the longest query of one sequence a captured step
        may have; see engine.execution.cuda_graphs.make_cuda_graphs)."""
        assert not self.kv_caches and num_blocks >= 1
        cfg = self.model_config
        shape = (num_blocks + 1, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = tuple(
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device.torch),
                torch.zeros(shape, dtype=self.dtype, device=self.device.torch),
            )
            for _ in range(cfg.num_layers)
        )
        self.num_blocks = num_blocks
        self.graphs = make_cuda_graphs(self, self.config, max_query_len=max_query_len)

    def step_inputs(
        self, chunks: Sequence[SeqChunk], carry: Carry | None = None
    ) -> tuple[Any, ForwardContext, torch.Tensor]:
        """The flattened step, its forward context and its token ids [num_tokens] on the device
        (with `carry`'s tokens written over the positions it names)."""
        step = flatten_step(chunks, self.block_size)
        pos = self.device.tensor(step.positions, torch.int64)  # [num_tokens]
        cos, sin = self.rope(pos, self.dtype)
        ctx = ForwardContext(
            backend=self.backend,
            attn_metadata=self.backend.build_metadata(step.layout, self.device.torch),
            kv_caches=self.kv_caches,
            cos=cos,
            sin=sin,
            fused=self.fused,
        )
        ids = self.device.tensor(step.token_ids, torch.int64)  # [num_tokens]
        if carry is not None:
            carry.apply(ids)
        return step, ctx, ids

    @torch.inference_mode()
    def hidden_forward(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor) -> torch.Tensor:
        """For a model that reads a hidden state per token besides its ids (an EAGLE-3 head,
        `input_hidden_size`): its output [num_tokens, hidden_size] for `hidden` [num_tokens,
        input_hidden_size], from a captured graph where one holds the step, else eagerly."""
        if self.graphs is not None:
            out = self.graphs.hidden_states(chunks, hidden)
            if out is not NOT_CAPTURED:
                return out
        _, ctx, ids = self.step_inputs(chunks)
        return self.model(ids, ctx, hidden)

    @torch.inference_mode()
    def kv_forward(self, chunks: Sequence[SeqChunk], hidden: torch.Tensor) -> None:
        """For a model that can write its K/V alone (an EAGLE-3 head, `write_kv`): write the
        chunks' K/V for `hidden` [num_tokens, input_hidden_size] as hidden_forward would, and
        nothing else; from a captured graph where one holds the step, else eagerly."""
        if self.graphs is not None and self.graphs.kv_states(chunks, hidden) is not NOT_CAPTURED:
            return
        _, ctx, ids = self.step_inputs(chunks)
        assert isinstance(self.model, Eagle3Head), "only a head writes its K/V alone"
        self.model.write_kv(ids, ctx, hidden)

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[SeqChunk], carry: Carry | None = None
    ) -> torch.Tensor | None:
        """One forward over all chunks -> logits [sum of num_logits, vocab_size] (float32),
        rows in chunk order, or None when no chunk asks for logits. A decode or verify step
        that fits a captured CUDA graph replays it instead (the taps of a model an EAGLE-3 head
        reads included). `carry`: input tokens the previous step sampled on the device."""
        self.last_off_graph = False
        if self.graphs is not None:
            logits = self.graphs.forward(chunks, carry)
            if logits is not NOT_CAPTURED:
                return logits
            self.last_off_graph = self.graphs.covers(sum(len(c.token_ids) for c in chunks))
        step, ctx, ids = self.step_inputs(chunks, carry)
        hidden = self.model(ids, ctx)  # [num_tokens, hidden_size]
        if not step.logit_rows:
            return None
        # Indexing a device tensor with a Python list copies the list to the device from
        # pageable memory, blocking; the rows go through to_device like the other step inputs.
        rows = self.device.tensor(step.logit_rows, torch.int64)  # [num_logits]
        return self.model.compute_logits(hidden[rows])  # [num_logits, vocab_size]
