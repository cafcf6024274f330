"""Quantized EAGLE-3 heads: our Q8_0 blocks are the gguf package's bytes and our Q6_K blocks read
back as it reads them (each weight within half a step), and a Q8_0 head, or a Q6_K head with
int8 activations, drafts with greedy output unchanged (a head too narrow for Q6_K refused)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import build_tiny_model
from tests.unit.eagle3_head_helpers import LAYERS, _head, _llm, build_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory)


def test_q8_0_blocks_are_the_gguf_packages(target):
    """Our Q8_0 quantiser writes the bytes the gguf package's reference quantiser writes, and the
    kernels' dequantisation of them is within half a step of the weight."""
    import gguf
    import numpy as np
    from gguf import quants

    from engine.models.gguf_quantize import quantize_q8_0

    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(4)) * 0.05
    weight[3, :32] = 0.0  # an all-zero block: scale 0
    ours = quantize_q8_0(weight)
    theirs = quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.blocks.numpy(), theirs)
    step = weight.reshape(48, 3, 32).abs().amax(-1, keepdim=True) / 127
    error = (ours.dequantize().reshape(48, 3, 32) - weight.reshape(48, 3, 32)).abs()
    assert bool((error <= step / 2 + 1e-4).all())


def test_a_q8_0_head_drafts_and_output_stays_greedy(tmp_path, target):
    head = _head(tmp_path, target)
    plain = _llm(target, head)
    quant = _llm(target, head, draft_quantization="q8_0")
    off = LLM(str(target), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 17, 42, 99, 5, 230, 64, 7], [1, 8, 8, 8, 9, 10, 8, 8, 8]]
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    for llm in (plain, quant):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
        assert llm.engine.spec_stats.num_draft_tokens > 0
    head_module = quant.engine.speculator.chain[0].head
    assert quant.engine.draft_runner.quantization == "gguf (Q8_0)"
    assert head_module.lm_head.qtypes == (8,)


def test_q6_k_blocks_read_back_as_the_gguf_package_reads_them():
    """Our Q6_K blocks (GGML's layout) dequantise, by the gguf package and by our kernels after
    the serving layout, to the same values, each within half its sub-block's step of the weight."""
    import gguf
    import numpy as np

    from engine.models.gguf import serving_layout
    from engine.models.gguf_quantize import quantize_q6_k

    weight = torch.randn(24, 512, generator=torch.Generator().manual_seed(6)) * 0.05
    weight[2, :16] = 0.0  # an all-zero sub-block
    weight[5, 256:] = 0.0  # an all-zero block: d 0
    weight[7, 40] = 0.9  # one large weight: its block's other scales are small beside it
    ours = quantize_q6_k(weight)
    assert ours.blocks.shape == (24, 2 * 210)
    theirs = gguf.dequantize(ours.blocks.numpy(), gguf.GGMLQuantizationType.Q6_K)
    theirs = torch.from_numpy(np.asarray(theirs, dtype=np.float32)).reshape(24, 512)
    assert torch.equal(serving_layout(ours).dequantize(), theirs)
    # Each sub-block's step, read from the blocks: within d of the ideal max|w| / 31, and every
    # weight within half of it.
    raw = ours.blocks.reshape(24, 2, 210)
    scales = raw[..., 192:208].contiguous().view(torch.int8).float()  # [24, 2, 16]
    d = raw[..., 208:].contiguous().view(torch.float16).float()  # [24, 2, 1]
    step = d * scales
    groups = weight.reshape(24, 2, 16, 16)
    ideal = groups.abs().amax(-1) / 31
    assert bool((step >= ideal * (1 - 1e-6)).all()) and bool((step <= ideal + d + 1e-7).all())
    error = (theirs.reshape(24, 2, 16, 16) - groups).abs()
    assert bool((error <= step[..., None] / 2 + 1e-6).all())
    assert bool((theirs[5, 256:] == 0).all()) and bool((theirs[2, :16] == 0).all())
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_q6_k(torch.zeros(4, 96))


def test_a_q6_k_head_with_int8_activations_drafts_and_output_stays_greedy(tmp_path, target):
    """A head whose every input width is a multiple of 256 runs in Q6_K blocks with the engine's
    int8 activations; greedy output equals speculation off's. A head that cannot is refused."""
    wide = build_tiny_model(
        tmp_path / "wide", "llama", seed=5, hidden_size=256, intermediate_size=512,
        num_hidden_layers=LAYERS,
    )  # fmt: skip
    head = _head(tmp_path, wide)
    common = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    spec = {
        "method": "eagle3",
        "model": str(head),
        "mode": "always",
        "num_speculative_tokens": 3,
        "draft_min_confidence": 0.0,
        "draft_quantization": "q6_k",
    }
    off = LLM(str(wide), **common)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 17, 42, 99, 5, 230, 64, 7], [1, 8, 8, 8, 9, 10, 8, 8, 8]]
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    quant = LLM(str(wide), **common, gguf_activations="int8", speculative_config=spec)
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params)]
    assert got == want
    assert quant.engine.spec_stats.num_draft_tokens > 0
    head_module = quant.engine.speculator.chain[0].head
    assert quant.engine.draft_runner.quantization == "gguf (Q6_K)"
    assert head_module.fc.int8_activations and head_module.midlayer.mlp.down_proj.int8_activations
    narrow = _head(tmp_path / "narrow", target)  # the 64-wide tiny target's head
    with pytest.raises(ValueError, match="multiples of 256"):
        _llm(target, narrow, draft_quantization="q6_k")
