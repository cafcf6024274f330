"""An EAGLE-3 head as the engine runs it (paged KV, fused projections, the extend after a step,
chained drafts) gives what a plain dense reference written here from the format's definition
gives: the K/V the extend writes, the hidden state it keeps, and the greedy drafts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from engine import SamplingParams
from tests.unit.eagle3_head_helpers import TAPS, _head, _llm, build_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory)


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
