"""The batched sampler's processing against its one-row reference: a random mix of every option,
bf16 views left alone, top_k with top_p (ties past the k-th logit, heads of several widths),
truncation edges that keep the top token and its ties, and the prefix sums top_p reads."""

from __future__ import annotations

import random

import pytest
import torch

from engine.sampling.reference import process_reference
from engine.sampling.sampler import Sampler
from engine.sampling.truncation import prefix_sums
from engine.sampling_params import SamplingParams
from tests.unit.sampler_helpers import EOS, _row


def _random_params(rnd: random.Random, vocab_size: int) -> SamplingParams:
    """A random mix of every option; each one is on in about half of the rows."""

    def maybe(value, default):
        return value if rnd.random() < 0.5 else default

    greedy = rnd.random() < 0.2
    min_tokens = maybe(rnd.randint(1, 6), 0)
    return SamplingParams(
        temperature=0.0 if greedy else maybe(rnd.uniform(0.3, 2.0), 1.0),
        top_k=maybe(rnd.randint(1, vocab_size), 0),
        top_p=maybe(rnd.uniform(0.05, 1.0), 1.0),
        min_p=maybe(rnd.uniform(0.0, 0.3), 0.0),
        presence_penalty=maybe(rnd.uniform(-2, 2), 0.0),
        frequency_penalty=maybe(rnd.uniform(-2, 2), 0.0),
        repetition_penalty=maybe(rnd.uniform(0.5, 2.0), 1.0),
        min_tokens=min_tokens,
        max_tokens=max(min_tokens, 16),
        ignore_eos=rnd.random() < 0.3,
        stop_token_ids=tuple(rnd.sample(range(vocab_size), 2)),
        logit_bias=maybe({t: rnd.uniform(-5, 5) for t in rnd.sample(range(vocab_size), 3)}, {}),
    )


@pytest.mark.parametrize("vocab_size, num_rows", [(50, 200), (5000, 48)])
def test_process_matches_reference(vocab_size: int, num_rows: int) -> None:
    rnd = random.Random(vocab_size)
    rows = [
        _row(
            _random_params(rnd, vocab_size),
            prompt=rnd.choices(range(vocab_size), k=rnd.randint(1, 30)),
            output=rnd.choices(range(vocab_size), k=rnd.randint(0, 12)),
        )
        for _ in range(num_rows)
    ]
    torch.manual_seed(vocab_size)
    logits = torch.randn(num_rows, vocab_size) * 3
    processed = Sampler(vocab_size, EOS).process(logits, rows)
    assert processed.dtype == torch.float32 and processed.shape == logits.shape
    num_truncated = 0
    for i, row in enumerate(rows):
        expected = process_reference(logits[i], row, eos_token_ids=EOS)
        torch.testing.assert_close(processed[i], expected)
        assert torch.equal(processed[i].isneginf(), expected.isneginf())
        num_truncated += int(expected.isneginf().sum() > 2)
    # The random mix must really exercise truncation, not only pass through.
    assert num_truncated > num_rows // 4


def test_process_accepts_bf16_views_and_leaves_input_alone() -> None:
    logits = torch.randn(20, 3).to(torch.bfloat16).t()  # [3, 20], not contiguous
    before = logits.clone()
    params = SamplingParams(top_k=3, logit_bias={0: 5.0}, repetition_penalty=1.5)
    rows = [_row(params, output=(4, 4, 9))] * 3
    processed = Sampler(20, EOS).process(logits, rows)
    assert torch.equal(logits, before)
    for i in range(3):
        expected = process_reference(logits[i], rows[i], eos_token_ids=EOS)
        torch.testing.assert_close(processed[i], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_with_top_p_matches_reference_with_ties(dtype: torch.dtype) -> None:
    """Every top_p row also has a top_k, the case that avoids the full sort; bf16 logits tie
    often, so tokens tied with the k-th logit spill past the top-k head in some rows."""
    vocab_size, num_rows = 3000, 64
    rnd = random.Random(7)
    rows = [
        _row(SamplingParams(top_k=rnd.randint(1, 40), top_p=rnd.uniform(0.5, 0.999)))
        for _ in range(num_rows)
    ]
    torch.manual_seed(7)
    logits = (torch.randn(num_rows, vocab_size) * 3).to(dtype)
    processed = Sampler(vocab_size, EOS).process(logits, rows)
    num_spilled = 0
    for i, row in enumerate(rows):
        expected = process_reference(logits[i], row, eos_token_ids=EOS)
        torch.testing.assert_close(processed[i], expected)
        kth = logits[i].float().topk(row.params.top_k).values[-1]
        num_spilled += int((logits[i] >= kth).sum() > row.params.top_k)
    assert (num_spilled > 0) == (dtype == torch.bfloat16)


def test_top_p_counts_every_token_tied_with_the_kth() -> None:
    # top_k=2 keeps id 0 and the five ids tied at 3.0. Their mass after id 0 is needed to see
    # that p(0) = 0.60 < top_p = 0.7, so all six stay (the top-2 head alone gives p(0) = 0.79).
    logits = torch.full((1, 20), -10.0)
    logits[0, 0] = 5.0
    logits[0, 1:6] = 3.0
    row = _row(SamplingParams(top_k=2, top_p=0.7))
    processed = Sampler(20, EOS).process(logits, [row])
    assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(processed[0], process_reference(logits[0], row, eos_token_ids=EOS))


def test_truncation_edges_keep_top_token_and_ties() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0, 0.0]] * 4)
    rows = [
        _row(SamplingParams(top_k=1)),
        _row(SamplingParams(top_p=1e-6)),
        _row(SamplingParams(min_p=1.0)),
        _row(SamplingParams(top_k=2, top_p=0.99, min_p=0.99)),
    ]
    processed = Sampler(6, EOS).process(logits, rows)
    # Ids 1 and 3 tie for the top: every edge keeps both and nothing else.
    is_kept = torch.isfinite(processed)
    assert is_kept.tolist() == [[False, True, False, True, False, False]] * 4
    for i, row in enumerate(rows):
        torch.testing.assert_close(
            processed[i], process_reference(logits[i], row, eos_token_ids=EOS)
        )


def test_top_p_heads_of_several_widths_match_reference() -> None:
    """top_p rows with different top_k sum over heads of different widths, widened where ties
    with the k-th logit spill past them (twice for row 4); all match the reference."""
    vocab_size = 5000
    torch.manual_seed(11)
    logits = torch.randn(6, vocab_size) * 3
    logits[4, :] = -20.0
    logits[4, :40] = torch.linspace(5.0, 4.0, 40)
    logits[4, 40:340] = 3.0  # top_k=60 keeps the first 40 and 300 ties: past 64 and 256
    logits[5].clamp_(max=5.0)
    logits[5, :100] = 6.0  # top_k=2 keeps 100 ties: past 64
    top_ks = [0, 3, 40, 100, 60, 2]
    rows = [_row(SamplingParams(top_k=k, top_p=0.99)) for k in top_ks]
    processed = Sampler(vocab_size, EOS).process(logits, rows)
    for i, row in enumerate(rows):
        expected = process_reference(logits[i], row, eos_token_ids=EOS)
        torch.testing.assert_close(processed[i], expected)
        assert torch.equal(processed[i].isneginf(), expected.isneginf())
    assert int(torch.isfinite(processed[4]).sum()) > 256
    assert int(torch.isfinite(processed[5]).sum()) > 64


def test_prefix_sums_match_cumsum_and_ignore_width_and_rows() -> None:
    torch.manual_seed(5)
    values = torch.rand(3, 1000).softmax(dim=-1)  # [3, 1000]
    sums = prefix_sums(values)
    torch.testing.assert_close(sums, values.double().cumsum(dim=-1).float())
    padded = torch.cat((values, torch.zeros(3, 700)), dim=1)  # [3, 1700]
    assert torch.equal(prefix_sums(padded)[:, :1000], sums)
    assert torch.equal(prefix_sums(values[1:2]), sums[1:2])
