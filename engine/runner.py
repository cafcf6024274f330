"""The model runner: owns the model, the paged KV tensors and the sampler; runs one step.

A step is ONE forward over the flattened query tokens of every scheduled request (prompt chunks
and decode tokens mixed), then logits only for the rows that sample, then one batched sampler call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import BatchLayout, get_attention_backend
from engine.config import EngineConfig, ModelConfig
from engine.models.llama import ForwardContext, RotaryEmbedding
from engine.models.loader import load_model
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingRow

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_MEMORY = 2 << 30  # bytes


@dataclass(frozen=True)
class StepInput:
    """One scheduled request as the runner sees it, fixed when the step is built (the request's
    counters move on in the update)."""

    request: Request
    start: int  # first position computed this step (= num_computed_tokens before the step)
    num_new_tokens: int
    block_table: tuple[int, ...]
    samples: bool  # the step reaches the last known token, so it yields a new token

    @classmethod
    def build(cls, request: Request, num_new_tokens: int, block_table: list[int]) -> StepInput:
        start = request.num_computed_tokens
        return cls(
            request=request,
            start=start,
            num_new_tokens=num_new_tokens,
            block_table=tuple(block_table),
            samples=start + num_new_tokens == request.num_tokens,
        )


def kv_cache_blocks(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """How many KV blocks to allocate: num_kv_blocks, else kv_cache_memory bytes, else enough for
    max_num_seqs full-length sequences, capped by a default memory budget."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = model_config.kv_bytes_per_token * dtype.itemsize * config.block_size
    memory = config.kv_cache_memory
    if memory is None:
        wanted = config.max_num_seqs * -(-max_model_len // config.block_size) * bytes_per_block
        memory = min(wanted, _default_memory(config))
    return max(1, memory // bytes_per_block)


def _default_memory(config: EngineConfig) -> int:
    device = config.torch_device()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return _DEFAULT_CPU_KV_MEMORY


class ModelRunner:
    """Runs the target model over paged KV for a batch of scheduled requests."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        num_blocks: int,
    ) -> None:
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(model_config)
        self.block_size = config.block_size
        self.model = load_model(model_config, self.dtype, self.device)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.rope = RotaryEmbedding(
            model_config.hf_config, model_config.head_dim, max_model_len, self.device
        )
        shape = (num_blocks, config.block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = tuple(
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(model_config.num_layers)
        )
        self.sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s",
            num_blocks,
            config.block_size,
            2 * sum(k.numel() * k.element_size() for k, _ in self.kv_caches) / 2**20,
            self.backend.name,
        )

    @torch.inference_mode()
    def execute(self, inputs: list[StepInput]) -> SamplerOutput | None:
        """Run one forward over all inputs; sample for the inputs whose `samples` is true (in
        order). Returns None when no input samples (only prompt chunks in flight)."""
        hidden, sample_idx = self._forward(inputs)
        if not sample_idx:
            return None
        logits = self.model.compute_logits(hidden[sample_idx])  # [num_sampling, vocab_size]
        rows = [
            SamplingRow(
                params=s.request.params,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
                generator=s.request.generator,
            )
            for s in inputs
            if s.samples
        ]
        return self.sampler.sample(logits, rows)

    def _forward(self, inputs: list[StepInput]) -> tuple[torch.Tensor, list[int]]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        for s in inputs:
            end = s.start + s.num_new_tokens
            token_ids += s.request.all_token_ids[s.start : end]
            span = range(s.start, end)
            positions += span
            table = s.block_table
            slots += [table[p // bs] * bs + p % bs for p in span]
            if s.samples:
                sample_idx.append(len(token_ids) - 1)
        layout = BatchLayout(
            query_lens=tuple(s.num_new_tokens for s in inputs),
            seq_lens=tuple(s.start + s.num_new_tokens for s in inputs),
            block_tables=tuple(s.block_table for s in inputs),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_size=bs,
        )
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        cos, sin = self.rope(pos, self.dtype)
        ctx = ForwardContext(
            backend=self.backend,
            attn_metadata=self.backend.build_metadata(layout, self.device),
            kv_caches=self.kv_caches,
            cos=cos,
            sin=sin,
        )
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return self.model(ids, ctx), sample_idx
