"""The KV budget's arithmetic (engine/execution/kv_plan.py), with chosen memory figures: no device needed."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.attention.base import BatchLayout
from engine.attention.torch_attn import TorchAttentionBackend
from engine.execution.kv_plan import (
    DEFAULT_CPU_KV_MEMORY,
    GiB,
    KVPlan,
    activation_bytes,
    plan_for,
    plan_kv_cache,
)
from tests.unit.test_attention import GatherRecorder

MiB = 2**20


def test_num_kv_blocks_skips_the_budget():
    plan = plan_kv_cache(1000, (0, 80 * GiB), num_kv_blocks=7, kv_cache_memory=10)
    assert plan.num_blocks == 7 and plan.budget == 7000 and plan.source == "num_kv_blocks"


def test_cpu_kv_cache_memory_bounds_the_sum_of_both_models():
    # Target 3000 + draft 1000 bytes per block: 10_000 bytes hold 2 blocks of both, not 3.
    plan = plan_kv_cache(3000 + 1000, None, kv_cache_memory=10_000)
    assert plan.num_blocks == 2 and plan.budget == 10_000
    assert "kv_cache_memory" in plan.source


def test_cpu_default_is_capped_by_full_length_sequences():
    plan = plan_kv_cache(4096, None, full_length_bytes=40 * 4096)
    assert plan.num_blocks == 40
    plan = plan_kv_cache(4096, None, full_length_bytes=100 * GiB)
    assert plan.num_blocks == DEFAULT_CPU_KV_MEMORY // 4096
    # An explicit kv_cache_memory is not capped.
    assert plan_kv_cache(4096, None, kv_cache_memory=GiB, full_length_bytes=4096).num_blocks == (
        GiB // 4096
    )


def test_gpu_budget_is_measured_after_the_weights():
    # 80 GiB device, 20 GiB in use after loading every weight, 2 GiB of activations.
    total, free, reserve = 80 * GiB, 60 * GiB, 2 * GiB
    per_block = 3 * MiB
    plan = plan_kv_cache(
        per_block, (free, total), gpu_memory_utilization=0.9, activation_reserve=reserve
    )
    budget = int(0.9 * total) - (total - free) - reserve
    assert plan.budget == budget and plan.num_blocks == budget // per_block
    assert plan.num_blocks * per_block <= 0.9 * total - (total - free) - reserve
    half = plan_kv_cache(
        per_block, (free, total), gpu_memory_utilization=0.5, activation_reserve=reserve
    )
    assert half.num_blocks == (40 * GiB - 20 * GiB - reserve) // per_block
    assert "gpu_memory_utilization 0.5" in half.source


def test_gpu_budget_ignores_the_cpu_defaults():
    plan = plan_kv_cache(MiB, (60 * GiB, 80 * GiB), full_length_bytes=10 * MiB)
    assert plan.num_blocks == (int(0.9 * 80 * GiB) - 20 * GiB) // MiB


def test_kv_cache_memory_is_an_upper_bound_on_gpu():
    info = (60 * GiB, 80 * GiB)
    assert plan_kv_cache(MiB, info, kv_cache_memory=GiB).num_blocks == 1024
    # Asking for more than the GPU allows gets what it allows.
    plan = plan_kv_cache(MiB, info, kv_cache_memory=500 * GiB)
    assert plan.num_blocks == (int(0.9 * 80 * GiB) - 20 * GiB) // MiB


def test_a_budget_without_room_for_one_block_raises_with_the_numbers():
    with pytest.raises(ValueError, match="cannot hold one block") as err:
        plan_kv_cache(MiB, (8 * GiB, 80 * GiB), gpu_memory_utilization=0.9, activation_reserve=GiB)
    message = str(err.value)
    assert "72.00 GiB in use" in message and "80.00 GiB total" in message
    assert "gpu_memory_utilization" in message
    with pytest.raises(ValueError, match="cannot hold one block"):
        plan_kv_cache(MiB, None, kv_cache_memory=MiB - 1)


def test_activation_reserve_formula():
    cfg = SimpleNamespace(
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
    )
    # Layer: 3*4096 + 2*4096 + 2*1024 + 3*14336 = 65536 values a token; logits: bf16 + 3 fp32.
    expected = 2048 * 2 * 65536 + 512 * 128256 * (2 + 12)
    assert activation_bytes(cfg, 2, num_tokens=2048, num_logit_rows=512) == expected


def _gpu_plan(backend: object, max_len: int) -> KVPlan:
    """plan_for on an 80 GiB device with 20 GiB in use, for one float32 model with 1 KV head of
    4 (16 bytes of K a token) whose attention is `backend`."""
    cfg = SimpleNamespace(
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        vocab_size=100,
    )
    device = SimpleNamespace(is_cuda=True, memory_info=lambda: (60 * GiB, 80 * GiB))
    runner = SimpleNamespace(
        kv_bytes_per_block=MiB,
        model_config=cfg,
        dtype=torch.float32,
        backend=backend,
        device=device,
    )
    config = SimpleNamespace(
        max_num_batched_tokens=256,
        max_num_seqs=8,
        block_size=16,
        enforce_eager=True,
        attention_backend=backend.name,  # type: ignore[attr-defined]
        num_kv_blocks=None,
        kv_cache_memory=None,
        gpu_memory_utilization=0.9,
    )
    return plan_for(config, [runner], max_len, max_num_drafts=0)  # type: ignore[arg-type]


def test_the_plan_reserves_what_the_torch_backend_gathers():
    """A decode step of 5 requests of 8000 tokens (40k context tokens, past the torch backend's
    workspace): the K and V one layer gathers fit in what the plan reserves for the torch
    backend beyond a backend that reads the paged cache in place (flash_attn)."""
    block_size, num_reqs, seq_len = 16, 5, 8000
    num_blocks = seq_len // block_size
    tables = tuple(tuple(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(num_reqs))
    layout = BatchLayout(
        query_lens=(1,) * num_reqs,
        seq_lens=(seq_len,) * num_reqs,
        block_tables=tables,
        slot_mapping=torch.tensor([t[-1] * block_size + block_size - 1 for t in tables]),
        block_size=block_size,
    )
    gen = torch.Generator().manual_seed(0)
    cache_shape = (num_reqs * num_blocks, block_size, 1, 4)
    k_cache, v_cache = (torch.randn(cache_shape, generator=gen) for _ in range(2))
    query, key, value = (torch.randn(num_reqs, n, 4, generator=gen) for n in (2, 1, 1))
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(layout, torch.device("cpu"))
    with GatherRecorder(k_cache, v_cache) as gathers:
        backend.forward(query, key, value, k_cache, v_cache, meta, 0.5)
    peak = 2 * max(gathers.sizes)  # one group's K and V are alive together
    flash = SimpleNamespace(name="flash_attn")
    reserved = _gpu_plan(flash, seq_len).budget - _gpu_plan(backend, seq_len).budget
    assert 0 < peak <= reserved


def test_the_plan_reserves_the_triton_backends_split_partials():
    """The Triton backend's split path writes float32 partials for at most `split_tokens`
    tokens a layer (engine/attention/triton_attn.py); the plan reserves them beyond a backend
    that needs no scratch, bounded however long the contexts grow."""
    pytest.importorskip("triton")
    from engine.attention import triton_attn

    backend = triton_attn.TritonAttentionBackend()
    flash = SimpleNamespace(name="flash_attn")
    for max_len in (200, 8000, 1 << 20):
        reserved = _gpu_plan(flash, max_len).budget - _gpu_plan(backend, max_len).budget
        tokens = triton_attn.split_tokens(2, 1, 4, max_len)
        assert reserved == tokens * triton_attn.partial_bytes(2, 4, max_len)
        assert reserved <= triton_attn.SPLIT_SCRATCH_BYTES
        assert (reserved > 0) == (max_len > triton_attn.PARTITION)


# Run in a fresh interpreter: in a test worker the heap holds whatever earlier tests left (free
# lists that serve the chunks below, arenas trimmed or not), and the resident set it reads is the
# worker's whole history.
_TRIM_CHECK = """
import ctypes
from pathlib import Path

from engine.execution.kv_plan import release_freed_heap


def resident():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 << 10  # below glibc's mmap threshold: from the heap
chunks, keepers = [], []
for _ in range(1600):
    chunks.append(libc.malloc(size))
    ctypes.memset(chunks[-1], 1, size)
    keepers.append(libc.malloc(1024))  # stays live: the freed chunks cannot merge
for chunk in chunks:
    libc.free(chunk)
before = resident()
released = release_freed_heap()
after = resident()
for keeper in keepers:
    libc.free(keeper)
print(int(released), before, after)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_freed_heap_gives_freed_pages_back():
    """What loading frees stays resident in glibc's arenas until trimmed: 100 MiB freed between
    live allocations (so the heap's top cannot shrink by itself) leave the resident set only when
    release_freed_heap runs."""
    run = subprocess.run(
        [sys.executable, "-c", _TRIM_CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert run.returncode == 0, run.stderr
    released, before, after = (int(v) for v in run.stdout.split())
    assert released
    assert before - after > 50 << 20, (before, after)


def test_the_graph_pool_reserve_counts_an_eagle3_heads_taps_and_hidden_input():
    """With CUDA graphs, a target an EAGLE-3 head taps keeps its taps for a whole step (eager)
    and as a second output of its graphs; the head's graphs read their hidden input from a
    fixed tensor: all three are reserved beside the activations."""
    cfg = SimpleNamespace(
        hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=4,
        vocab_size=100,
    )  # fmt: skip
    device = SimpleNamespace(is_cuda=True, memory_info=lambda: (60 * GiB, 80 * GiB))
    config = SimpleNamespace(
        max_num_batched_tokens=256, max_num_seqs=8, block_size=16, enforce_eager=False,
        attention_backend="flash_attn", num_kv_blocks=None, kv_cache_memory=None,
        gpu_memory_utilization=0.9,
    )  # fmt: skip
    flash = SimpleNamespace(name="flash_attn")

    def budget(taps: tuple[int, ...], width: int) -> int:
        target, head = (
            SimpleNamespace(
                kv_bytes_per_block=MiB,
                model_config=cfg,
                dtype=torch.float32,
                backend=flash,
                device=device,
                model=model,
            )  # fmt: skip
            for model in (
                SimpleNamespace(aux_layers=taps),
                SimpleNamespace(input_hidden_size=width),
            )
        )
        return plan_for(config, [target, head], 512, max_num_drafts=3).budget  # type: ignore[arg-type]

    graph_tokens = min(256, 8 * (1 + 3))  # the captured step's tokens
    eager_taps = 2 * 64 * 4 * 256
    graph_taps = 2 * 64 * 4 * graph_tokens
    hidden_input = 64 * 4 * graph_tokens
    assert budget((), 0) - budget((0, 1), 64) == eager_taps + graph_taps + hidden_input
