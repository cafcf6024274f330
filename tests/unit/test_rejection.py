"""The speculative rejection sampler: vectorised == reference token for token, hand cases, and the
emitted tokens against the target distribution (with broken rules to show the tests can fail)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from engine.core.request import _mix
from engine.sampling.counter_rng import exponentials
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.verification.rejection import VerifyResult, rejection_sample, verify_by_sampling
from engine.verification.rejection_reference import (
    rejection_sample_reference,
    verify_by_sampling_reference,
)

NEG_INF = float("-inf")
NUM_TRIALS = 20_000
VOCAB = 16


def _keys(base: int, count: int) -> list[int]:
    """Row keys as the engine makes them (a hash of seed and position): seed base, positions
    0 .. count - 1."""
    return [_mix(base, c) for c in range(count)]


def _row_keys(base: int, num_drafts: list[int]) -> list[list[int]]:
    """One key per target row of each request, request i keyed by seed base + i."""
    return [_keys(base + i, k + 1) for i, k in enumerate(num_drafts)]


def _flat(keys: list[list[int]]) -> torch.Tensor:
    """[num_rows] int64, the keys of every target row in batch order."""
    return torch.tensor([key for row in keys for key in row], dtype=torch.int64)


def _chisquare_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts under probs (any shape); a count outside the support fails outright.
    Cells expected below 5 are merged into one, as the chi-square approximation needs."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    observed = counts[support]
    expected = probs[support] / probs[support].sum() * observed.sum()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


def _assert_rate(num_hits: int, num_trials: int, prob: float) -> None:
    """The empirical rate is within 4.5 binomial standard deviations of prob."""
    std = math.sqrt(prob * (1 - prob) / num_trials)
    assert abs(num_hits / num_trials - prob) <= 4.5 * std + 1e-12, (num_hits / num_trials, prob)


# ---- vectorised == reference -----------------------------------------------------------------


def _random_batch(vocab_size: int, num_drafts: list[int], seed: int):
    """Masked target logits, draft probs (close to p, equal to p, or unrelated, with zeros) and
    drafts mostly drawn from q, sometimes arbitrary (q(d) or p(d) may be 0)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    num_rows = sum(k + 1 for k in num_drafts)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2  # [num_rows, vocab]
    mask = torch.rand(num_rows, vocab_size, generator=gen) < 0.2
    mask[torch.arange(num_rows), logits.argmax(dim=-1)] = False  # keep one token per row
    logits[mask] = NEG_INF
    drafts, q_rows, row = [], [], 0
    for k in num_drafts:
        mode = rnd.choice(["close", "close", "equal", "far"])
        p_logits = logits[row : row + k]  # [k, vocab]
        if mode == "equal":
            q = torch.softmax(p_logits, dim=-1)  # [k, vocab]
        else:
            base = p_logits if mode == "close" else torch.zeros_like(p_logits)
            noise = torch.randn(k, vocab_size, generator=gen) * (0.7 if mode == "close" else 2)
            q = torch.softmax(torch.where(base.isinf(), 0.0, base) + noise, dim=-1)
            q[torch.rand(k, vocab_size, generator=gen) < 0.15] = 0.0
            q[torch.arange(k), q.argmax(dim=-1)] += 1e-3  # no all-zero row
            q = q / q.sum(dim=-1, keepdim=True)
        ids = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist() if k else []
        ids = [rnd.randrange(vocab_size) if rnd.random() < 0.1 else t for t in ids]
        drafts.append(ids)
        q_rows.append(q)
        row += k + 1
    return logits, drafts, torch.cat(q_rows)


@pytest.mark.parametrize(
    "vocab_size, num_requests, min_k", [(20, 120, 1), (1000, 40, 1), (20, 60, 0)]
)
def test_vectorised_matches_reference(vocab_size: int, num_requests: int, min_k: int) -> None:
    rnd = random.Random(vocab_size + min_k)
    num_drafts = [rnd.randint(min_k, 8) for _ in range(num_requests)]
    logits, drafts, q = _random_batch(vocab_size, num_drafts, seed=vocab_size + min_k)
    keys = _row_keys(7_000, num_drafts)
    result = rejection_sample(logits, drafts, q, _flat(keys))

    row = q_row = 0
    for i, k in enumerate(num_drafts):
        p_i, q_i = logits[row : row + k + 1], q[q_row : q_row + k]
        expected = rejection_sample_reference(p_i, drafts[i], q_i, keys[i])
        assert (result.num_accepted[i], result.output_token_ids[i]) == expected, i
        row, q_row = row + k + 1, q_row + k
    # The batch must exercise every outcome: all accepted, a middle rejection, a first rejection.
    outcomes = list(zip(result.num_accepted, num_drafts, strict=True))
    assert sum(a == k for a, k in outcomes) >= 5
    assert sum(0 < a < k for a, k in outcomes) >= 5
    assert sum(a == 0 < k for a, k in outcomes) >= 5


# ---- hand cases ------------------------------------------------------------------------------


def _one_hot_logits(token: int, vocab_size: int = 8) -> torch.Tensor:
    row = torch.full((vocab_size,), NEG_INF)  # [vocab]
    row[token] = 0.0
    return row


def test_equal_p_and_q_accepts_everything_and_emits_bonus() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 8, generator=gen)  # [k+1, vocab], k = 3
    logits[3, :4] = NEG_INF
    q = torch.softmax(logits[:3], dim=-1)  # [k, vocab]
    for seed in range(50):
        result = rejection_sample(logits, [[5, 0, 7]], q, _flat([_keys(seed, 4)]))
        assert result.num_accepted == [3]
        assert result.output_token_ids[0][:3] == [5, 0, 7]
        assert result.output_token_ids[0][3] >= 4  # the bonus comes from p_4's support


def test_zero_q_rejects_and_residual_recovers_the_draft() -> None:
    # Row 2 puts all its mass on token 6 but q_2(6) == 0: the draft is rejected (it cannot have
    # been drawn from q_2), and the residual max(0, p_2 - q_2) is one-hot on 6.
    logits = torch.stack([torch.zeros(8), _one_hot_logits(6), torch.zeros(8)])  # [3, vocab]
    q = torch.full((2, 8), 1 / 7)
    q[0] = 1 / 8
    q[1, 6] = 0.0
    result = rejection_sample(logits, [[1, 6]], q, _flat([_keys(5, 3)]))
    assert result == VerifyResult([1], [[1, 6]])


def test_zero_p_rejects_and_recovers_inside_the_support() -> None:
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))  # [3, vocab]
    logits[0, 2] = logits[0, 5] = NEG_INF
    q = torch.full((2, 8), 1 / 8)  # [2, vocab]
    for seed in range(100):
        result = rejection_sample(logits, [[2, 3]], q, _flat([_keys(seed, 3)]))
        assert result.num_accepted == [0]
        assert result.output_token_ids[0][0] not in (2, 5)


def test_one_hot_q_never_recovers_the_draft() -> None:
    logits = torch.zeros(2, 4)  # [2, vocab]: uniform p, acceptance probability 1/4
    q = torch.zeros(1, 4)
    q[0, 1] = 1.0
    outcomes = [rejection_sample(logits, [[1]], q, _flat([_keys(s, 2)])) for s in range(200)]
    rejected = [r.output_token_ids[0][0] for r in outcomes if r.num_accepted == [0]]
    assert 100 < len(rejected) < 200 and 1 not in rejected


def test_rows_draw_from_their_own_keys_as_the_contract_says() -> None:
    # d_1 has p == 0: row 0 is rejected and recovers with the noise of row 0's own key; what
    # the keys of rows 1-3 hold, and what other requests share the batch, cannot matter.
    logits = torch.zeros(4, 8)  # [k+1, vocab], k = 3
    logits[0, 3] = NEG_INF
    q = torch.full((3, 8), 1 / 8)  # [k, vocab]
    residual = (torch.softmax(logits[0], dim=-1) - q[0]).clamp_min(0.0)  # [vocab]
    recovered = []
    for seed in range(40):
        keys = _keys(seed, 4)
        noise = exponentials(torch.tensor(keys[:1]), 8)[0]  # [vocab], row 0's columns 0..7
        expected = [int((residual / noise).argmax())]
        assert rejection_sample(logits, [[3, 1, 1]], q, _flat([keys])).output_token_ids == [
            expected
        ]
        other_rows = [keys[0], *_keys(seed + 1000, 3)]
        others = rejection_sample(
            torch.cat([logits[:2], logits]), [[1], [3, 1, 1]], torch.cat([q[:1], q]),
            _flat([_keys(seed + 2000, 2), other_rows]),
        )  # fmt: skip
        assert others.output_token_ids[1] == expected
        recovered += expected
    assert len(set(recovered)) > 3  # the keys do steer the draw


def test_empty_batch_and_bad_inputs() -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    assert rejection_sample(torch.zeros(0, 8), [], torch.zeros(0, 8), empty) == VerifyResult([], [])
    logits, q = torch.zeros(3, 8), torch.full((2, 8), 1 / 8)
    keys = _flat([_keys(0, 3)])
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(logits[:2], [[1, 2]], q, keys)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(logits, [[1, 2]], q[:1], keys)
    with pytest.raises(ValueError, match="keys"):
        rejection_sample(logits, [[1, 2]], q, keys[:2])
    with pytest.raises(ValueError, match="draft token ids"):
        rejection_sample(logits, [[1, 8]], q, keys)
    with pytest.raises(ValueError, match="sampled_token_ids"):
        verify_by_sampling(torch.tensor([1, 2]), [[1, 2]])


@pytest.mark.parametrize(
    "sampled, drafts, expected",
    [
        ([5, 6, 7, 9], [5, 6, 7], (3, [5, 6, 7, 9])),  # all accepted: the bonus x_4 is emitted
        ([5, 1, 7, 9], [5, 6, 7], (1, [5, 1])),  # first mismatch at d_2
        ([3, 6, 7, 9], [5, 6, 7], (0, [3])),  # first mismatch at d_1
        ([4], [], (0, [4])),  # k = 0: the request samples its one row
    ],
)
def test_verify_by_sampling_hand_cases(sampled, drafts, expected) -> None:
    assert verify_by_sampling_reference(sampled, drafts) == expected
    result = verify_by_sampling(torch.tensor(sampled), [drafts])
    assert (result.num_accepted[0], result.output_token_ids[0]) == expected


def test_verify_by_sampling_mixed_batch_and_greedy() -> None:
    logits = torch.randn(9, 12, generator=torch.Generator().manual_seed(4))  # [rows, vocab]
    argmax = logits.argmax(dim=-1)  # [rows]: what a greedy request samples
    top = argmax.tolist()
    # Rows 0-3: k = 3, drafts agree with the argmax twice; row 4: k = 0; rows 5-8: all agree.
    drafts = [[top[0], top[1], (top[2] + 1) % 12], [], top[5:8]]
    result = verify_by_sampling(argmax, drafts)
    assert result.num_accepted == [2, 0, 3]
    assert result.output_token_ids == [top[0:3], [top[4]], top[5:9]]


# ---- distributions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Trials:
    """NUM_TRIALS independent verify steps of the same request, k = 2, and what they emitted."""

    p: torch.Tensor  # [3, VOCAB] float64 target distributions p_1..p_3
    q: torch.Tensor  # [2, VOCAB] float32 draft distributions q_1, q_2
    drafts: torch.Tensor  # [NUM_TRIALS, 2] int64
    num_accepted: torch.Tensor  # [NUM_TRIALS] int64
    first: torch.Tensor  # [NUM_TRIALS] int64, the first emitted token
    second: torch.Tensor  # [NUM_TRIALS] int64, the second token (the next step's when a == 0)
    third: torch.Tensor  # [NUM_TRIALS] int64, the bonus, -1 unless a == 2


def _target_and_draft() -> tuple[torch.Tensor, torch.Tensor]:
    """p logits [3, VOCAB] with masked tokens; q [2, VOCAB], a noisy copy of p (acceptance
    rates about 0.6 and 0.8) with zeros where p is positive and mass where p is masked."""
    gen = torch.Generator().manual_seed(2024)
    p_logits = torch.randn(3, VOCAB, generator=gen) * 1.5
    p_logits[0, [3, 9]] = NEG_INF
    p_logits[1, [0, 5]] = NEG_INF
    p_logits[2, 7] = NEG_INF
    unmasked = torch.where(p_logits[:2].isinf(), 0.0, p_logits[:2])  # [2, VOCAB]
    q = torch.softmax(unmasked + torch.randn(2, VOCAB, generator=gen), dim=-1)
    q[0, [4, 11]] = 0.0
    q[1, 2] = 0.0
    return p_logits, q / q.sum(dim=-1, keepdim=True)


@pytest.fixture(scope="module")
def trials() -> Trials:
    p_logits, q = _target_and_draft()
    draft_gens = [torch.Generator().manual_seed(1_000_000 + t) for t in range(NUM_TRIALS)]
    drafts = torch.cat([torch.multinomial(q, 1, generator=g).T for g in draft_gens])
    # drafts: [NUM_TRIALS, 2], d_1 ~ q_1 and d_2 ~ q_2 from each trial's own generator
    draft_lists = drafts.tolist()
    num_drafts = [2] * NUM_TRIALS
    result = rejection_sample(
        p_logits.repeat(NUM_TRIALS, 1), draft_lists, q.repeat(NUM_TRIALS, 1),
        _flat(_row_keys(2_000_000, num_drafts)),
    )  # fmt: skip
    # A trial that rejects d_1 emits one token; its second comes from the next verify step, whose
    # fresh draft from q_2 may be d_2 (drawn independently of everything step one used).
    redo = [i for i, a in enumerate(result.num_accepted) if a == 0]
    follow = rejection_sample(
        p_logits[1:].repeat(len(redo), 1), [[draft_lists[i][1]] for i in redo],
        q[1:].repeat(len(redo), 1), _flat(_row_keys(3_000_000, [1] * len(redo))),
    )  # fmt: skip
    second = {i: out[0] for i, out in zip(redo, follow.output_token_ids, strict=True)}
    outs = result.output_token_ids
    return Trials(
        p=torch.softmax(p_logits.double(), dim=-1),
        q=q,
        drafts=drafts,
        num_accepted=torch.tensor(result.num_accepted),
        first=torch.tensor([out[0] for out in outs]),
        second=torch.tensor([second[i] if i in second else out[1] for i, out in enumerate(outs)]),
        third=torch.tensor([out[2] if len(out) == 3 else -1 for out in outs]),
    )


def _counts(tokens: torch.Tensor, size: int = VOCAB) -> torch.Tensor:
    return torch.bincount(tokens, minlength=size)


def test_first_token_follows_p1(trials: Trials) -> None:
    assert _chisquare_p(_counts(trials.first), trials.p[0]) > 0.001


def test_first_two_tokens_follow_p1_times_p2(trials: Trials) -> None:
    joint = _counts(trials.first * VOCAB + trials.second, VOCAB * VOCAB)  # [VOCAB * VOCAB]
    assert _chisquare_p(joint, torch.outer(trials.p[0], trials.p[1])) > 0.001
    # The second token given the most frequent first token, on its own.
    top = int(_counts(trials.first).argmax())
    assert _chisquare_p(_counts(trials.second[trials.first == top]), trials.p[1]) > 0.001


def test_bonus_follows_p3(trials: Trials) -> None:
    bonus = trials.third[trials.num_accepted == 2]
    assert bonus.numel() > 5_000
    assert _chisquare_p(_counts(bonus), trials.p[2]) > 0.001


def test_acceptance_rates_match_overlap(trials: Trials) -> None:
    q = trials.q.double()
    alpha_1 = float(torch.minimum(trials.p[0], q[0]).sum())
    alpha_2 = float(torch.minimum(trials.p[1], q[1]).sum())
    assert 0.2 < alpha_1 < 0.9 and 0.2 < alpha_2 < 0.9  # neither trivial nor hopeless
    num_first = int((trials.num_accepted >= 1).sum())
    _assert_rate(num_first, NUM_TRIALS, alpha_1)
    _assert_rate(int((trials.num_accepted == 2).sum()), num_first, alpha_2)


def test_broken_rules_fail_the_distribution_test(trials: Trials) -> None:
    # Broken 1: keep the draft whenever q_1(d_1) > 0, i.e. always. The first token is then ~ q_1.
    d_1 = trials.drafts[:, 0]  # [NUM_TRIALS]
    kept = d_1[trials.q[0][d_1] > 0]
    assert kept.numel() == NUM_TRIALS
    assert _chisquare_p(_counts(kept), trials.p[0]) < 1e-6
    # Broken 2: the right acceptance test, but recover from p_1 instead of the residual.
    gen = torch.Generator().manual_seed(77)
    p_1, q_1 = trials.p[0].float(), trials.q[0]
    is_accepted = torch.rand(NUM_TRIALS, generator=gen) < p_1[d_1] / q_1[d_1]
    recovered = torch.multinomial(p_1, NUM_TRIALS, replacement=True, generator=gen)
    first = torch.where(is_accepted, d_1, recovered)
    assert _chisquare_p(_counts(first), trials.p[0]) < 1e-6


# ---- the one-hot path ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_hot_trials() -> tuple[torch.Tensor, tuple[int, int], torch.Tensor, VerifyResult]:
    """NUM_TRIALS requests with the same fixed drafts; the target's own samples x_j drawn by the
    engine Sampler, each row from its own key."""
    p_logits, _ = _target_and_draft()
    p = torch.softmax(p_logits.double(), dim=-1)  # [3, VOCAB]
    drafts = (int(p[0].argsort(descending=True)[2]), int(p[1].argmax()))  # fixed d_1, d_2
    params = SamplingParams(temperature=1.0)
    rows = [
        SamplingRow(params, (1,), (), key) for keys in _row_keys(4_000_000, [2] * NUM_TRIALS)
        for key in keys
    ]  # fmt: skip
    sampled = Sampler(VOCAB, eos_token_ids=()).sample(p_logits.repeat(NUM_TRIALS, 1), rows)
    result = verify_by_sampling(sampled.token_ids, [drafts] * NUM_TRIALS)
    return p, drafts, sampled.token_ids.view(NUM_TRIALS, 3), result


def test_one_hot_emits_the_target_distribution(one_hot_trials) -> None:
    p, (d_1, _), _, result = one_hot_trials
    num_accepted = torch.tensor(result.num_accepted)  # [NUM_TRIALS]
    first = torch.tensor([out[0] for out in result.output_token_ids])
    assert _chisquare_p(_counts(first), p[0]) > 0.001
    second = torch.tensor([out[1] for out in result.output_token_ids if len(out) > 1])
    assert _chisquare_p(_counts(second), p[1]) > 0.001
    assert 0.05 < float(p[0, d_1]) < 0.5
    _assert_rate(int((num_accepted >= 1).sum()), NUM_TRIALS, float(p[0, d_1]))


def test_one_hot_broken_rules_fail(one_hot_trials) -> None:
    p, (d_1, _), sampled, _ = one_hot_trials
    # Broken 1: always keep the draft.
    assert _chisquare_p(_counts(torch.full((NUM_TRIALS,), d_1)), p[0]) < 1e-6
    # Broken 2: accept when x_1 == d_1, else emit a fresh draw from p_1 that may be d_1 again.
    fresh = torch.multinomial(
        p[0], NUM_TRIALS, replacement=True, generator=torch.Generator().manual_seed(78)
    )
    first = torch.where(sampled[:, 0] == d_1, d_1, fresh)
    assert _chisquare_p(_counts(first), p[0]) < 1e-6
