"""A real conversion of a tiny GGUF file written here: it converts once to a loadable Hugging Face
directory (config, weights, tokenizer), the dense checkpoint only when a dense path needs it,
and a model served from the GGUF blocks without the dense checkpoint equals the one served
beside it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, kernels
from engine.models import bundled
from tests.unit.bundled_fakes import _forbid_conversion

_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TOKENS += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "Ġa"]
_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _write_tiny_llama_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 1-layer llama (hidden 16, 2 heads, 1 kv head, vocab 32) with a byte-level BPE vocab;
    returns the weights as transformers should read them back."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    hidden, ffn, vocab = 16, 32, len(_TOKENS)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(8)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))  # 3: control (special) tokens
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(_TEMPLATE)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd": (vocab, hidden),
        "output_norm": (hidden,),
        "blk.0.attn_norm": (hidden,),
        "blk.0.attn_q": (16, hidden),
        "blk.0.attn_k": (8, hidden),
        "blk.0.attn_v": (8, hidden),
        "blk.0.attn_output": (hidden, 16),
        "blk.0.ffn_norm": (hidden,),
        "blk.0.ffn_gate": (ffn, hidden),
        "blk.0.ffn_up": (ffn, hidden),
        "blk.0.ffn_down": (hidden, ffn),
    }
    weights = {}
    for name, shape in shapes.items():
        value = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.ffn_down":  # one quantized tensor, so dequantization is exercised
            packed = quantize(value, GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"{name}.weight", packed, raw_dtype=GGMLQuantizationType.Q8_0)
            value = dequantize(packed, GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{name}.weight", value)
        weights[name] = value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def test_tiny_gguf_converts_to_a_loadable_hf_dir_once(tmp_path: Path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    weights = _write_tiny_llama_gguf(gguf_path)
    out = bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert out.parent == tmp_path / "cache" / "gguf" and out.name.startswith("tiny-")
    assert (out / bundled.MARKER_NAME).is_file()
    assert (out / "model.gguf").resolve() == gguf_path
    assert not list(out.glob("*.safetensors"))  # no dense weights until a dense path needs them
    assert bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", dense=True) == out

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (16, 1, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    assert config["tie_word_embeddings"] is True  # the file has no output.weight
    assert config["torch_dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    state = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in state.values())

    def expected(name: str) -> torch.Tensor:
        return torch.from_numpy(weights[name]).to(torch.bfloat16)

    assert torch.equal(state["model.embed_tokens.weight"], expected("token_embd"))
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"], expected("blk.0.ffn_down"))
    assert torch.equal(state["model.layers.0.self_attn.v_proj.weight"], expected("blk.0.attn_v"))
    # llama.cpp interleaves the rotary halves of q per head; the converter must undo it.
    q = expected("blk.0.attn_q").reshape(2, 4, 2, 16).transpose(1, 2).reshape(16, 16)
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], q)

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert tokenizer.chat_template == _TEMPLATE
    assert tokenizer("ab a")["input_ids"] == [_TOKENS.index("ab"), _TOKENS.index("Ġa")]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(model.model.norm.weight, expected("output_norm"))

    _forbid_conversion(monkeypatch)
    assert bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", dense=True) == out


@pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)
def test_gguf_blocks_serve_the_same_without_the_dense_checkpoint(tmp_path: Path):
    """Without model.safetensors the norms and the weights in formats the kernels do not read
    (here float32 q/k, in llama.cpp's row order) come from the GGUF file, as the conversion would
    have stored them: the model and its output equal those loaded beside the dense checkpoint,
    which the first dense load (quantization none) writes."""
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(gguf_path)
    out = bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def load(quantization: str) -> tuple[dict[str, torch.Tensor], list[int]]:
        llm = LLM(str(out), dtype="float32", quantization=quantization, num_kv_blocks=16)
        assert llm.engine.quantization == ("none" if quantization == "none" else "gguf (Q8_0)")
        model = llm.engine.runner.model
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        tokens = llm.generate([[3, 4, 5, 6, 7]], params)[0].outputs[0].token_ids
        return weights, tokens

    from_file, tokens = load("gguf")
    assert "layers.0.mlp.down_proj.weight" not in from_file  # the Q8_0 blocks, not a parameter
    assert "layers.0.self_attn.qkv_proj.weight" in from_file  # float32 in the file: dense
    assert not any(out.glob("*.safetensors"))
    load("none")
    assert any(out.glob("*.safetensors"))  # written by the dense load, on first use
    beside_dense, tokens_beside_dense = load("gguf")
    assert tokens_beside_dense == tokens
    assert beside_dense.keys() == from_file.keys()
    for name, value in from_file.items():
        assert torch.equal(value, beside_dense[name]), name
