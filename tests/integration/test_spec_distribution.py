"""End to end, speculative decoding samples exactly from the target.

For every sampling option (temperature 0.7 / 1.0 / 1.5, top_k, top_p, min_p, presence, frequency
and repetition penalties) and every proposer (draft model, EAGLE-3 head, n-gram, predicted outputs) the first 3
generated tokens of 20,000 continuations sampled in big batches follow the exact distribution
that transformers gives for the target (chi-square p > 0.001), speculation really happened
(drafts verified, many kept, many rejected), and deliberately broken verification rules are
caught (p < 1e-6).

The first token is sampled at prefill; tokens 2 and 3 come out of verify steps (half the
requests verify 2 drafts there, half 1 draft and a bonus token). The exact law is enumerated over
every prefix and the samples are tested node by node along the prefix tree, sparse cells pooled
(tests/token_distribution.py).

Default run (about 2.5 minutes on 2 CPU cores): all nine options with the draft model (drafts
with a distribution q: the min(1, p/q) rule and the residual), temperature 1 and top_p with an
EAGLE-3 head (q over a draft vocabulary of 24 of the 32 ids), two options each with n-gram and
predicted-output drafts (one-hot q), and the broken rules.

    SPECSERVE_FULL_DIST=1 pytest tests/integration/test_spec_distribution.py

runs the full matrix, every option with every proposer (36 cases, about 5 minutes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import engine.verification.verifier as verifier
from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.verification import rejection
from tests.conftest import build_tiny_model
from tests.eagle3_heads import build_tiny_eagle3_head
from tests.token_distribution import (
    TreeTest,
    edit_lm_head,
    prefix_logits,
    processed_probs,
    sample_first_tokens,
    tree_chisquare,
)

FULL = os.environ.get("SPECSERVE_FULL_DIST") == "1"

NUM_SAMPLES = 20_000
BROKEN_NUM_SAMPLES = 5_000
ALPHA = 1e-3
BROKEN_ALPHA = 1e-6
DEPTH = 3  # generated tokens tested
GROUP_SIZE = 500  # sequences per add_request (SamplingParams.n), each with its own seed
MAX_NUM_SEQS = 2048
NUM_SPEC_TOKENS = 2
PROMPT_LEN = 12
BLOCK_SIZE = 16  # prompt + 4 tokens + drafts fit in one block

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
# One-hot drafts (n-gram, predicted outputs) are verified by sampling every position as plain
# sampling would; by default a truncation and a penalty (whose state must advance over the
# drafts inside the window) cover each of them, the full run covers every option.
ONE_HOT_DEFAULT = {
    "ngram": ("top_k", "presence_penalty"),
    "prediction": ("top_p", "frequency_penalty"),
}
METHODS = ("draft_model", "ngram", "prediction", "eagle3")
# An EAGLE-3 head samples its drafts from q like the draft model, over a draft vocabulary of
# EAGLE_VOCAB of the target's ids (d2t offsets): a truncation and the plain case by default.
EAGLE_VOCAB = 24
EAGLE_DEFAULT = ("temperature_1.0", "top_p")
CASES = (
    [(option, "draft_model") for option in OPTIONS]
    + [(option, "eagle3") for option in OPTIONS if FULL or option in EAGLE_DEFAULT]
    + [
        (option, method)
        for method in ONE_HOT_DEFAULT
        for option in OPTIONS
        if FULL or option in ONE_HOT_DEFAULT[method]
    ]
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Thousands of tiny ops per step: intra-op threads only add synchronisation, and they stall
    # badly when the cores are shared (measured here: 8 s per case on one thread, 40-75 s on two
    # while another process ran).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@dataclass(frozen=True)
class Setup:
    """The models, the prompt, and the target's raw logits after the prompt + every prefix."""

    target: Path
    draft: Path
    head: Path
    prompt: list[int]
    raw_logits: dict[tuple[int, ...], torch.Tensor]


def _build(path: Path, noise: float = 0.0) -> Path:
    build_tiny_model(path, "llama", seed=11, **ARCH)
    edit_lm_head(path, LM_HEAD_SCALE, noise, seed=12)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    from transformers import AutoModelForCausalLM

    target = _build(tmp_path_factory.mktemp("dist-target"))
    # The draft is the target with a noisy LM head: q is near p but not p, so drafts are often
    # kept and often rejected, and both q > p and q < p occur.
    draft = _build(tmp_path_factory.mktemp("dist-draft"), noise=DRAFT_NOISE)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    # The prompt is the target's greedy continuation of [bos, 3]: repetitive, so prompt lookup
    # finds the last token earlier in the context and drafts what the target tends to say next.
    prompt = [1, 3]
    with torch.inference_mode():
        while len(prompt) < PROMPT_LEN:
            prompt.append(int(model(torch.tensor([prompt])).logits[0, -1].argmax()))
    # The head taps layer 0's input (the target has one layer): what it drafts matters not here,
    # only that its drafts come with their q.
    head = build_tiny_eagle3_head(
        tmp_path_factory.mktemp("dist-head"),
        target,
        seed=13,
        draft_vocab_size=EAGLE_VOCAB,
        aux_layer_ids=[0],
        scale=0.3,
        dtype=torch.float32,
    )
    return Setup(target, draft, head, prompt, prefix_logits(model, prompt, VOCAB, DEPTH))


def _predictions(probs: dict[tuple[int, ...], torch.Tensor], num: int) -> list[list[int]]:
    """Predicted outputs that start with the 1st, 2nd, ... likeliest first token and go on with
    the likeliest next ones: each is right for some samples and wrong for the rest."""
    predictions = []
    for rank in range(num):
        ids = [int(probs[()].argsort(descending=True)[rank])]
        while len(ids) < DEPTH:
            ids.append(int(probs[tuple(ids)].argmax()))
        predictions.append(ids + ids)
    return predictions


def _engine(setup: Setup, method: str, overlap: bool = False) -> LLMEngine:
    # Predicted outputs need no speculative config: the requests carry their drafts. Mode
    # "always" drafts every step, so every sample exercises the rejection sampler.
    spec: dict[str, object] | None = None
    if method in ("draft_model", "eagle3"):
        spec = dict(
            method=method,
            mode="always",
            num_speculative_tokens=NUM_SPEC_TOKENS,
            model=str(setup.draft if method == "draft_model" else setup.head),
        )
    elif method == "ngram":
        spec = dict(
            method=method,
            mode="always",
            num_speculative_tokens=NUM_SPEC_TOKENS,
            prompt_lookup_min=1,
            prompt_lookup_max=2,
        )
    llm = LLM(
        str(setup.target),
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_SEQS * PROMPT_LEN,
        max_model_len=2 * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        num_kv_blocks=2 * MAX_NUM_SEQS,
        speculative_config=spec,
        overlap_scheduling=overlap,
    )
    return llm.engine


def _sample(
    engine: LLMEngine,
    params: SamplingParams,
    prompt: list[int],
    predictions: list[list[int]] | list[None],
    num_samples: int,
    first_seed: int,
) -> list[list[int]]:
    """The first DEPTH tokens of num_samples continuations, in waves of MAX_NUM_SEQS in flight
    together (half the waves stop at DEPTH tokens: 1 draft and a bonus at tokens 2-3; half at
    DEPTH + 1: 2 drafts there)."""
    samples = sample_first_tokens(
        engine,
        params,
        prompt,
        predictions,
        num_samples,
        first_seed,
        depth=DEPTH,
        group_size=GROUP_SIZE,
    )
    assert len(samples) == num_samples and all(len(s) == DEPTH for s in samples)
    return samples


def _run_case(
    setup: Setup, option: str, method: str, num_samples: int, first_seed: int
) -> tuple[TreeTest, LLMEngine]:
    """Sample with speculation and test the samples against the exact law."""
    engine = _engine(setup, method)
    params = SamplingParams(**OPTIONS[option])
    probs = processed_probs(setup.raw_logits, setup.prompt, params, engine.eos_token_ids)
    predictions = _predictions(probs, 3) if method == "prediction" else [None]
    samples = _sample(engine, params, setup.prompt, predictions, num_samples, first_seed)
    return tree_chisquare(samples, probs), engine


def _first_seed(option: str, method: str) -> int:
    """Every case draws its own seeds (one-hot drafts reproduce plain sampling token for token,
    so with shared seeds the n-gram and prediction cases would test the very same samples)."""
    return (list(OPTIONS).index(option) * len(METHODS) + METHODS.index(method)) * 10**6


@pytest.mark.parametrize(("option", "method"), CASES)
def test_first_tokens_follow_target_distribution(setup, option, method):
    result, engine = _run_case(setup, option, method, NUM_SAMPLES, _first_seed(option, method))
    # Speculation really happened: many drafts verified, many kept and many rejected.
    stats = engine.spec_stats
    num_rejected = stats.num_draft_tokens - stats.num_accepted_tokens
    assert stats.num_draft_tokens >= NUM_SAMPLES // 4, stats
    assert min(stats.num_accepted_tokens, num_rejected) >= stats.num_draft_tokens // 20, stats
    if method == "prediction":
        assert stats.num_prediction_accepted == stats.num_accepted_tokens
        assert stats.num_prediction_rejected == num_rejected
    assert result.pvalue > ALPHA, result.describe()


@pytest.mark.parametrize("option", ["top_p"])
def test_overlapped_steps_follow_target_distribution(setup, option):
    """Without drafts and with overlap scheduling, tokens 2 and 3 are sampled by steps launched
    before the host read the token they take as input (carried on the device): the law is
    still the target's."""
    engine = _engine(setup, "plain", overlap=True)
    params = SamplingParams(**OPTIONS[option])
    probs = processed_probs(setup.raw_logits, setup.prompt, params, engine.eos_token_ids)
    seed = 10**9 + list(OPTIONS).index(option) * 10**6
    samples = _sample(engine, params, setup.prompt, [None], NUM_SAMPLES, seed)
    result = tree_chisquare(samples, probs)
    assert engine.metrics.num_overlapped_steps >= engine.metrics.num_steps // 2
    assert result.pvalue > ALPHA, result.describe()


# ----------------------------------------------------------------------- broken rules are caught


def _accept_every_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accept whenever q(d) > 0, which a draft drawn from q always has."""
    count = rejection._count_accepted
    monkeypatch.setattr(
        rejection,
        "_count_accepted",
        lambda is_accepted, layout: count(torch.ones_like(is_accepted), layout),
    )


def _recover_from_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a rejection sample from p instead of norm(max(0, p - q))."""
    sample = rejection._sample_emitted
    monkeypatch.setattr(
        rejection, "_sample_emitted", lambda probs, q, *rest: sample(probs, q * 0, *rest)
    )


def _keep_one_hot_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """One-hot verification that keeps every draft instead of comparing it with the sample."""
    verify = verifier.verify_by_sampling

    def broken(sampled_token_ids: torch.Tensor, draft_token_ids: list[list[int]]):
        layout = rejection._layout(draft_token_ids, sampled_token_ids.device)
        sampled = sampled_token_ids.clone()  # [num_rows]
        sampled[layout.draft_rows] = layout.draft_ids
        return verify(sampled, draft_token_ids)

    monkeypatch.setattr(verifier, "verify_by_sampling", broken)


def _freeze_penalty_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Process every verify row with the output before the drafts: penalties that do not
    advance over the drafts inside the window."""
    rows = verifier.sampling_rows

    def broken(request, draft_ids, device):
        output = list(request.output_token_ids)
        return [replace(row, output_token_ids=output) for row in rows(request, draft_ids, device)]

    monkeypatch.setattr(verifier, "sampling_rows", broken)


@pytest.mark.parametrize(
    ("breakage", "option", "method"),
    [
        (_accept_every_draft, "temperature_1.0", "draft_model"),
        (_accept_every_draft, "temperature_1.0", "eagle3"),
        (_recover_from_p, "temperature_1.0", "draft_model"),
        (_keep_one_hot_drafts, "temperature_1.0", "ngram"),
        (_freeze_penalty_window, "presence_penalty", "ngram"),
        (_freeze_penalty_window, "repetition_penalty", "draft_model"),
    ],
)
def test_broken_verification_is_caught(monkeypatch, setup, breakage, option, method):
    """The same test, on a quarter of the samples, rejects each broken rule outright."""
    breakage(monkeypatch)
    first_seed = 10**9 + _first_seed(option, method)
    result, engine = _run_case(setup, option, method, BROKEN_NUM_SAMPLES, first_seed)
    assert engine.spec_stats.num_accepted_tokens > 0
    assert result.pvalue < BROKEN_ALPHA, result.describe()
