"""Serving GGUF-quantised weights as the file stores them (quantization gguf).

On tiny models whose weights are GGUF blocks in every format the kernels read (fused
projections mixing formats, a llama file with llama.cpp's q/k row order, a Qwen2 model with a tied
quantised embedding): the weights every quantised linear multiplies by equal the dequantised
checkpoint exactly, greedy float32 output equals transformers on the dequantised model token for
token (a divergence is accepted only at a near-tie, which the test measures), speculation stays
lossless on top of it, and the setting resolves as documented."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams, kernels
from engine.models.gguf import GGUF_FILE_NAME, Q4_KT
from engine.models.linears import QuantEmbedding, QuantLinear
from tests.gguf_models import MIXED_FORMATS, Q, build_tiny_gguf_model
from tests.integration.test_greedy_parity import MAX_TOKENS, PROMPTS, _reference

pytestmark = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)

# The dense model's top two logits closer than this are a tie float32 rounding may break
# either way (its logits are O(1), the two paths differ by ~1e-6).
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    return build_tiny_gguf_model(tmp_path_factory.mktemp("gguf-llama"), "llama")


@pytest.fixture(scope="module")
def gguf_qwen2(tmp_path_factory):
    formats = {k: v for k, v in MIXED_FORMATS.items() if k != "lm_head"}
    formats["embed_tokens"] = Q.Q8_0  # tied: the LM head multiplies by the embedding's blocks
    return build_tiny_gguf_model(
        tmp_path_factory.mktemp("gguf-qwen2"),
        "qwen2",
        seed=1,
        formats=formats,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module", params=["gguf_llama", "gguf_qwen2"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def _greedy(llm: LLM) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.block_manager.num_used_blocks == 0
    return [o.outputs[0].token_ids for o in outputs]


def test_every_quantised_weight_equals_the_dequantised_checkpoint(model_dir):
    quant = LLM(str(model_dir), dtype="float32", quantization="gguf")
    dense = LLM(str(model_dir), dtype="float32", quantization="none")
    dense_params = dict(dense.engine.runner.model.named_parameters())
    compared = 0
    for name, module in quant.engine.runner.model.named_modules():
        if isinstance(module, QuantLinear):
            weight = module.dequantized_weight()
        elif isinstance(module, QuantEmbedding):
            weight = module.quant_weight.dequantize()
        else:
            continue
        assert torch.equal(weight, dense_params[f"{name}.weight"]), name
        compared += 1
    layers = dense.engine.model_config.num_layers
    has_head = dense.engine.runner.model.lm_head is not None
    assert compared == 4 * layers + 1 + has_head  # qkv, o, gate_up, down; embedding; head
    assert quant.engine.quantization.startswith("gguf (")
    assert dense.engine.quantization == "none"
    # Only the blocks are held, not a dense copy: the quantised model's weights are smaller.
    assert quant.engine.runner.weight_bytes < dense.engine.runner.weight_bytes / 2


def _near_tie_at_divergence(model_dir, prompt, ours, expected) -> float:
    """The dense model's top-2 logit gap where `ours` first leaves `expected`."""
    i = next(i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + expected[:i]])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_greedy_output_equals_the_dequantised_model(model_dir):
    expected = _reference(model_dir)
    ours = _greedy(LLM(str(model_dir), dtype="float32", quantization="gguf"))
    for prompt, got, want in zip(PROMPTS, ours, expected, strict=True):
        if got != want:
            assert _near_tie_at_divergence(model_dir, prompt, got, want) < NEAR_TIE, (got, want)
    assert sum(got == want for got, want in zip(ours, expected, strict=True)) >= len(PROMPTS) - 1


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_quantised_weights_is_lossless(gguf_llama, method):
    plain = _greedy(LLM(str(gguf_llama), dtype="float32", quantization="gguf"))
    spec = {
        "method": method,
        "mode": "always",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "draft_min_confidence": 0.0,
    }
    if method == "draft_model":
        spec["model"] = str(gguf_llama)  # a quantised draft: the target itself
    llm = LLM(str(gguf_llama), dtype="float32", quantization="gguf", speculative_config=spec)
    assert _greedy(llm) == plain
    assert llm.engine.spec_stats.num_draft_tokens > 0
    if method == "draft_model":
        assert llm.engine.draft_runner.quantization == llm.engine.quantization


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_with_int8_activations_is_lossless(gguf_llama, method):
    """gguf_activations int8 changes the products (the activations are rounded), not what
    speculation guarantees: a row's result does not depend on the batch, so greedy output with
    drafts equals greedy output without."""
    plain_llm = LLM(str(gguf_llama), quantization="gguf", gguf_activations="int8")
    plain = _greedy(plain_llm)
    assert plain_llm.engine.runner.weight_format.endswith("int8 activations")
    modules = [m for m in plain_llm.engine.runner.model.modules() if isinstance(m, QuantLinear)]
    assert modules and all(m.int8_activations for m in modules)
    # Q4_K blocks are served in the int8 product's order (Q4_KT), still named by their file's format.
    served = [(q, o) for m in modules for q, o in zip(m.qtypes, m.origins, strict=True)]
    assert (Q4_KT, "Q4_K") in served and all(q != int(Q.Q4_K) for q, _ in served)
    assert plain != _greedy(LLM(str(gguf_llama), quantization="gguf"))  # the setting is in use
    spec = {
        "method": method,
        "mode": "always",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
        "draft_min_confidence": 0.0,
    }
    if method == "draft_model":
        spec["model"] = str(gguf_llama)
    llm = LLM(
        str(gguf_llama), quantization="gguf", gguf_activations="int8", speculative_config=spec
    )
    assert _greedy(llm) == plain
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_int8_activations_are_a_checked_choice(tiny_llama):
    with pytest.raises(ValueError, match="gguf_activations must be one of float32, int8"):
        LLM(str(tiny_llama), gguf_activations="int4")
    # Dense weights have no blocks to multiply: the setting changes nothing there.
    dense = LLM(str(tiny_llama), dtype="float32", gguf_activations="int8").engine.runner
    assert dense.quantization == "none" and dense.weight_format == "float32"


def test_auto_serves_the_blocks_and_none_serves_dense(gguf_llama, tiny_llama):
    assert LLM(str(gguf_llama), dtype="float32").engine.quantization.startswith("gguf")
    # A plain checkpoint has no GGUF file: auto serves it dense, gguf says why it cannot.
    assert LLM(str(tiny_llama), dtype="float32").engine.quantization == "none"
    with pytest.raises(ValueError, match=f"no {GGUF_FILE_NAME}"):
        LLM(str(tiny_llama), dtype="float32", quantization="gguf")


def test_dtype_auto_runs_the_blocks_in_float32(gguf_llama, tiny_llama):
    """The kernels' own precision where blocks are served; an explicit dtype wins."""
    runner = LLM(str(gguf_llama)).engine.runner
    assert runner.quantization.startswith("gguf") and runner.dtype == torch.float32
    assert runner.weight_format.endswith("float32 activations")
    assert LLM(str(gguf_llama), dtype="bfloat16").engine.runner.dtype == torch.bfloat16


def test_a_file_that_does_not_match_its_checkpoint_is_refused(tmp_path):
    # Blocks from another seed: the converted checkpoint was not made from this file.
    model = build_tiny_gguf_model(tmp_path / "a", "llama", seed=3)
    other = build_tiny_gguf_model(tmp_path / "b", "llama", seed=4)
    (model / GGUF_FILE_NAME).unlink()
    (model / GGUF_FILE_NAME).symlink_to(other / GGUF_FILE_NAME)
    with pytest.raises(ValueError, match="do not match the converted checkpoint"):
        LLM(str(model), dtype="float32", quantization="gguf")


def test_quantization_is_checked_with_the_config():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="x", quantization="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(model="x", quantization="gguf", device="cuda", attention_backend="torch")
