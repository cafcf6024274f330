"""Grammar masks in the sampler: the batched path against the one-row reference, the packed
bit order, the end a grammar forces over min_tokens, and draws from the masked distribution."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from engine.sampling.reference import process_reference
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.structured.masks import TokenMasks, new_masks, pack_masks, unpack_masks
from tests.unit.test_sampler import _random_params

EOS = (2, 7)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[n, vocab] bool -> [n, words] int32, bit b of word w for token 32 w + b (by hand)."""
    packed = new_masks(allowed.shape[0], allowed.shape[1])
    packed.zero_()
    for r, t in allowed.nonzero().tolist():
        word = int(packed[r, t // 32]) & 0xFFFFFFFF
        word |= 1 << (t % 32)
        packed[r, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    return packed


def test_unpack_reads_bit_b_of_word_w_as_token_32w_plus_b() -> None:
    rnd = random.Random(0)
    allowed = torch.tensor([[rnd.random() < 0.3 for _ in range(100)] for _ in range(5)])
    allowed[:, 31] = True  # the sign bit of word 0
    allowed[0, :] = False
    assert torch.equal(unpack_masks(_pack(allowed), 100), allowed)
    assert torch.equal(pack_masks(allowed), _pack(allowed))  # the engine's packing, by hand
    assert unpack_masks(new_masks(2, 70), 70).all()  # new masks allow everything


@pytest.mark.parametrize("vocab_size, num_rows", [(50, 120), (3000, 24)])
def test_masked_process_matches_reference(vocab_size: int, num_rows: int) -> None:
    rnd = random.Random(vocab_size + 1)
    rows = [
        SamplingRow(
            _random_params(rnd, vocab_size),
            tuple(rnd.choices(range(vocab_size), k=rnd.randint(1, 20))),
            tuple(rnd.choices(range(vocab_size), k=rnd.randint(0, 8))),
            None,
        )
        for _ in range(num_rows)
    ]
    masked = sorted(rnd.sample(range(num_rows), num_rows // 2))
    allowed = torch.rand(len(masked), vocab_size) < 0.2
    allowed[:, 0] = True  # never empty
    # Some rows whose grammar allows only an EOS id: min_tokens (when on) must not empty them.
    for j in range(0, len(masked), 5):
        allowed[j] = False
        allowed[j, EOS[0]] = True
    torch.manual_seed(vocab_size)
    logits = torch.randn(num_rows, vocab_size) * 3
    processed = Sampler(vocab_size, EOS).process(logits, rows, TokenMasks(masked, _pack(allowed)))
    for i, row in enumerate(rows):
        mask = allowed[masked.index(i)] if i in masked else None
        expected = process_reference(logits[i], row, eos_token_ids=EOS, allowed=mask)
        torch.testing.assert_close(processed[i], expected)
        assert torch.equal(processed[i].isneginf(), expected.isneginf())
        if mask is not None:
            assert not processed[i][~mask].isfinite().any()  # nothing outside the grammar
            assert processed[i].isfinite().any()


def test_grammar_end_wins_over_min_tokens() -> None:
    """A complete document allows only the end: min_tokens would ban it, the grammar keeps it."""
    vocab = 40
    params = SamplingParams(temperature=0.0, min_tokens=5, max_tokens=10)
    rows = [SamplingRow(params, (1,), (), None), SamplingRow(params, (1,), (), None)]
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, EOS[0]] = True  # only the end
    allowed[1, [EOS[0], 9]] = True  # the end or 9: min_tokens bans the end
    logits = torch.zeros(2, vocab)
    logits[:, EOS[0]] = 5.0
    out = Sampler(vocab, EOS).sample(logits, rows, TokenMasks([0, 1], _pack(allowed)))
    assert out.token_ids.tolist() == [EOS[0], 9]


def test_masked_draws_follow_the_renormalised_distribution() -> None:
    vocab, num_draws = 12, 20_000
    torch.manual_seed(3)
    logits = torch.randn(vocab)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[1, 4, 5, 9, 11]] = True
    params = SamplingParams(temperature=1.0)
    rows = [SamplingRow(params, (1,), (), None)] * num_draws
    masks = TokenMasks(list(range(num_draws)), _pack(allowed.expand(num_draws, -1)))
    tokens = Sampler(vocab, EOS).sample(logits.expand(num_draws, -1), rows, masks).token_ids
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts[~allowed].sum() == 0
    probs = logits.double().masked_fill(~allowed, float("-inf")).softmax(-1)
    kept = allowed.nonzero().squeeze(1)
    expected = probs[kept] / probs[kept].sum() * num_draws
    p = chisquare(counts[kept].double().numpy(), expected.numpy()).pvalue
    assert p > 1e-3
