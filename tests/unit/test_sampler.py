"""The batched sampler against its one-row reference, and its draws against the distribution."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from engine.core.request import _mix
from engine.sampling.reference import process_reference, sample_reference
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import Sampler
from engine.sampling.truncation import prefix_sums
from engine.sampling_params import SamplingParams

EOS = (2, 7)
NUM_DRAWS = 20_000


def _row(params: SamplingParams, prompt=(1, 3, 3), output=(), random_key=None) -> SamplingRow:
    return SamplingRow(params, tuple(prompt), tuple(output), random_key)


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


# ---- distributions ---------------------------------------------------------------------------

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


# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_is_argmax_and_skips_processing(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(8, 30).to(torch.bfloat16)
    logits[3, 5] = logits[3, 9] = 100.0  # a tie goes to the lowest id
    sampler = Sampler(30, EOS)

    def fail(*args, **kwargs):
        raise AssertionError("the plain greedy path must not process logits")

    monkeypatch.setattr(sampler, "process", fail)
    # Truncation settings do not touch greedy rows, so they need no processing either.
    rows = [_row(SamplingParams(temperature=0.0, top_k=3, min_p=0.5))] * 8
    out = sampler.sample(logits, rows)
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.token_ids[3] == 5
    assert out.logprobs is None and out.top_token_ids is None


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    sampler = Sampler(4, EOS)
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.6),
        SamplingParams(temperature=0.0, presence_penalty=0.6),
    ):
        assert sampler.sample(logits, [_row(params, prompt=(0,), output=(1,))]).token_ids == 2
        assert sampler.sample(logits, [_row(params, prompt=(0,), output=())]).token_ids == 1
    # Repetition counts the prompt too; frequency/presence do not.
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert sampler.sample(logits, [_row(rep, prompt=(1,), output=())]).token_ids == 2
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    assert sampler.sample(logits, [_row(freq, prompt=(1,), output=())]).token_ids == 1


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7] = 9.0  # EOS
    logits[0, 4] = 8.0  # a stop token id
    logits[0, 1] = 7.0
    sampler = Sampler(10, EOS)

    def greedy(output: tuple[int, ...], ignore_eos: bool = False) -> int:
        params = SamplingParams(
            temperature=0.0, min_tokens=3, stop_token_ids=(4,), ignore_eos=ignore_eos
        )
        return int(sampler.sample(logits, [_row(params, output=output)]).token_ids)

    assert greedy(output=(1, 1)) == 1
    assert greedy(output=(1, 1, 1)) == 7
    assert greedy(output=(1, 1), ignore_eos=True) == 7
    processed = sampler.process(logits, [_row(SamplingParams(min_tokens=1), output=())])
    assert processed[0, 2] == float("-inf") and processed[0, 7] == float("-inf")


# ---- seeds -----------------------------------------------------------------------------------


def _seeded_tokens(seed: int, batch_extra: int, num_steps: int = 6) -> list[int]:
    """Tokens of one seeded row over several steps (its output positions), with `batch_extra`
    other rows around it."""
    params = SamplingParams(temperature=1.0, seed=seed)
    logits = torch.zeros(1 + batch_extra, 200)  # uniform: every draw depends on the noise
    tokens = []
    for step in range(num_steps):
        others = [
            _row(SamplingParams(seed=100 + j), random_key=_mix(100 + j, step))
            if j % 2
            else _row(SamplingParams(top_p=0.9))
            for j in range(batch_extra)
        ]
        rows = [*others[: batch_extra // 2], _row(params, random_key=_mix(seed, step))]
        rows += others[batch_extra // 2 :]
        out = Sampler(200, EOS).sample(logits, rows)
        tokens.append(int(out.token_ids[batch_extra // 2]))
    return tokens


def test_same_seed_same_tokens_alone_or_in_batch() -> None:
    alone = _seeded_tokens(seed=42, batch_extra=0)
    assert _seeded_tokens(seed=42, batch_extra=5) == alone
    assert _seeded_tokens(seed=42, batch_extra=2) == alone
    assert _seeded_tokens(seed=43, batch_extra=5) != alone


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_match_processed_log_softmax() -> None:
    torch.manual_seed(0)
    vocab_size = 40
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.3), output=(5,)),
        _row(SamplingParams(top_k=4, logprobs=6)),
        _row(SamplingParams(temperature=0.7, logprobs=0)),
        _row(SamplingParams(top_p=0.5)),
    ]
    logits = torch.randn(4, vocab_size) * 2
    sampler = Sampler(vocab_size, EOS)
    out = sampler.sample(logits, rows)
    expected = torch.log_softmax(sampler.process(logits, rows), dim=-1)
    assert out.logprobs is not None and out.logprobs.shape == (4,)
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.shape == (4, 6) and out.top_logprobs.shape == (4, 6)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, expected.gather(1, out.top_token_ids))
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.equal(out.top_token_ids[:, 0], expected.argmax(dim=-1))
    # The greedy row reports untempered logits with its penalty; top_k=4 leaves -inf after 4.
    greedy = torch.log_softmax(process_reference(logits[0], rows[0], eos_token_ids=EOS), dim=0)
    torch.testing.assert_close(out.top_logprobs[0], greedy.topk(6).values)
    assert torch.isfinite(out.top_logprobs[1, :4]).all()
    assert torch.isneginf(out.top_logprobs[1, 4:]).all()


def test_logprobs_zero_gives_sampled_logprob_only() -> None:
    logits = torch.randn(2, 16)
    rows = [_row(SamplingParams(temperature=0.0, logprobs=0))] * 2
    out = Sampler(16, EOS).sample(logits, rows)
    assert out.top_token_ids is not None and out.top_token_ids.shape == (2, 0)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, dim=-1).amax(dim=-1))


def test_rejects_mismatched_shapes() -> None:
    sampler = Sampler(16, EOS)
    with pytest.raises(ValueError):
        sampler.sample(torch.randn(2, 15), [_row(SamplingParams())] * 2)
    with pytest.raises(ValueError):
        sampler.sample(torch.randn(2, 16), [_row(SamplingParams())])


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


# ---- batch invariance ------------------------------------------------------------------------

INVARIANCE_VOCAB = 32000
INVARIANCE_SEEDS = range(4)  # odd seeds round the logits to bf16: many ties


def _invariance_logits(seed: int, num_rows: int) -> torch.Tensor:
    """[num_rows, INVARIANCE_VOCAB] random logits; bf16-rounded (ties everywhere) for odd seeds."""
    logits = torch.randn(num_rows, INVARIANCE_VOCAB, generator=torch.Generator().manual_seed(seed))
    logits = logits * 3
    return logits.to(torch.bfloat16).float() if seed % 2 else logits


def _float32_neighbours(values: torch.Tensor, max_steps: int = 2) -> list[float]:
    """Every float32 within max_steps representable steps of each of values [n] (in (0, 1))."""
    out = set()
    for value in values.float():
        up = down = value
        out.add(float(value))
        for _ in range(max_steps):
            up = torch.nextafter(up, torch.tensor(2.0))
            down = torch.nextafter(down, torch.tensor(0.0))
            out.update((float(up), float(down)))
    return sorted(v for v in out if 0.0 < v < 1.0)


def _boundary_top_ps(row_logits: torch.Tensor, top_k: int, num_ranks: int = 4) -> list[float]:
    """top_p values at the cumulative masses of the row's top tokens (after top_k), to within
    two float32 steps: there the last bit of the row's sums decides the cutoff, so a sum that
    depends on the rest of the step shows as a different set of kept tokens."""
    x = row_logits.double()
    if top_k:
        x = x[x >= x.topk(top_k).values[-1]]
    mass = x.sort(descending=True).values.softmax(dim=0).cumsum(dim=0)  # [num_finite]
    return _float32_neighbours(mass[:num_ranks])


def _boundary_min_ps(row_logits: torch.Tensor, num_ranks: int = 3) -> list[float]:
    """min_p values at p(token) / p(max) of the row's runners-up, to within two float32 steps."""
    top = row_logits.double().topk(num_ranks + 1).values  # [num_ranks + 1], descending
    return _float32_neighbours((top[1:] - top[0]).exp())


# Rows that share the step: other top_k (5, 50, none), top_p without top_k (a full sort), greedy
# rows, min_p, another seed; the rows under test go first, in the middle, and last.
NEIGHBOURS = (
    SamplingParams(top_k=5),
    SamplingParams(top_k=50, top_p=0.8),
    SamplingParams(temperature=0.7),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.0),
    SamplingParams(top_k=50),
    SamplingParams(min_p=0.05, seed=3),
    SamplingParams(temperature=0.0, top_k=2),
)
NEIGHBOUR_LOGITS = _invariance_logits(1001, len(NEIGHBOURS))  # [num_neighbours, vocab], bf16
CONTEXTS = (  # (position of the rows under test, their neighbours)
    (0, NEIGHBOURS[:2]),
    (1, (NEIGHBOURS[5], NEIGHBOURS[4])),
    (2, (NEIGHBOURS[3], NEIGHBOURS[2], NEIGHBOURS[7])),
    (len(NEIGHBOURS), NEIGHBOURS),
)


def _seeded_row(params: SamplingParams) -> SamplingRow:
    return _row(params, random_key=None if params.seed is None else _mix(params.seed, 0))


def _assert_batch_invariant(row_logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Rows with these params over the same logits [vocab]: the processed logits and the
    sampled token (same seed) of each, bit for bit, alone and side by side in every context."""
    sampler = Sampler(INVARIANCE_VOCAB, EOS)
    alone, alone_tokens = [], []
    for p in params:
        rows = [_seeded_row(p)]
        processed = sampler.process(row_logits[None], rows)  # [1, vocab]
        alone.append(processed[0])
        alone_tokens.append(sampler.sample_processed(processed, rows).token_ids[0])
    for position, neighbours in CONTEXTS:
        # The same keys: a seeded row draws what it drew alone.
        rows = [_seeded_row(p) for p in neighbours]
        rows[position:position] = [_seeded_row(p) for p in params]
        logits = torch.cat(
            (
                NEIGHBOUR_LOGITS[:position],
                row_logits.expand(len(params), -1),
                NEIGHBOUR_LOGITS[position : len(neighbours)],
            )
        )  # [num_rows, vocab]
        processed = sampler.process(logits, rows)
        token_ids = sampler.sample_processed(processed, rows).token_ids  # [num_rows]
        for j, p in enumerate(params):
            assert torch.equal(processed[position + j], alone[j]), (p, position)
            assert torch.equal(token_ids[position + j], alone_tokens[j]), (p, position)


@pytest.mark.parametrize("top_k", [0, 5, 40])
@pytest.mark.parametrize("seed", INVARIANCE_SEEDS)
def test_top_p_row_is_batch_invariant(seed: int, top_k: int) -> None:
    """Seeded top_p rows (with or without top_k) process and sample the same, bit for bit,
    whatever shares their step, even where top_p sits on a cumulative mass to the last bit."""
    row_logits = _invariance_logits(seed, 1)[0]  # [vocab]
    top_ps = _boundary_top_ps(row_logits, top_k)
    params = [SamplingParams(top_k=top_k, top_p=top_p, seed=seed) for top_p in top_ps]
    _assert_batch_invariant(row_logits, params)


@pytest.mark.parametrize("top_k", [0, 4])
@pytest.mark.parametrize("seed", INVARIANCE_SEEDS)
def test_min_p_row_is_batch_invariant(seed: int, top_k: int) -> None:
    """min_p's softmax runs over each full row: seeded min_p rows are batch invariant too, even
    where min_p sits on a probability ratio to the last bit."""
    row_logits = _invariance_logits(seed, 1)[0]  # [vocab]
    params = [
        SamplingParams(top_k=top_k, top_p=0.97, min_p=min_p, seed=seed, temperature=0.9)
        for min_p in _boundary_min_ps(row_logits)
    ]
    _assert_batch_invariant(row_logits, params)


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
