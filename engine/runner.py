"""The model runner: owns a model and its paged KV tensors; runs one flattened forward.

A step is ONE forward over the query tokens of every scheduled sequence back to back (prompt
chunks, decode tokens and draft tokens to verify alike), with logits only for the rows that
sample. The target model and a draft model each have a runner; they share block tables.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import BatchLayout, get_attention_backend
from engine.config import EngineConfig, ModelConfig
from engine.models.llama import ForwardContext, RotaryEmbedding
from engine.models.loader import load_model

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_MEMORY = 2 << 30  # bytes


@dataclass(frozen=True)
class SeqChunk:
    """The tokens of one sequence computed this step, and how many of the last ones need logits
    (0 for a prompt chunk that does not reach the end, 1 to sample, 1 + k to verify k drafts)."""

    token_ids: Sequence[int]
    start: int  # position of token_ids[0]
    block_table: Sequence[int]
    num_logits: int

    def __post_init__(self) -> None:
        assert self.token_ids and 0 <= self.num_logits <= len(self.token_ids)


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
    """Runs one model (the target, or a draft) over paged KV."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        num_blocks: int,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.device = config.torch_device()
        self.dtype = dtype or config.torch_dtype(model_config)
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
        logger.info(
            "%s KV cache: %d blocks of %d tokens (%.1f MiB), attention backend %s",
            model_config.path.name,
            num_blocks,
            config.block_size,
            2 * sum(k.numel() * k.element_size() for k, _ in self.kv_caches) / 2**20,
            self.backend.name,
        )

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor | None:
        """One forward over all chunks -> logits [sum of num_logits, vocab_size] (model dtype),
        rows in chunk order, or None when no chunk asks for logits."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_idx: list[int] = []
        for c in chunks:
            span = range(c.start, c.start + len(c.token_ids))
            token_ids += c.token_ids
            positions += span
            table = c.block_table
            slots += [table[p // bs] * bs + p % bs for p in span]
            logit_idx += range(len(token_ids) - c.num_logits, len(token_ids))
        layout = BatchLayout(
            query_lens=tuple(len(c.token_ids) for c in chunks),
            seq_lens=tuple(c.start + len(c.token_ids) for c in chunks),
            block_tables=tuple(tuple(c.block_table) for c in chunks),
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
        hidden = self.model(ids, ctx)  # [num_tokens, hidden_size]
        if not logit_idx:
            return None
        return self.model.compute_logits(hidden[logit_idx])  # [num_logits, vocab_size]
