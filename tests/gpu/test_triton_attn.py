"""The Triton paged-attention backend on CUDA: it equals the torch reference and dense attention
in every dtype it serves, on every shape of step, with real models' head layouts, long contexts,
several page sizes and sliding windows, and a request's output bits do not depend on its batch
(skipped without CUDA and Triton; the same checks run on CPU in Triton's interpreter, see
tests/unit/triton_interpreted.py, bfloat16 excepted)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import get_attention_backend, triton_available
from engine.attention.torch_attn import TorchAttentionBackend
from tests.attention_cases import PAGED_STEPS, PagedCase, dense_reference, make_case, request_alone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not triton_available(), reason="needs CUDA and Triton"),
    pytest.mark.gpu_check("Triton kernel vs the torch reference"),
]

CUDA = torch.device("cuda")
# (atol, rtol) against float32 dense attention: the output's own rounding, and bf16/fp16
# probabilities in the P @ V product (as flash-attn rounds them).
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
DTYPES = list(TOLERANCE)


def run_triton(case: PagedCase, scale: float, window: int | None = None) -> torch.Tensor:
    """The backend's step over `case` (writes the step's K/V into case's caches)."""
    backend = get_attention_backend("triton", CUDA)
    meta = backend.build_metadata(case.layout, CUDA)
    kwargs = {} if window is None else {"sliding_window": window}
    return backend.forward(
        case.query, case.key, case.value, case.k_cache, case.v_cache, meta, scale, **kwargs
    )


def run_torch(case: PagedCase, scale: float) -> torch.Tensor:
    """The torch reference over a copy of `case`'s caches."""
    backend = TorchAttentionBackend()
    meta = backend.build_metadata(case.layout, CUDA)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    return backend.forward(case.query, case.key, case.value, k_cache, v_cache, meta, scale)


def assert_near(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("name", list(PAGED_STEPS))
def test_triton_matches_the_torch_reference(name, block_size, dtype):
    query_lens, context_lens = PAGED_STEPS[name]
    case = make_case(query_lens, context_lens, block_size, dtype=dtype, device="cuda")
    scale = 16**-0.5
    expected = run_torch(case, scale)
    out = run_triton(case, scale)
    assert out.dtype == dtype
    assert_near(out, dense_reference(case, scale), dtype)
    assert_near(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(12, 2, 128), (32, 8, 128), (14, 2, 64), (16, 16, 64), (8, 1, 80)],
    ids=["qwen2.5-1.5b", "llama-3.1-8b", "qwen2.5-0.5b", "mha", "head-dim-80"],
)
def test_real_head_layouts_and_long_contexts(num_heads, num_kv_heads, head_dim, dtype):
    case = make_case(
        [1, 37, 1, 6, 1],
        [2000, 300, 5, 700, 64],
        16,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype=dtype,
        device="cuda",
    )
    scale = head_dim**-0.5
    assert_near(run_triton(case, scale), dense_reference(case, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [1, 7, 64, 100, 4096])
def test_sliding_window_matches_dense_attention(window, dtype):
    case = make_case([1, 6, 1, 2], [1500, 100, 3, 70], 16, dtype=dtype, device="cuda")
    out = run_triton(case, 0.25, window)
    assert_near(out, dense_reference(case, 0.25, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_request_gets_the_same_bits_alone_and_beside_others(dtype):
    case = make_case([13, 1, 5, 1, 3], [0, 12, 640, 40, 30], 16, dtype=dtype, device="cuda")
    backend = get_attention_backend("triton", CUDA)
    batch_out = run_triton(case, 0.25)  # also writes every request's K/V into the cache
    for index, query_len in [(0, 13), (0, 1), (0, 4), (1, 1), (2, 5), (2, 2), (4, 1)]:
        layout, rows = request_alone(case, index, query_len)
        meta = backend.build_metadata(layout, CUDA)
        alone = backend.forward(
            case.query[rows],
            case.key[rows],
            case.value[rows],
            case.k_cache,
            case.v_cache,
            meta,
            0.25,
        )
        assert torch.equal(alone, batch_out[rows]), (index, query_len)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 300])
def test_split_contexts_get_the_same_bits_on_both_paths(dtype, window):
    """The split path (partials, then their merge) and the one-launch path run the same float32
    operations, so their bits agree on the card too, where the compiler schedules both."""
    from engine.attention import triton_attn

    case = make_case(
        [1, 1, 1, 4, 9], [255, 256, 3000, 700, 250], 16, 12, 2, 128, dtype=dtype, device="cuda"
    )
    out = run_triton(case, 0.25, window)
    meta = get_attention_backend("triton", CUDA).build_metadata(case.layout, CUDA)
    args = (case.query, case.k_cache, case.v_cache, meta, 0.25, window)
    split = triton_attn.paged_attention(*args, split=True)
    assert torch.equal(split, triton_attn.paged_attention(*args, split=False))
    assert torch.equal(split, out)
    assert_near(split, dense_reference(case, 0.25, window), dtype)
