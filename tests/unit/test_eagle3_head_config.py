"""EAGLE-3 heads' configs in the published formats: the loader's checks name each mismatch (a head
that does not fit the target, a missing or misshapen tensor, default taps named twice), the
vllm-project/speculators layout reads as the same head with its own defaults and refusals, and
a made head's config carries the target's RoPE."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import SamplingParams
from engine.models.config import ModelConfig
from engine.models.eagle3.config import Eagle3Config
from tests.conftest import build_tiny_model
from tests.unit.eagle3_head_helpers import TAPS, _head, _llm, build_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory)


def _edit_config(head, **changes):
    raw = json.loads((head / "config.json").read_text())
    raw.update(changes)
    (head / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(target_hidden_size=96), "hidden states of size 96"),
        (dict(vocab_size=999), "vocab_size 999"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}), "taps target"),
        (dict(num_hidden_layers=2), "one decoder layer"),
        (dict(architectures=["LlamaForCausalLM"]), "name no EAGLE-3 head"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_by_name(tmp_path, target, change, message):
    head = _head(tmp_path, target)
    _edit_config(head, **change)
    with pytest.raises(ValueError, match=message):
        _llm(target, head)


def test_a_missing_or_misshapen_tensor_is_named(tmp_path, target):
    head = _head(tmp_path, target)
    tensors = load_file(head / "model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensors midlayer.hidden_norm.weight"):
        _llm(target, head)
    tensors["midlayer.hidden_norm.weight"] = torch.ones(7)
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ValueError, match=r"hidden_norm.weight has shape \[7\]"):
        _llm(target, head)


def test_default_taps_follow_the_engines_numbering(target):
    head = Eagle3Config.from_dict(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "vocab_size": 320,
            "draft_vocab_size": 100,
        }
    )
    assert head.aux_layers(28) == (2, 14, 25)  # Qwen2.5-Coder-1.5B's depth
    assert head.aux_layers(32) == (2, 16, 29)
    assert head.num_kv_heads == 4 and head.head_dim == 16 and head.target_hidden_size == 64
    with pytest.raises(ValueError, match="named twice"):
        head.check_target(ModelConfig.from_path(target))  # the default (2, 2, 1) on 4 layers


def test_the_speculators_layout_reads_as_the_same_head(tmp_path, target):
    """vllm-project/speculators' layout (the layer's config nested, the taps and flags at the
    top, tensors under layers.0.) of the same tensors: the same head config, the same drafts
    and accepted counts, the same greedy output."""
    specforge = _head(tmp_path / "a", target, dtype=torch.float32, draft_vocab_size=200)
    speculators = _head(
        tmp_path / "b", target, dtype=torch.float32, draft_vocab_size=200, layout="speculators"
    )
    raw = json.loads((speculators / "config.json").read_text())
    assert "transformer_layer_config" in raw and "hidden_size" not in raw
    assert all(k.startswith("layers.0.") for k in load_file(speculators / "model.safetensors")
               if "_proj" in k or "layernorm" in k or "hidden_norm" in k)  # fmt: skip
    a, b = Eagle3Config.from_path(specforge), Eagle3Config.from_path(speculators)
    fields = [f for f in a.__dataclass_fields__ if f not in ("path", "raw")]
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}
    assert b.aux_layer_ids == tuple(TAPS) and not b.norm_before_residual
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 17, 42, 99, 5, 230, 64, 7], [9, 9, 31, 4]]
    results = []
    for head in (specforge, speculators):
        llm = _llm(target, head)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.spec_stats
        results.append((tokens, stats.num_draft_tokens, stats.num_accepted_tokens))
    assert results[0] == results[1] and results[0][1] > 0


def test_the_speculators_layouts_own_defaults_and_refusals(tmp_path, target):
    head = _head(tmp_path, target, dtype=torch.float32, layout="speculators")
    raw = json.loads((head / "config.json").read_text())
    del raw["norm_before_residual"]  # vLLM reads a speculators head without it as true
    assert Eagle3Config.from_dict(raw).norm_before_residual
    with pytest.raises(ValueError, match="norm_before_fc=True is not supported"):
        Eagle3Config.from_dict({**raw, "norm_before_fc": True})
    with pytest.raises(ValueError, match="speculators_model_type 'eagle' is not an EAGLE-3"):
        Eagle3Config.from_dict({**raw, "speculators_model_type": "eagle"})
    with pytest.raises(ValueError, match="needs transformer_layer_config"):
        Eagle3Config.from_dict({k: v for k, v in raw.items() if k != "transformer_layer_config"})


@pytest.mark.parametrize("scaled", [False, True])
def test_a_made_heads_config_carries_the_targets_rope(tmp_path, scaled):
    """head_config_dict (what the trainer exports) gives the head the target's RoPE tables: its
    theta, and a Llama 3.1 target's llama3 scaling (lost, the head would rotate its queries and
    keys by other angles than it was trained with past the first positions)."""
    from engine.models.eagle3.config import head_config_dict
    from engine.models.rope import RotaryEmbedding

    rope = {"rope_theta": 500000.0}
    if scaled:
        rope["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }  # fmt: skip
    path = build_tiny_model(tmp_path, "llama", max_position_embeddings=512, **rope)
    target = ModelConfig.from_path(path)
    raw = json.loads(json.dumps(head_config_dict(target, 100)))  # as written to config.json
    assert ("rope_scaling" in raw) == scaled
    head = Eagle3Config.from_dict(raw).as_model_config(target)
    cpu = torch.device("cpu")
    ours = RotaryEmbedding(head.hf_config, head.head_dim, 512, cpu)
    theirs = RotaryEmbedding(target.hf_config, target.head_dim, 512, cpu)
    assert torch.equal(ours.cos, theirs.cos) and torch.equal(ours.sin, theirs.sin)
