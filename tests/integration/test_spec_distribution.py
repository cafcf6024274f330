"""End to end, speculative decoding samples exactly from the target: for every sampling option and
every proposer, the first 3 generated tokens of 20,000 sampled continuations follow the exact
distribution that transformers gives for the target (chi-square p > 0.001), and a deliberately
broken acceptance rule is caught (p < 1e-6).

The first token is sampled at prefill; tokens 2 and 3 come out of verify steps (half the requests
verify 2 drafts there, half 1 draft plus a bonus token). The exact law is enumerated over every
prefix (tests/token_distribution.py) and the samples are tested node by node along the prefix
tree, sparse cells pooled.

Default run: all nine sampling options with the draft model (drafts with a distribution q, the
min(1, p/q) rule), a few options with n-gram and predicted-output drafts (one-hot q), and the
broken rules. Set SPECSERVE_FULL_DIST=1 to run every option with every proposer (27 cases).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec import rejection
from tests.conftest import build_tiny_model
from tests.token_distribution import (
    edit_lm_head,
    prefix_logits,
    processed_probs,
    tree_chisquare,
)

FULL = os.environ.get("SPECSERVE_FULL_DIST") == "1"

NUM_SAMPLES = 20_000
GROUP_SIZE = 500  # sequences per add_request (SamplingParams.n), each with its own seed
DEPTH = 3  # generated tokens tested
NUM_SPEC_TOKENS = 2
MAX_NUM_SEQS = 1000
ALPHA = 1e-3
BROKEN_ALPHA = 1e-6

VOCAB = 32
ARCH = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# Random tiny models are nearly uniform over the vocabulary; a sharper head puts the samples on
# fewer prefixes, so that the deep nodes of the tree get enough samples to test.
LM_HEAD_SCALE = 5.0
DRAFT_NOISE = 1.0

OPTIONS = {
    "temperature_0.7": dict(temperature=0.7),
    "temperature_1.0": dict(temperature=1.0),
    "temperature_1.5": dict(temperature=1.5),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "presence_penalty": dict(temperature=1.0, presence_penalty=1.5),
    "frequency_penalty": dict(temperature=1.0, frequency_penalty=1.0),
    "repetition_penalty": dict(temperature=1.0, repetition_penalty=1.8),
}
# One-hot proposers verify by sampling each position as plain sampling would; by default a few
# options cover them (a truncation and a penalty each), the full run covers all.
ONE_HOT_DEFAULT = {
    "ngram": ("temperature_1.0", "frequency_penalty"),
    "prediction": ("top_p", "repetition_penalty"),
}
CASES = [(option, "draft_model") for option in OPTIONS] + [
    (option, method)
    for method in ("ngram", "prediction")
    for option in OPTIONS
    if FULL or option in ONE_HOT_DEFAULT[method]
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Thousands of tiny ops per step: intra-op threads only add synchronisation (and stall
    # badly when the cores are shared).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def _build(path: Path, noise: float = 0.0) -> Path:
    build_tiny_model(path, "llama", seed=11, **ARCH)
    edit_lm_head(path, LM_HEAD_SCALE, noise, seed=12)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("dist-target"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    # The target with a noisy LM head: q is near p but not p, so drafts are often kept and often
    # rejected, and q > p and q < p both occur.
    return _build(tmp_path_factory.mktemp("dist-draft"), noise=DRAFT_NOISE)


@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(hf_target) -> list[int]:
    """The target's own greedy continuation of [bos, 3]: repetitive, so that prompt lookup finds
    the last token earlier in the context and drafts what the target tends to say next."""
    ids = [1, 3]
    with torch.inference_mode():
        while len(ids) < 12:
            ids.append(int(hf_target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


@pytest.fixture(scope="module")
def raw_logits(hf_target, prompt):
    return prefix_logits(hf_target, prompt, VOCAB, DEPTH)


def _predictions(probs, num: int) -> list[list[int]]:
    """Predicted outputs that start with the 1st, 2nd, ... likeliest first token and continue
    greedily: each is right for some samples and wrong for the rest."""
    predictions = []
    for rank in range(num):
        ids = [int(probs[()].argsort(descending=True)[rank])]
        while len(ids) < DEPTH:
            ids.append(int(probs[tuple(ids)].argmax()))
        predictions.append(ids + ids)
    return predictions


def _engine(target: Path, draft: Path, method: str):
    spec = None
    if method == "draft_model":
        spec = {"method": method, "num_speculative_tokens": NUM_SPEC_TOKENS, "model": str(draft)}
    elif method == "ngram":
        spec = {
            "method": method,
            "num_speculative_tokens": NUM_SPEC_TOKENS,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
        }
    # Predicted outputs need no config: the request carries its drafts.
    llm = LLM(
        str(target),
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_SEQS * 16,
        max_model_len=32,
        num_kv_blocks=2 * MAX_NUM_SEQS + 8,
        speculative_config=spec,
    )
    return llm.engine


def _sample(engine, option: str, prompt: list[int], predictions, num_samples: int, first_seed: int):
    """The first DEPTH tokens of num_samples continuations, in waves of MAX_NUM_SEQS in flight
    together (a wave that starts together steps in lockstep: most steps see one query length,
    which the torch attention backend runs as one batched call)."""
    samples: list[list[int]] = []
    groups_per_wave = MAX_NUM_SEQS // GROUP_SIZE
    for g in range(num_samples // GROUP_SIZE):
        params = SamplingParams(
            n=GROUP_SIZE,
            seed=first_seed + g * GROUP_SIZE,  # sequence i of the group gets seed + i
            # max_tokens 3 verifies 1 draft + bonus at tokens 2, 3; max_tokens 4 verifies 2 drafts.
            max_tokens=DEPTH + (g // groups_per_wave) % 2,
            ignore_eos=True,
            **OPTIONS[option],
        )
        engine.add_request(str(g), prompt, params, prediction=predictions[g % len(predictions)])
        if (g + 1) % groups_per_wave == 0 or (g + 1) * GROUP_SIZE >= num_samples:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        samples.extend(c.token_ids[:DEPTH] for c in output.outputs)
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    assert len(samples) == num_samples
    return samples


def _check_speculated(engine, method: str, num_samples: int) -> None:
    """Drafts were verified, and both kept and rejected in good numbers."""
    stats = engine.spec_stats
    num_rejected = stats.num_draft_tokens - stats.num_accepted_tokens
    assert stats.num_draft_tokens >= num_samples // 10, stats
    assert stats.num_accepted_tokens >= stats.num_draft_tokens // 50, stats
    assert num_rejected >= stats.num_draft_tokens // 50, stats
    if method == "prediction":
        assert stats.num_prediction_accepted == stats.num_accepted_tokens
        assert stats.num_prediction_rejected == num_rejected


def _run_case(
    target,
    draft,
    prompt,
    raw_logits,
    option: str,
    method: str,
    num_samples: int = NUM_SAMPLES,
    first_seed: int = 0,
):
    """Sample with speculation and test against the exact law. Returns (test, engine)."""
    engine = _engine(target, draft, method)
    params = SamplingParams(**OPTIONS[option])
    probs = processed_probs(raw_logits, prompt, params, engine.eos_token_ids)
    predictions = _predictions(probs, 3) if method == "prediction" else [None]
    samples = _sample(engine, option, prompt, predictions, num_samples, first_seed)
    return tree_chisquare(samples, probs), engine


@pytest.mark.parametrize(("option", "method"), CASES)
def test_first_tokens_follow_target_distribution(target, draft, prompt, raw_logits, option, method):
    result, engine = _run_case(target, draft, prompt, raw_logits, option, method)
    _check_speculated(engine, method, NUM_SAMPLES)
    assert result.pvalue > ALPHA, result.describe()


# ----------------------------------------------------------------------- broken rules are caught


def _accept_every_draft(monkeypatch):
    """Accept whenever q(d) > 0, which a draft drawn from q always has."""
    count = rejection._count_accepted
    monkeypatch.setattr(
        rejection,
        "_count_accepted",
        lambda accepted, layout: count(torch.ones_like(accepted), layout),
    )


def _recover_from_p(monkeypatch):
    """After a rejection sample from p instead of norm(max(0, p - q))."""
    sample = rejection._sample_emitted
    monkeypatch.setattr(
        rejection,
        "_sample_emitted",
        lambda probs, q, *args: sample(probs, torch.zeros_like(q), *args),
    )


def _accept_one_hot_drafts(monkeypatch):
    """One-hot verification that keeps every draft instead of comparing it with the sample."""
    import engine.verifier as verifier

    verify = verifier.verify_by_sampling

    def broken(sampled, drafts):
        layout = rejection._layout(drafts, sampled.device)
        sampled = sampled.clone()
        sampled[layout.draft_rows] = layout.draft_ids
        return verify(sampled, drafts)

    monkeypatch.setattr(verifier, "verify_by_sampling", broken)


def _ignore_draft_probs(monkeypatch):
    """Verify a draft drawn from q as if it were one-hot (accept with probability p(d))."""
    import engine.verifier as verifier

    sample = verifier.rejection_sample

    def broken(target_logits, draft_ids, draft_probs, generators):
        ids = torch.tensor([t for ids in draft_ids for t in ids])
        one_hot = torch.nn.functional.one_hot(ids, draft_probs.shape[1]).to(draft_probs.dtype)
        return sample(target_logits, draft_ids, one_hot, generators)

    monkeypatch.setattr(verifier, "rejection_sample", broken)


def _freeze_penalty_window(monkeypatch):
    """Process every verify row with the output before the drafts, as if penalties did not
    advance over the drafts inside the window."""
    import engine.verifier as verifier

    rows = verifier.sampling_rows

    def broken(request, draft_ids):
        output = list(request.output_token_ids)
        return [replace(row, output_token_ids=output) for row in rows(request, draft_ids)]

    monkeypatch.setattr(verifier, "sampling_rows", broken)


@pytest.mark.parametrize(
    ("breakage", "method"),
    [
        (_accept_every_draft, "draft_model"),
        (_recover_from_p, "draft_model"),
        (_accept_one_hot_drafts, "ngram"),
    ],
)
def test_broken_verification_is_caught(
    monkeypatch, target, draft, prompt, raw_logits, breakage, method
):
    breakage(monkeypatch)
    result, engine = _run_case(target, draft, prompt, raw_logits, "temperature_1.0", method)
    assert engine.spec_stats.num_accepted_tokens > 0
    assert result.pvalue < BROKEN_ALPHA, result.describe()
