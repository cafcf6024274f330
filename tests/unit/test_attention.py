"""The CPU paged-attention backends equal dense causal attention: torch however it groups the
requests (and its per-layer gather stays within the workspace the memory plan reserves), cpu
(our kernel) on every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.attention import BACKENDS, get_attention_backend
from engine.attention.cpu_paged import CpuPagedMetadata
from engine.attention.torch_attn import (
    GATHER_WORKSPACE_TOKENS,
    TorchAttentionBackend,
    group_requests,
)
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
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (4, 2), (8, 2), (7, 1), (16, 2)])
@pytest.mark.parametrize("head_dim", [20, 40])  # 40: two 16-column value passes and one of 8
def test_cpu_kernel_matches_dense_at_every_group_size(num_heads, num_kv_heads, head_dim):
    """Query heads per KV head 1, 2, 4, 7 and 8 (the kernel scores up to 3 heads and weighs
    values for up to 6 in one pass, so groups split into passes of several sizes): dense
    causal attention to float32 summation order, on decode, verify and prompt-chunk rows."""
    backend = get_attention_backend("cpu", torch.device("cpu"))
    case = make_case(
        [1, 5, 19],
        [300, 40, 0],
        16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=num_heads,
    )
    meta = backend.build_metadata(case.layout, torch.device("cpu"))
    scale = head_dim**-0.5
    out = backend.forward(case.query, case.key, case.value, case.k_cache, case.v_cache, meta, scale)
    torch.testing.assert_close(out, dense_reference(case, scale), atol=1e-5, rtol=1e-5)


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


# ------------------------------------------------------------------------------ torch's gather


class GatherRecorder(TorchFunctionMode):
    """Records the bytes of every gather from the paged caches: an index into a view of a cache
    that copies (a gather) rather than views it."""

    def __init__(self, *caches: torch.Tensor) -> None:
        super().__init__()
        self.storages = {c.untyped_storage().data_ptr() for c in caches}
        self.sizes: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (
            getattr(func, "__name__", None) == "__getitem__"
            and args[0].untyped_storage().data_ptr() in self.storages
            and out.untyped_storage().data_ptr() not in self.storages
        ):
            self.sizes.append(out.numel() * out.element_size())
        return out


def test_requests_are_grouped_within_the_workspace():
    # Equal query lengths: consecutive requests while (longest context x requests) fits.
    assert group_requests([1] * 4, [10, 30, 5, 50], 60) == [(0, 2), (2, 3), (3, 4)]
    assert group_requests([4] * 3, [10, 10, 10], 30) == [(0, 3)]
    # A context longer than the workspace is gathered alone.
    assert group_requests([1] * 3, [100, 5, 5], 60) == [(0, 1), (1, 3)]
    # Mixed query lengths: one request at a time.
    assert group_requests([3, 1], [10, 10], 1000) == [(0, 1), (1, 2)]


@pytest.mark.parametrize("workspace", [8, 40, GATHER_WORKSPACE_TOKENS])
@pytest.mark.parametrize("name", [*CASES, "many_decodes"])
def test_torch_backend_gathers_within_its_workspace_and_matches_dense(name, workspace):
    """However the requests are grouped, the output is dense attention's, and no gather holds
    more context tokens than `max_gathered_tokens` allows (the plan reserves that many)."""
    query_lens, context_lens = CASES.get(name, ([1] * 12, [5, 9, 14, 3, 11, 7, 15, 6, 2, 13, 8, 4]))
    case = make_case(query_lens, context_lens, 4, seed=workspace)
    backend = TorchAttentionBackend(workspace_tokens=workspace)
    meta = backend.build_metadata(case.layout, torch.device("cpu"))
    scale = 16**-0.5
    with GatherRecorder(case.k_cache, case.v_cache) as gathers:
        out = backend.forward(
            case.query, case.key, case.value, case.k_cache, case.v_cache, meta, scale
        )
    torch.testing.assert_close(out, dense_reference(case, scale), atol=1e-5, rtol=1e-5)
    token_bytes = case.k_cache[0, 0].numel() * case.k_cache.element_size()  # one token's K
    limit = backend.max_gathered_tokens(max(case.layout.seq_lens)) * token_bytes
    assert max(gathers.sizes) <= limit
    groups = group_requests(case.layout.query_lens, case.layout.seq_lens, workspace)
    assert len(gathers.sizes) == 2 * len(groups)  # K and V of every group, once
    if name == "many_decodes" and workspace == 40:  # groups of several requests, and several
        assert 1 < len(groups) < 12
