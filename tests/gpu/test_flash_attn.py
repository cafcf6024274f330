"""flash-attn paged backend vs the torch reference on CUDA (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import flash_attn_available, get_attention_backend
from tests.attention_cases import dense_reference, make_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flash_attn_available(), reason="needs CUDA and flash-attn"),
    pytest.mark.gpu_check("flash-attn kernel vs dense attention"),
]


@pytest.mark.parametrize(
    ("query_lens", "context_lens"),
    [([1, 1, 1], [300, 7, 520]), ([13, 1, 5], [0, 260, 3]), ([4, 4], [9, 600])],
)
def test_flash_attn_matches_dense(query_lens, context_lens):
    device = torch.device("cuda")
    case = make_case(
        query_lens, context_lens, block_size=256, head_dim=64, dtype=torch.float16, device="cuda"
    )
    backend = get_attention_backend("flash_attn", device)
    meta = backend.build_metadata(case.layout, device)
    scale = 64**-0.5
    out = backend.forward(case.query, case.key, case.value, case.k_cache, case.v_cache, meta, scale)
    torch.testing.assert_close(
        out.float().cpu(), dense_reference(case, scale), atol=2e-3, rtol=2e-3
    )
