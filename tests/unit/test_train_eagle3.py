"""`specserve train-eagle3` on a tiny target, in seconds on a CPU: the loss falls; the export has
exactly the published tensors (read with safetensors, not our loader); our engine serves the
head with greedy output unchanged, and on held-out prompts it is accepted more often than a
random head; the engine's head computes the trainer's unrolled logits (training-time test is
the engine's drafting); the loss computes only what counted positions need; and a run stopped
and resumed ends where a straight run ends, bit for bit (a resume over other data refused).
The trainer's data: tests/unit/test_train_eagle3_data.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.core.chunks import SeqChunk
from engine.models.eagle3.checkpoint import REQUIRED_KEYS
from engine.training.eagle3 import TrainConfig, make_head, train
from engine.training.eagle3_head import ttt_unroll
from tests.eagle3_heads import build_tiny_eagle3_head
from tests.unit.train_eagle3_helpers import _engine, _prompts, build_target, single_thread

TAPS = (1, 2, 3)
DRAFT_VOCAB = 96
NUM_TRAIN, NUM_HELD_OUT = 25, 8


HELD_OUT = _prompts(99, NUM_HELD_OUT)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from single_thread()


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory)


def _config(prompts: Path, out: Path, **overrides) -> TrainConfig:
    args = dict(
        prompts=prompts,
        out=out,
        draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=TAPS,
        max_tokens=24,
        max_seq_len=40,
        ttt_length=4,
        steps=200,
        lr=3e-3,
        warmup_steps=10,
        save_every=50,
        log_every=40,
    )
    args.update(overrides)
    return TrainConfig(**args)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    base = tmp_path_factory.mktemp("train-run")
    prompts = base / "prompts.jsonl"
    lines = [json.dumps({"prompt_ids": p}) for p in _prompts(7, NUM_TRAIN)]
    prompts.write_text("\n".join(lines) + "\n")
    result = train(_config(prompts, base / "out"), _engine(target))
    return result, prompts, base / "out"


def test_loss_falls(trained):
    result, _, out = trained
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == 200
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < 0.5 * first, (first, last)
    acc0 = [r["acc"][0] for r in result.metrics[-20:] if r["acc"][0] is not None]
    assert sum(acc0) / len(acc0) > 0.5
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 200


def test_export_has_exactly_the_published_tensors(trained, target):
    result, _, out = trained
    cfg = json.loads((target / "config.json").read_text())
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * (h // cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    shapes = {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (DRAFT_VOCAB, h),
        "d2t": (DRAFT_VOCAB,),
        "t2d": (vocab,),
    }
    assert set(shapes) == {*REQUIRED_KEYS, "t2d"}
    with safe_open(str(result.head_dir / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert set(tensors) == set(shapes)  # no embed_tokens: the target's is shared
    for name, shape in shapes.items():
        assert tuple(tensors[name].shape) == shape, name
        expected = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert tensors[name].dtype == expected, name
    used = json.loads((out / "vocab.json").read_text())
    assert used == sorted(used) and len(used) == DRAFT_VOCAB
    assert (tensors["d2t"] + torch.arange(DRAFT_VOCAB)).tolist() == used
    assert tensors["t2d"].nonzero().flatten().tolist() == used
    config = json.loads((result.head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["vocab_size"] == vocab and config["hidden_size"] == h
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(TAPS)


def _serve(target: Path, head: Path | None) -> tuple[list[list[int]], float]:
    spec = None
    if head is not None:
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                "mode": "always", "draft_min_confidence": 0.0}  # fmt: skip
    llm = LLM(str(target), dtype="float32", block_size=4, num_kv_blocks=96,
              max_model_len=64, speculative_config=spec)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(HELD_OUT, params)]
    stats = llm.engine.spec_stats
    rate = stats.num_accepted_tokens / max(stats.num_draft_tokens, 1)
    return [list(t) for t in outputs], rate


def test_engine_serves_the_head_and_it_beats_a_random_head(trained, target, tmp_path):
    result, _, _ = trained
    expected, _ = _serve(target, None)
    outputs, trained_rate = _serve(target, result.head_dir)
    assert outputs == expected  # greedy: speculation changes no token
    random_head = build_tiny_eagle3_head(
        tmp_path / "random", target, seed=6, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=[*TAPS]
    )
    outputs, random_rate = _serve(target, random_head)
    assert outputs == expected
    assert trained_rate > random_rate + 0.2, (trained_rate, random_rate)


def test_served_head_computes_what_the_trainer_trained(trained, target):
    """The engine's head over the exported weights, step 0 as its extend runs it (paged KV) and
    a chained step after it, gives the trainer's unrolled logits (same weights, rounded to the
    export's bfloat16): training-time test is the drafting the engine does."""
    result, _, out = trained
    spec = {"method": "eagle3", "model": str(result.head_dir), "num_speculative_tokens": 2}
    llm = LLM(str(target), dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=64,
              speculative_config=spec)  # fmt: skip
    engine = llm.engine
    raw = json.loads((result.head_dir / "config.json").read_text())
    used = json.loads((out / "vocab.json").read_text())
    ours = make_head(engine.runner.model, engine.model_config, raw, used, 64, torch.device("cpu"))
    ours.load_state_dict(load_file(result.head_dir / "model.safetensors"))
    feats = torch.load(out / "features" / "shard-00000.pt", weights_only=True)["sequences"][0]
    ids, aux = feats["token_ids"], feats["aux"].float()
    n = len(ids)
    k = n - 3  # head positions 0 .. k - 1 extended, then one chained step at position k
    with torch.no_grad():
        step0, step1 = (
            ours.lm_head(ours.norm(step.hidden))
            for step in ttt_unroll(ours, aux[: n - 1], ids[1:], 2)
        )
    served, runner = engine.draft_runner.model, engine.draft_runner
    assert engine.block_manager.allocate_slots("check", n)
    table = engine.block_manager.get_block_table("check")
    with torch.inference_mode():
        _, ctx, tokens = runner.step_inputs([SeqChunk(ids[1 : k + 1].tolist(), 0, table, 0)])
        extended = served(tokens, ctx, served.combine(aux[:k]))  # [k, H]
        _, ctx, tokens = runner.step_inputs([SeqChunk([int(ids[k + 1])], k, table, 1)])
        chained = served(tokens, ctx, extended[k - 1 :])  # [1, H]
        torch.testing.assert_close(served.compute_logits(extended), step0[:k], atol=2e-4, rtol=0)
        torch.testing.assert_close(
            served.compute_logits(chained), step1[k - 1 : k], atol=2e-4, rtol=0
        )


@pytest.mark.parametrize("ttt_length", [1, 3])
def test_the_loss_computes_only_what_counted_positions_need(trained, target, ttt_length):
    """ttt_loss leaves out the LM heads at uncounted rows and later steps at positions no later
    step scores (a prompt's): its loss, per-step figures and gradients equal those of every
    step at every position, scored where the position counts."""
    from engine.training.eagle3_data import SequenceFeatures
    from engine.training.eagle3_head import _shift, ttt_loss

    result, _, out = trained
    llm = LLM(**_engine(target))
    raw = json.loads((result.head_dir / "config.json").read_text())
    used = json.loads((out / "vocab.json").read_text())
    model, config = llm.engine.runner.model, llm.engine.model_config
    shard = torch.load(out / "features" / "shard-00000.pt", weights_only=True)["sequences"]
    for stored in shard[:3]:
        feats = SequenceFeatures(**{k: stored[k] for k in SequenceFeatures.__dataclass_fields__})
        feats = SequenceFeatures(**{**feats.__dict__, "aux": feats.aux.float()})
        lm_rows = torch.randn(
            len(used), config.hidden_size, generator=torch.Generator().manual_seed(0)
        )
        fast = make_head(model, config, raw, used, 64, torch.device("cpu"))
        full = make_head(model, config, raw, used, 64, torch.device("cpu"))
        full.load_state_dict(fast.state_dict())
        got = ttt_loss(fast, feats, lm_rows, ttt_length)
        got.loss.backward()
        # The reference: every step at every position, scored where the position counts.
        m = len(feats.token_ids) - 1
        target_probs = torch.softmax(feats.hidden[1:].float() @ lm_rows.T, dim=-1)
        target_draft = full.target_to_draft[feats.target_ids[1:]]
        counts = torch.cat((feats.loss_mask[2:], feats.loss_mask.new_zeros(1))) & (
            target_draft >= 0
        )
        total, losses, hits = 0.0, [], []
        for i, step in enumerate(ttt_unroll(full, feats.aux[:m], feats.token_ids[1:], ttt_length)):
            logits = full.lm_head(full.norm(step.hidden))
            mask = _shift(counts, i, False)
            per = -(_shift(target_probs, i, 0.0) * torch.log_softmax(logits, dim=-1)).sum(-1)
            loss = (per * mask).sum() / max(int(mask.sum()), 1)
            total = total + 0.8**i * loss
            losses.append(float(loss.detach()))
            hits.append(int(((logits.argmax(-1) == _shift(target_draft, i, -1)) & mask).sum()))
        total.backward()
        assert got.step_counts == [int(_shift(counts, i, False).sum()) for i in range(ttt_length)]
        assert got.step_hits == hits
        assert got.step_losses == pytest.approx(losses, rel=1e-5, abs=1e-6)
        for (name, a), b in zip(fast.named_parameters(), full.parameters(), strict=True):
            if a.grad is not None or b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_resume_ends_where_a_straight_run_ends(trained, target, tmp_path):
    _, prompts, out = trained
    runs = {}
    for name in ("stopped", "straight"):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        for item in ("manifest.json", "sequences.jsonl", "vocab.json", "features"):
            copy = shutil.copytree if (out / item).is_dir() else shutil.copy
            copy(out / item, runs[name] / item)  # the data, not the training
    engine = _engine(target)
    train(_config(prompts, runs["stopped"], steps=30), engine)
    with pytest.raises(ValueError, match="resume"):
        train(_config(prompts, runs["stopped"], steps=60), engine)
    resumed = train(_config(prompts, runs["stopped"], steps=60, resume=True), engine)
    straight = train(_config(prompts, runs["straight"], steps=60), engine)
    assert [r["step"] for r in resumed.metrics] == list(range(31, 61))
    assert resumed.metrics == straight.metrics[30:]
    a = torch.load(runs["stopped"] / "checkpoint.pt", weights_only=True)
    b = torch.load(runs["straight"] / "checkpoint.pt", weights_only=True)
    assert a["step"] == b["step"] == 60
    for name, tensor in b["model"].items():
        assert torch.equal(a["model"][name], tensor), name


def test_resume_refuses_other_data(trained, target):
    _, prompts, out = trained
    with pytest.raises(ValueError, match="max_tokens"):
        train(_config(prompts, out, max_tokens=16, resume=True), _engine(target))
