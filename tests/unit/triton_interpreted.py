"""The Triton paged-attention kernel's checks, run on CPU by Triton's interpreter: the backend
equals the torch reference (and dense attention) on every shape of step, with GQA, several page
sizes, shuffled block tables and sliding windows, and a request's output bits do not depend on
its batch.

Not collected by a plain `pytest tests/` (no test_ prefix): tests/unit/test_triton_attn.py runs
this file in a pytest subprocess with TRITON_INTERPRET=1. Triton decides between compiling and
interpreting when a function is decorated with `triton.jit`, its own library functions included
(at `import triton`), so the variable must be set before Triton is first imported, and a process
that sets it has no compiled Triton left: a separate process keeps it away from every other test.

What the interpreter runs: float32 and float16. Not bfloat16: it holds bfloat16 as uint16 and its
`tl.dot` multiplies those integers (Triton 3.9), so bfloat16 is checked on CUDA only
(tests/gpu/test_triton_attn.py).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "run by tests/unit/test_triton_attn.py under TRITON_INTERPRET=1", allow_module_level=True
    )

from engine.attention import triton_attn  # noqa: E402
from engine.attention.torch_attn import TorchAttentionBackend  # noqa: E402
from engine.core.chunks import SeqChunk  # noqa: E402
from engine.execution.cuda_graphs import CudaGraphs, GraphableBackend  # noqa: E402
from engine.models.config import ModelConfig  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.models.rope import RotaryEmbedding  # noqa: E402
from tests.attention_cases import (  # noqa: E402
    PAGED_STEPS,
    PagedCase,
    dense_reference,
    make_case,
    request_alone,
)
from tests.unit.test_cuda_graphs import (  # noqa: E402
    NUM_BLOCKS,
    SIZES,
    FakeCaptureDevice,
    _assert_same_kv,
    _runner,
    eager,
)

CPU = torch.device("cpu")


def run_triton(case: PagedCase, scale: float, window: int | None = None) -> torch.Tensor:
    """The Triton backend's step over `case` (writes the step's K/V into case's caches)."""
    backend = triton_attn.TritonAttentionBackend()
    meta = backend.build_metadata(case.layout, CPU)
    return backend.forward(
        case.query,
        case.key,
        case.value,
        case.k_cache,
        case.v_cache,
        meta,
        scale,
        sliding_window=window,
    )


def run_torch(case: PagedCase, scale: float) -> torch.Tensor:
    """The torch reference over a copy of `case`'s caches."""
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(case.layout, CPU)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    return backend.forward(case.query, case.key, case.value, k_cache, v_cache, meta, scale)


def test_the_kernel_runs_in_the_interpreter():
    # Without this the checks below would need a GPU, or test nothing.
    assert type(triton_attn.paged_attention_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", list(PAGED_STEPS))
def test_matches_the_torch_reference(name, block_size):
    query_lens, context_lens = PAGED_STEPS[name]
    case = make_case(query_lens, context_lens, block_size, seed=block_size)
    scale = 16**-0.5
    expected = run_torch(case, scale)
    out = run_triton(case, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, dense_reference(case, scale), atol=1e-5, rtol=1e-5)
    # The step's own K/V went into their slots: what later steps read.
    k_flat = case.k_cache.view(-1, *case.k_cache.shape[2:])
    assert torch.equal(k_flat[case.layout.slot_mapping], case.key)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 4, 16), (8, 1, 16), (6, 2, 24)],  # no GQA, one KV head, a head_dim padded to 32
)
def test_gqa_groups_and_head_dims(num_heads, num_kv_heads, head_dim):
    query_lens, context_lens = PAGED_STEPS["mixed"]
    case = make_case(query_lens, context_lens, 16, num_heads, num_kv_heads, head_dim, seed=3)
    scale = head_dim**-0.5
    out = run_triton(case, scale)
    torch.testing.assert_close(out, dense_reference(case, scale), atol=1e-5, rtol=1e-5)


def test_large_pages():
    # A 256-token page holds several 64-key tiles: a key's slot is found the same way.
    case = make_case([3, 1], [150, 300], 256, seed=4)
    out = run_triton(case, 0.25)
    torch.testing.assert_close(out, run_torch(case, 0.25), atol=1e-5, rtol=1e-5)


def test_float16_matches_the_reference():
    query_lens, context_lens = PAGED_STEPS["mixed"]
    case = make_case(query_lens, context_lens, 16, dtype=torch.float16, seed=5)
    out = run_triton(case, 0.25)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), dense_reference(case, 0.25), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("window", [1, 7, 64, 100])
def test_sliding_window_matches_dense_attention(window):
    # Contexts past 64 + window: the first tiles are skipped, and windows cross tile edges.
    case = make_case([1, 6, 1, 2], [150, 100, 3, 70], 16, seed=window)
    out = run_triton(case, 0.25, window)
    torch.testing.assert_close(out, dense_reference(case, 0.25, window), atol=1e-5, rtol=1e-5)


def test_a_request_gets_the_same_bits_alone_and_beside_others():
    query_lens, context_lens = PAGED_STEPS["mixed"]
    case = make_case(query_lens, context_lens, 16, seed=6)
    batch_out = run_triton(case, 0.25)  # also writes every request's K/V into the cache
    # (request, chunk length): a request's last tokens alone, as a shorter chunk or a decode.
    for index, query_len in [(0, 13), (0, 1), (0, 4), (1, 1), (2, 5), (2, 2), (4, 1)]:
        layout, rows = request_alone(case, index, query_len)
        meta = triton_attn.TritonAttentionBackend().build_metadata(layout, CPU)
        alone = triton_attn.paged_attention(
            case.query[rows], case.k_cache, case.v_cache, meta, 0.25
        )
        assert torch.equal(alone, batch_out[rows]), (index, query_len)


# Contexts within one partition, at its edge, and across two to four (PARTITION = 256), as
# decodes, a verify chunk and a prompt chunk that starts in one partition and ends in the next.
SPLIT_STEP = ([1, 1, 1, 1, 4, 9], [0, 255, 256, 700, 400, 250])


@pytest.mark.parametrize("window", [None, 1, 100, 300, 600])
def test_split_contexts_get_the_same_bits_on_both_paths(window):
    assert triton_attn.PARTITION == 256  # the contexts above straddle its edges
    case = make_case(*SPLIT_STEP, 16, seed=11)
    meta = triton_attn.TritonAttentionBackend().build_metadata(case.layout, CPU)
    whole = run_triton(case, 0.25, window)  # writes the step's K/V, then attends
    args = (case.query, case.k_cache, case.v_cache, meta, 0.25, window)
    one_launch = triton_attn.paged_attention(*args, split=False)
    split = triton_attn.paged_attention(*args, split=True)
    assert torch.equal(split, one_launch)
    assert torch.equal(whole, one_launch)  # this step is short enough to split: the rule's path
    torch.testing.assert_close(split, dense_reference(case, 0.25, window), atol=1e-5, rtol=1e-5)


def test_the_split_path_is_chosen_by_the_step_and_bounded():
    cfg = dict(num_heads=4, num_kv_heads=2, head_dim=16)
    # Nothing to split within one partition; past it, fewer programs than the threshold split.
    assert triton_attn.split_tokens(**cfg, max_seq_len=256) == 0
    limit = triton_attn.split_tokens(**cfg, max_seq_len=4096)
    assert limit * 2 < triton_attn.SPLIT_BELOW_PROGRAMS <= (limit + 1) * 2
    # A long context bounds the tokens by the scratch instead, whatever the heads.
    long = dict(num_heads=64, num_kv_heads=8, head_dim=128, max_seq_len=1 << 17)
    tokens = triton_attn.split_tokens(**long)
    per_token = triton_attn.partial_bytes(64, 128, 1 << 17)
    assert tokens >= 1 and tokens * per_token <= triton_attn.SPLIT_SCRATCH_BYTES
    assert (tokens + 1) * per_token > triton_attn.SPLIT_SCRATCH_BYTES
    assert triton_attn.num_partitions(1000) == 4 and triton_attn.num_partitions(1000, 257) == 2
    assert triton_attn.num_partitions(1000, 258) == 3  # keys 255 .. 512


def test_a_long_prompt_chunk_and_its_decodes_agree_bit_for_bit():
    """A prompt chunk too long to split (one launch) and the same tokens decoded one by one
    (split): the attention of each token does not depend on the path its step took."""
    case = make_case([3, 140], [600, 300], 16, seed=12)
    limit = triton_attn.split_tokens(4, 2, 16, max(case.layout.seq_lens))
    assert 1 < limit < case.layout.num_tokens  # the whole step runs in one launch
    batch_out = run_triton(case, 0.25)
    for index, query_len in [(1, 1), (1, 2), (0, 1), (0, 3)]:
        layout, rows = request_alone(case, index, query_len)
        meta = triton_attn.TritonAttentionBackend().build_metadata(layout, CPU)
        alone = triton_attn.paged_attention(
            case.query[rows], case.k_cache, case.v_cache, meta, 0.25
        )
        assert torch.equal(alone, batch_out[rows]), (index, query_len)


def test_token_positions_follow_the_layout():
    case = make_case([3, 1, 2], [0, 5, 9], 16)
    token_seq, token_pos = triton_attn.token_positions(case.layout)
    assert token_seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert token_pos.tolist() == [0, 1, 2, 5, 9, 10]


def test_captured_steps_replay_the_eager_steps(tiny_llama):
    """CUDA graphs over the Triton backend (its static metadata: padded tokens in a pad row of
    the block table, writing only the pad block), replayed by a capture device that re-runs
    the body: the logits and the K/V of every decode and verify step equal the eager Triton
    step's, and no request's block is touched by padding. The contexts' K/V are random (the
    same on both sides): what is compared is the step, not the prompt."""
    cfg = ModelConfig.from_path(tiny_llama)
    rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim, 512, CPU)
    parts = (cfg, load_model(cfg, torch.float32, CPU), rope)
    backend = triton_attn.TritonAttentionBackend()
    assert isinstance(backend, GraphableBackend)
    ref = _runner(parts, backend, NUM_BLOCKS)
    graphed = _runner(parts, triton_attn.TritonAttentionBackend(), NUM_BLOCKS + 1)
    gen = torch.Generator().manual_seed(0)
    for (k, v), (k_ref, v_ref) in zip(graphed.kv_caches, ref.kv_caches, strict=True):
        for cache, cache_ref in ((k, k_ref), (v, v_ref)):
            cache_ref.copy_(torch.randn(cache_ref.shape, generator=gen))
            cache[:NUM_BLOCKS].copy_(cache_ref)
    capture = FakeCaptureDevice()
    graphs = CudaGraphs(graphed, SIZES, capture)
    rng = random.Random(0)
    seqs = {"a": (250, [4, 1]), "b": (10, [3]), "c": (40, [5, 0])}  # context, blocks
    starts = {name: n for name, (n, _) in seqs.items()}
    # (tokens, logits) per sequence: decode and verify steps, then mixed ones the Triton
    # backend replays too, whatever the longest query: a prompt chunk short of its end (no
    # logits) or reaching it (one) beside decodes, longer than any verify graph's query (5).
    steps = (
        {"a": (1, 1), "b": (1, 1), "c": (1, 1)},
        {"a": (1, 1), "b": (3, 3), "c": (5, 5)},
        {"b": (2, 2)},
        {"a": (5, 5), "c": (2, 2)},
        {"a": (1, 1), "b": (9, 0), "c": (1, 1)},
        {"b": (7, 1), "c": (4, 0)},
    )
    for lens in steps:
        chunks = []
        for name, (n, num_logits) in lens.items():
            ids = [rng.randrange(3, 320) for _ in range(n)]
            chunks.append(SeqChunk(ids, starts[name], seqs[name][1], num_logits))
            starts[name] += n
        replays = sum(g.num_replays for g in capture.graphs)
        logits = graphs.forward(chunks)
        assert sum(g.num_replays for g in capture.graphs) == replays + 1, "ran eagerly"
        expected = eager(ref, chunks)
        assert torch.equal(logits, expected)  # the same kernel on the same values, row for row
        _assert_same_kv(graphed, ref)
