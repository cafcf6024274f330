"""The CPU paged-attention backends equal dense causal attention: torch on both of its paths,
cpu (our kernel for decode and verify steps, torch's path for longer queries) on all of them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention import BACKENDS, get_attention_backend
from engine.attention.cpu_paged import CpuPagedMetadata
from engine.kernels import cpu_kernels
from tests.attention_cases import dense_reference, make_case

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are unavailable")
CPU_BACKENDS = ["torch", pytest.param("cpu", marks=needs_kernels)]

CASES = {
    "decode_uniform_ctx": ([1, 1, 1], [7, 7, 7]),
    "decode_ragged_ctx": ([1, 1, 1, 1], [0, 5, 31, 16]),
    "verify_uniform": ([4, 4], [9, 20]),
    "mixed_prefill_decode": ([13, 1, 5, 1], [0, 12, 3, 40]),
    "single_prefill": ([21], [0]),
    "prefill_chunk_after_context": ([8], [19]),
}


@pytest.mark.parametrize("backend_name", CPU_BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_backends_match_dense(name, block_size, backend_name):
    query_lens, context_lens = CASES[name]
    case = make_case(query_lens, context_lens, block_size, seed=block_size)
    backend = get_attention_backend(backend_name, torch.device("cpu"))
    meta = backend.build_metadata(case.layout, torch.device("cpu"))
    scale = 16**-0.5
    out = backend.forward(case.query, case.key, case.value, case.k_cache, case.v_cache, meta, scale)
    torch.testing.assert_close(out, dense_reference(case, scale), atol=1e-5, rtol=1e-5)
    # The new K/V landed in their slots.
    k_flat = case.k_cache.view(-1, *case.k_cache.shape[2:])
    torch.testing.assert_close(k_flat[case.layout.slot_mapping], case.key)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("nope", torch.device("cpu"))


@needs_kernels
@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [
        ([1], [0]),  # a first token attends to itself only
        ([1, 1, 1], [300, 7, 90]),  # decode, contexts across many blocks
        ([5, 3], [40, 0]),  # verify steps of different draft counts
        ([16, 1], [17, 33]),  # a verify step of 15 drafts beside a decode row
        ([70, 1, 33], [0, 40, 9]),  # prompt chunks (the kernel takes them too) and a decode row
    ],
)
@pytest.mark.parametrize("head_dim", [16, 64, 20])  # 20: a tail past the 8- and 16-wide loops
def test_cpu_kernel_steps_match_dense(query_lens, context_lens, head_dim):
    """The kernel itself (not the torch fallback) runs these steps, in float32 to float32
    summation order and in bfloat16 to one rounding of its output, with 6 query heads per KV
    head (grouped-query attention)."""
    backend = get_attention_backend("cpu", torch.device("cpu"))
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        case = make_case(
            query_lens,
            context_lens,
            16,
            num_heads=12,
            num_kv_heads=2,
            head_dim=head_dim,
            dtype=dtype,
            seed=head_dim,
        )
        meta = backend.build_metadata(case.layout, torch.device("cpu"))
        assert isinstance(meta, CpuPagedMetadata)
        scale = head_dim**-0.5
        out = backend.forward(
            case.query, case.key, case.value, case.k_cache, case.v_cache, meta, scale
        )
        assert out.dtype == dtype and out.shape == case.query.shape
        reference = dense_reference(case, scale)
        torch.testing.assert_close(out.float(), reference, atol=tol, rtol=tol)
        k_flat = case.k_cache.view(-1, *case.k_cache.shape[2:])
        assert torch.equal(k_flat[case.layout.slot_mapping], case.key)


@needs_kernels
def test_cpu_backend_runs_prompt_chunks_by_the_kernel_too():
    """Every step is the kernel's, so a decode row is computed alike beside a prompt chunk
    (batch invariance: tests/unit/test_batch_invariance_kernels.py holds its bits)."""
    case = make_case([200, 1], [0, 5], 4)
    meta = get_attention_backend("cpu", torch.device("cpu")).build_metadata(
        case.layout, torch.device("cpu")
    )
    assert isinstance(meta, CpuPagedMetadata)


def test_auto_on_cpu_is_the_kernel_backend_where_it_builds(monkeypatch):
    expected = "cpu" if cpu_kernels() is not None else "torch"
    assert get_attention_backend("auto", torch.device("cpu")).name == expected
    unbuilt = dataclasses.replace(BACKENDS["cpu"], is_available=lambda: False)
    monkeypatch.setitem(BACKENDS, "cpu", unbuilt)
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
