"""EAGLE-3 heads in the published format: the loader's checks name each mismatch, and the head as
the engine runs it (paged KV, fused projections, the extend after a step, chained drafts) gives
what a plain dense reference written here from the format's definition gives."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.models.config import ModelConfig
from engine.models.eagle3.config import Eagle3Config
from tests.conftest import build_tiny_model
from tests.eagle3_heads import build_tiny_eagle3_head

LAYERS = 4
TAPS = [1, 2, 3]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("eagle3-target"), "llama", seed=3, num_hidden_layers=LAYERS
    )


def _head(tmp_path, target, **kwargs):
    kwargs.setdefault("aux_layer_ids", TAPS)
    return build_tiny_eagle3_head(tmp_path / "head", target, **kwargs)


def _llm(target, head, **spec):
    return LLM(
        str(target),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        max_model_len=128,
        speculative_config={
            "method": "eagle3",
            "model": str(head),
            "mode": "always",
            "num_speculative_tokens": 3,
            "draft_min_confidence": 0.0,
            **spec,
        },
    )


# ----------------------------------------------------------------------------- the checks


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


# ----------------------------------------------------------------------------- the reference


def _rope(x, positions, theta, head_dim):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = positions[:, None].double() * inv[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Reference:
    """The head from its files, dense: position t takes token t + 1 and h_t."""

    def __init__(self, head_dir, target_dir):
        self.t = {k: v.float() for k, v in load_file(head_dir / "model.safetensors").items()}
        self.cfg = json.loads((head_dir / "config.json").read_text())
        if "embed_tokens.weight" not in self.t:
            target = load_file(target_dir / "model.safetensors")
            self.t["embed_tokens.weight"] = target["model.embed_tokens.weight"].float()
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def step(self, tokens, hidden, positions):
        """New positions (their tokens and h) after every earlier one -> pre-norm outputs."""
        t, c = self.t, self.cfg
        eps, hd = c["rms_norm_eps"], c["hidden_size"] // c["num_attention_heads"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        emb = t["embed_tokens.weight"][tokens]
        normed = _rms(hidden, t["midlayer.hidden_norm.weight"], eps)
        residual = normed if c.get("norm_before_residual") else hidden
        x = torch.cat((_rms(emb, t["midlayer.input_layernorm.weight"], eps), normed), -1)
        n = len(tokens)
        q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, nh, hd)
        k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, nkv, hd)
        v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, nkv, hd)
        q, k = _rope(q, positions, c["rope_theta"], hd), _rope(k, positions, c["rope_theta"], hd)
        self.keys.append(k)
        self.values.append(v)
        keys, values = torch.cat(self.keys), torch.cat(self.values)
        rep = nh // nkv
        keys, values = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(hd)
        offset = len(keys) - n
        mask = torch.ones(n, len(keys), dtype=torch.bool).tril(offset)
        scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, nh * hd)
        y = residual + attn @ t["midlayer.self_attn.o_proj.weight"].T
        z = _rms(y, t["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = z @ t["midlayer.mlp.gate_proj.weight"].T, z @ t["midlayer.mlp.up_proj.weight"].T
        return y + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T

    def draft(self, out):
        """The greedy draft from a pre-norm output, as a target id (d2t is an offset)."""
        logits = _rms(out, self.t["norm.weight"], self.cfg["rms_norm_eps"])
        best = int((logits @ self.t["lm_head.weight"].T).argmax())
        return best + int(self.t["d2t"][best])


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(with_embedding=True, norm_before_residual=True, draft_vocab_size=320),
    ],
    ids=["shared-embedding-d2t", "own-embedding-full-vocab"],
)
def test_head_drafts_what_the_dense_reference_drafts(tmp_path, target, variant):
    """After a prompt's prefill, the engine's head (extended over the prompt from the target's
    taps) drafts the same 3 greedy tokens as the reference fed the transformers target's
    hidden states, and its last output matches."""
    from transformers import AutoModelForCausalLM

    variant = {"draft_vocab_size": 200, **variant}
    head = _head(tmp_path, target, dtype=torch.float32, **variant)
    llm = _llm(target, head)
    engine = llm.engine
    prompt = [1, 17, 42, 99, 5, 230, 64, 7, 18, 250, 3]
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # prefill: the target samples token P, the head extends positions 0..P-1
    request = engine.scheduler.running[0]
    tokens = list(request.all_token_ids)  # prompt + the first sampled token
    proposer = engine.speculator.chain[0]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in TAPS], -1)  # [P, 3H]: the input of each tapped layer
    ref = Reference(head, target)
    fc = ref.t["fc.weight"]
    positions = torch.arange(len(prompt))
    outs = ref.step(torch.tensor(tokens[1:]), aux @ fc.T, positions)
    state = proposer._states[request.request_id]
    assert state.num_computed == len(prompt)
    # The extend wrote only K/V (the reference's at every prompt position) and kept the last
    # position's token and h for the first draft's forward.
    assert state.last_token == tokens[-1]
    torch.testing.assert_close(state.last_hidden, (aux @ fc.T)[-1], rtol=1e-4, atol=1e-4)
    k_cache, v_cache = proposer.runner.kv_caches[0]
    table = engine.scheduler.block_manager.get_block_table(request.request_id)
    size = k_cache.shape[1]
    slots = [table[p // size] * size + p % size for p in range(len(prompt))]
    for cache, ref_kv in ((k_cache, ref.keys[0]), (v_cache, ref.values[0])):
        written = cache.view(-1, *cache.shape[2:])[slots].float()
        torch.testing.assert_close(written, ref_kv, rtol=1e-4, atol=1e-4)
    expected, h = [], outs[-1]
    for j in range(3):
        expected.append(ref.draft(h))
        h = ref.step(torch.tensor([expected[-1]]), h[None], torch.tensor([len(prompt) + j]))[0]
    drafts = []
    propose = proposer.propose

    def spy(requests, max_lengths):
        drafts.extend(propose(requests, max_lengths))
        return drafts[-len(requests) :] if requests else []

    proposer.propose = spy
    engine.step()  # the decode step: the scheduler grants 3 drafts, the head chains them
    assert len(drafts) == 1 and drafts[0] is not None
    assert list(drafts[0].token_ids) == expected
    d2t = ref.t["d2t"]
    assert set(expected) <= set((torch.arange(len(d2t)) + d2t).tolist())


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
