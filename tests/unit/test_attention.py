"""The torch paged-attention backend equals dense causal attention, on both of its paths."""

from __future__ import annotations

import pytest
import torch

from engine.attention import get_attention_backend
from tests.attention_cases import dense_reference, make_case

CASES = {
    "decode_uniform_ctx": ([1, 1, 1], [7, 7, 7]),
    "decode_ragged_ctx": ([1, 1, 1, 1], [0, 5, 31, 16]),
    "verify_uniform": ([4, 4], [9, 20]),
    "mixed_prefill_decode": ([13, 1, 5, 1], [0, 12, 3, 40]),
    "single_prefill": ([21], [0]),
    "prefill_chunk_after_context": ([8], [19]),
}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_backend_matches_dense(name, block_size):
    query_lens, context_lens = CASES[name]
    case = make_case(query_lens, context_lens, block_size, seed=block_size)
    backend = get_attention_backend("torch", torch.device("cpu"))
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


def test_auto_is_torch_on_cpu():
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
