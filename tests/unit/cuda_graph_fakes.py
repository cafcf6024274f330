"""The CUDA pieces faked for checking CUDA graphs on CPU (tests/unit/test_cuda_graphs.py,
tests/unit/test_make_cuda_graphs.py).

The fakes: a capture device whose "graph" re-runs the captured callable on replay (writing into
the output tensor it returned at capture, as a real graph writes into its captured memory), a
device that says CUDA and allocates on the CPU, and a plain-torch flash_attn_varlen_func with the
kernel's contract asserted (int32 offsets, query and key lengths within the fixed maxima, one
query token per entry on the single-query path) and NaN in every output row no sequence covers.
Beside them: the tiny model's parts, a runner-like object over them, and an engine config.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from engine.config import EngineConfig
from engine.execution.runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.models.rope import RotaryEmbedding
from engine.runtime.device import Device
from engine.speculative_config import SpeculativeConfig

BLOCK_SIZE = 256  # flash-attn's page size
NUM_BLOCKS = 6  # blocks requests own; the pad block is one more
MAX_MODEL_LEN = 512


def reference_varlen(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """flash_attn_varlen_func over a paged cache, in plain torch: each sequence's queries attend
    to the first seq_len keys its block table points at, causally aligned to the bottom right."""
    assert causal
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
    num_seqs = cu_seqlens_q.numel() - 1
    assert cu_seqlens_k.numel() == num_seqs + 1 and block_table.shape[0] == num_seqs
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if max_seqlen_q == 1 and num_heads > num_kv_heads:
        # flash-attn's single-query path ignores cu_seqlens_q: one query token per entry.
        assert q.shape[0] == num_seqs
        assert cu_seqlens_q.tolist() == list(range(num_seqs + 1))
    bs = k_cache.shape[1]
    out = torch.full_like(q, float("nan"))  # the kernel leaves uncovered rows unwritten
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(num_seqs):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        assert 0 <= q_len <= max_seqlen_q and 0 <= k_len <= max_seqlen_k
        if q_len == 0:
            continue
        assert q_len <= k_len
        blocks = block_table[b, : -(-k_len // bs)].long()
        assert int(blocks.max()) < k_cache.shape[0]
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:k_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:k_len]
        groups = num_heads // num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu_q[b] : cu_q[b + 1]], k) * softmax_scale
        q_pos = torch.arange(k_len - q_len, k_len)[:, None]
        scores = scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


class FakeGraph:
    """Replay re-runs the captured callable into the tensor (or tensors) the capture returned."""

    def __init__(self, fn, out: torch.Tensor | tuple[torch.Tensor, ...] | None) -> None:
        self.fn, self.out, self.num_replays = fn, out, 0

    def replay(self) -> None:
        self.num_replays += 1
        new = self.fn()
        if self.out is None:  # a graph whose work is its writes (K/V only)
            assert new is None
        elif isinstance(self.out, tuple):
            for out, value in zip(self.out, new, strict=True):
                out.copy_(value)
        else:
            self.out.copy_(new)


class FakeCaptureDevice:
    """Records what was captured, in order; host copies are synchronous on CPU."""

    def __init__(self) -> None:
        self.graphs: list[FakeGraph] = []

    def capture(self, fn):
        out = fn()
        self.graphs.append(FakeGraph(fn, out))
        return self.graphs[-1], out

    def copies_queued(self) -> None:
        pass

    def wait_copies(self) -> None:
        pass


def load_model_parts(path: Path) -> tuple:
    """The tiny model at `path`: its config, its float32 model on the CPU and its rotary tables
    (what `_runner` runs)."""
    cfg = ModelConfig.from_path(path)
    model = load_model(cfg, torch.float32, torch.device("cpu"))
    rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim, MAX_MODEL_LEN, torch.device("cpu"))
    return cfg, model, rope


def _runner(model_parts, backend, num_blocks: int) -> SimpleNamespace:
    """A runner-like object: what ModelRunner.forward and CudaGraphs read."""
    cfg, model, rope = model_parts
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    runner = SimpleNamespace(
        model=model,
        rope=rope,
        backend=backend,
        block_size=BLOCK_SIZE,
        pad_block=NUM_BLOCKS,
        dtype=torch.float32,
        device=Device("cpu"),
        kv_caches=tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)),
        graphs=None,
        fused=False,
    )
    runner.step_inputs = lambda chunks, carry=None: ModelRunner.step_inputs(runner, chunks, carry)  # type: ignore[arg-type]
    return runner


class FakeCudaDevice(Device):
    """Says CUDA, allocates on the CPU: lets make_cuda_graphs run its CUDA branch here."""

    def __init__(self) -> None:
        super().__init__("cpu")

    @property
    def is_cuda(self) -> bool:
        return True

    def memory_info(self) -> tuple[int, int] | None:
        return None


def _config(tiny_llama, **kwargs) -> EngineConfig:
    if "speculative_config" in kwargs:  # a mapping, parsed as the edges parse it
        kwargs["speculative_config"] = SpeculativeConfig.parse(kwargs["speculative_config"])
    return EngineConfig(model=str(tiny_llama), device="cpu", **kwargs)
