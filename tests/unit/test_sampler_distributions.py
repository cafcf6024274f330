"""The sampler's draws against the processed distribution (chi-square over many draws): every
processing option, seeded rows and the one-row reference sampler follow it, and the test tells a
wrong distribution apart."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from engine.core.request import _mix
from engine.sampling.reference import process_reference, sample_reference
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.unit.sampler_helpers import EOS, _row

NUM_DRAWS = 20_000


VOCAB = 12
BASE_LOGITS = torch.tensor([1.2, 0.3, -0.4, 2.0, 0.9, -1.0, 0.0, 1.6, -0.2, 0.5, 1.0, -0.7])


def _draw_counts(row: SamplingRow) -> torch.Tensor:
    """Counts of NUM_DRAWS tokens sampled by replicating the row in one batch; a keyed row is
    replicated at NUM_DRAWS positions of its seed (one key would draw one token NUM_DRAWS
    times)."""
    rows = [row] * NUM_DRAWS
    if row.random_key is not None:
        rows = [replace(row, random_key=_mix(row.random_key, i)) for i in range(NUM_DRAWS)]
    out = Sampler(VOCAB, EOS).sample(BASE_LOGITS.repeat(NUM_DRAWS, 1), rows)
    return torch.bincount(out.token_ids, minlength=VOCAB)


def _chisquare_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts under probs; a draw outside the support fails outright."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    return float(chisquare(counts[support].double().numpy(), expected.numpy()).pvalue)


def _reference_probs(row: SamplingRow) -> torch.Tensor:
    return torch.softmax(process_reference(BASE_LOGITS, row, eos_token_ids=EOS), dim=0)


HISTORY = (3, 3, 0, 7, 10)
DISTRIBUTION_CASES = {
    "temperature_0.7": SamplingParams(temperature=0.7),
    "temperature_1.0": SamplingParams(temperature=1.0),
    "temperature_1.5": SamplingParams(temperature=1.5),
    "top_k": SamplingParams(top_k=4),
    "top_p": SamplingParams(top_p=0.6),
    "min_p": SamplingParams(min_p=0.3),
    "top_k_top_p_min_p": SamplingParams(temperature=1.3, top_k=6, top_p=0.8, min_p=0.2),
    "repetition_penalty": SamplingParams(repetition_penalty=1.8),
    "frequency_penalty": SamplingParams(frequency_penalty=0.9),
    "presence_penalty": SamplingParams(presence_penalty=1.5),
    "logit_bias": SamplingParams(logit_bias={5: 3.0, 3: -2.0}),
    "min_tokens": SamplingParams(min_tokens=9, stop_token_ids=(0,)),
}


@pytest.mark.parametrize("name", list(DISTRIBUTION_CASES))
def test_draws_follow_processed_distribution(name: str) -> None:
    torch.manual_seed(1234)
    row = _row(DISTRIBUTION_CASES[name], prompt=(1, 4), output=HISTORY)
    probs = _reference_probs(row)
    assert _chisquare_p(_draw_counts(row), probs) > 0.001
    if name != "temperature_1.0":  # the processing must matter, or this case tests nothing
        assert not torch.allclose(probs, torch.softmax(BASE_LOGITS, dim=0), atol=1e-3)


def test_chisquare_detects_wrong_distribution() -> None:
    torch.manual_seed(99)
    top_k_counts = _draw_counts(_row(SamplingParams(top_k=4)))
    assert _chisquare_p(top_k_counts, torch.softmax(BASE_LOGITS, dim=0)) < 0.001
    hot_counts = _draw_counts(_row(SamplingParams(temperature=1.5)))
    assert _chisquare_p(hot_counts, torch.softmax(BASE_LOGITS, dim=0)) < 0.001


def test_seeded_rows_follow_distribution() -> None:
    row = _row(SamplingParams(temperature=0.8, top_p=0.9, seed=5), random_key=5)
    assert _chisquare_p(_draw_counts(row), _reference_probs(row)) > 0.001


def test_sample_reference_follows_distribution() -> None:
    params = SamplingParams(top_k=5, temperature=0.9)
    row = _row(params)
    tokens = [
        sample_reference(BASE_LOGITS, _row(params, random_key=_mix(3, i)), eos_token_ids=EOS)
        for i in range(4000)
    ]
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert _chisquare_p(counts, _reference_probs(row)) > 0.001
