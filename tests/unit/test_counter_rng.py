"""Counter-based randomness (`engine/sampling/counter_rng.py`): its values against their integer
definition, their statistics, batch invariance, the samples drawn with them against the
per-request torch generators they replace, the number of random-number calls of a step, and
seeded reproducibility end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported lazily under a dispatch mode: not while patched)
from scipy.stats import chi2_contingency, chisquare, kstest
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.core.drafts import Draft
from engine.core.request import Request, _mix
from engine.sampling import counter_rng
from engine.sampling.counter_rng import exponentials, row_keys, uniforms
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import Sampler
from engine.verification.verifier import Verifier
from tests.conftest import ngram_llm

MASK64 = (1 << 64) - 1
CPU = torch.device("cpu")


def _reference_uniform(key: int, column: int) -> float:
    """The definition in plain Python integers: SplitMix64's output at state key + (pair + 1) *
    gamma, bits 0..22 for an even column and 32..54 for an odd one, as (h + 0.5) / 2^23."""
    state = (key + (column // 2 + 1) * 0x9E3779B97F4A7C15) & MASK64
    state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & MASK64
    state ^= state >> 31
    bits = (state >> (32 * (column % 2))) & ((1 << 23) - 1)
    return (bits + 0.5) / 2**23


def _keys(seed: int, count: int) -> torch.Tensor:
    """[count] int64: the keys of `count` consecutive output positions of one seed."""
    return row_keys([_mix(seed, i) for i in range(count)], CPU)


# ---- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_column", [0, 1, 7, 1 << 40])  # 1 << 40: far past any vocab
def test_uniforms_equal_their_integer_definition(first_column: int) -> None:
    keys = [0, 1, 5, _mix(3, 4), (1 << 63) - 1, -1, -(1 << 63)]  # int64 patterns, any sign
    got = uniforms(torch.tensor(keys, dtype=torch.int64), 9, first_column)  # [7, 9]
    for r, key in enumerate(keys):
        expected = [_reference_uniform(key & MASK64, first_column + c) for c in range(9)]
        assert got[r].tolist() == expected, (key, first_column)


def test_uniforms_lie_strictly_inside_zero_and_one(monkeypatch) -> None:
    values = uniforms(_keys(1, 64), 20_000)  # [64, 20000]
    assert values.dtype == torch.float32
    assert float(values.min()) > 0.0 and float(values.max()) < 1.0
    # The extreme words give the extreme uniforms, (0.5 and 2^23 - 0.5) / 2^23, whose noise is
    # finite and positive: no floor is needed where -log is taken.
    extremes = torch.tensor([[0, -1]], dtype=torch.int64)  # [1, 2]: all bits 0, all bits 1
    monkeypatch.setattr(counter_rng, "_splitmix", lambda out, *_: out.copy_(extremes))
    low_high = uniforms(torch.zeros(1, dtype=torch.int64), 4)[0].tolist()
    noise = exponentials(torch.zeros(1, dtype=torch.int64), 4)[0]
    assert low_high == [2.0**-24, 2.0**-24, 1 - 2.0**-24, 1 - 2.0**-24]
    assert bool(torch.isfinite(noise).all()) and float(noise.min()) > 0.0


def test_uniforms_are_uniform() -> None:
    values = uniforms(_keys(2, 16), 65_536)  # [16, 65536]
    for parity in (0, 1):  # the two halves of every word, separately
        sample = values[:, parity::2].flatten().double().numpy()
        assert kstest(sample, "uniform").pvalue > 0.001, parity
        counts = torch.histc(values[:, parity::2].flatten(), bins=256, min=0.0, max=1.0)
        assert chisquare(counts.numpy()).pvalue > 0.001, parity


def _max_abs_correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    """max over rows of |Pearson correlation| of a[r] and b[r] ([rows, n] each)."""
    a = a.double() - a.double().mean(dim=1, keepdim=True)
    b = b.double() - b.double().mean(dim=1, keepdim=True)
    r = (a * b).sum(dim=1) / (a.norm(dim=1) * b.norm(dim=1))
    return float(r.abs().max())


def test_columns_and_keys_are_independent() -> None:
    n = 100_000
    bound = 5 / math.sqrt(n)  # five standard deviations of a correlation of independent values
    values = uniforms(_keys(3, 8), n + 3)  # [8, n + 3]
    for lag in (1, 2, 3):  # within a word (lag 1 from an even column), across words
        assert _max_abs_correlation(values[:, :n], values[:, lag : n + lag]) < bound, lag
    # Rows of neighbouring positions, neighbouring seeds and even raw keys one apart.
    for keys in (_keys(4, 2), row_keys([_mix(5, 0), _mix(6, 0)], CPU), torch.tensor([7, 8])):
        pair = uniforms(keys, n)  # [2, n]
        assert _max_abs_correlation(pair[:1], pair[1:]) < bound
    # Pairs of neighbouring columns fill an 8 x 8 grid evenly (a joint test, not only linear).
    grid = (values[:, :n:2] * 8).long() * 8 + (values[:, 1 : n + 1 : 2] * 8).long()
    assert chisquare(torch.bincount(grid.flatten(), minlength=64).numpy()).pvalue > 0.001


# ---- batch invariance --------------------------------------------------------------------------


def test_a_rows_values_ignore_the_rest_of_the_batch() -> None:
    keys = _keys(9, 6)  # [6]
    alone = [exponentials(keys[r : r + 1], 1000) for r in range(6)]  # [1, 1000] each
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 2, 4], [2, 2, 0]):
        batch = exponentials(keys[order], 1000)  # [len(order), 1000]
        for position, r in enumerate(order):
            assert torch.equal(batch[position], alone[r][0]), (order, position)
    # A window of columns equals the same columns of a wider draw.
    assert torch.equal(uniforms(keys, 37, 11), uniforms(keys, 48)[:, 11:])


def test_the_whole_computation_stays_on_the_keys_device() -> None:
    """A fake second device: on "meta" every intermediate must be made beside the keys (a
    factory that lands on the CPU would fail to mix with them)."""
    keys = _keys(10, 3).to("meta")
    assert uniforms(keys, 11, 3).device.type == "meta"
    assert exponentials(keys, 10).shape == (3, 10)


def test_rows_without_a_key_get_fresh_ones_in_one_draw(monkeypatch) -> None:
    calls = []
    real = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: calls.append(a) or real(*a, **k))
    torch.manual_seed(0)
    keys = row_keys([None, 5, None, None], CPU).tolist()
    assert len(calls) == 1 and keys[1] == 5 and len({keys[0], keys[2], keys[3], 5}) == 4
    torch.manual_seed(0)
    assert row_keys([None, 5, None, None], CPU).tolist() == keys


# ---- sampling with counter noise against the per-request generators ------------------------------

VOCAB = 12
LOGITS = torch.tensor([1.2, 0.3, -0.4, 2.0, 0.9, -1.0, 0.0, 1.6, -0.2, 0.5, 1.0, -0.7])
NUM_DRAWS = 20_000


def _sample_counts(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of tokens of one seed's output positions: NUM_DRAWS sampled by the engine's
    Sampler in one batch (counter noise), and 4000 drawn one at a time from the per-request
    torch generator of each position (`Request.generator`, the reference)."""
    sampler = Sampler(VOCAB, eos_token_ids=())
    request = Request("r", [1, 2], params, max_tokens=NUM_DRAWS)
    rows = [SamplingRow(params, (1, 2), (), request.random_key(i)) for i in range(NUM_DRAWS)]
    counter = sampler.sample(LOGITS.repeat(NUM_DRAWS, 1), rows).token_ids  # [NUM_DRAWS]
    probs = sampler.process(LOGITS[None], rows[:1])[0].softmax(dim=0)  # [VOCAB]
    reference = [
        int(torch.multinomial(probs, 1, generator=request.generator(i, CPU))) for i in range(4000)
    ]
    return (
        torch.bincount(counter, minlength=VOCAB),
        torch.bincount(torch.tensor(reference), minlength=VOCAB),
    )


def _chisquare_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts under probs; a draw outside the support fails outright."""
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    return float(chisquare(counts[support].double().numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.6, top_k=6, seed=12),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=13),
    ],
)
def test_counter_noise_samples_the_processed_distribution(params: SamplingParams) -> None:
    row = SamplingRow(params, (1, 2), (), None)
    probs = Sampler(VOCAB, eos_token_ids=()).process(LOGITS[None], [row])[0].softmax(dim=0)
    counter, reference = _sample_counts(params)
    assert _chisquare_p(counter, probs) > 0.001
    assert _chisquare_p(reference, probs) > 0.001
    # The two draw from one law: a test of homogeneity over the tokens either drew.
    table = torch.stack([counter, reference])[:, (counter + reference) > 0]
    assert chi2_contingency(table.numpy()).pvalue > 0.001


def test_the_distribution_test_can_fail() -> None:
    """Sampling at temperature 1 but holding the draws against temperature 0.6's law fails."""
    counter, _ = _sample_counts(SamplingParams(temperature=1.0, seed=11))
    row = SamplingRow(SamplingParams(temperature=0.6), (1, 2), (), None)
    cooler = Sampler(VOCAB, eos_token_ids=()).process(LOGITS[None], [row])[0].softmax(dim=0)
    assert _chisquare_p(counter, cooler) < 1e-6


# ---- one step's random-number calls ------------------------------------------------------------

STEP_VOCAB = 64
# Everything that makes random numbers from torch's generators, or makes a generator.
RANDOM_CALLS = [
    (torch, "Generator"),
    (torch, "rand"),
    (torch, "randn"),
    (torch, "randint"),
    (torch, "multinomial"),
    (torch.Tensor, "uniform_"),
    (torch.Tensor, "exponential_"),
]


class _CountingMode(TorchDispatchMode):
    """Counts the aten ops that compute (a launch each on a GPU) run while it is active; views
    only relabel memory, and their number follows the shapes of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.num_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.num_ops += not func.is_view
        return func(*args, **(kwargs or {}))


def _step_calls(num_requests: int, monkeypatch) -> tuple[int, int, list[list[int]]]:
    """One verify step of num_requests seeded temperature-1 requests, the odd ones with draft
    distributions (rejection sampling), the even ones with one-hot drafts -> (random-number
    calls, aten ops, the emitted tokens). Request i's inputs depend on i alone."""
    items, rows = [], []
    for i in range(num_requests):
        gen = torch.Generator().manual_seed(i)
        params = SamplingParams(temperature=1.0, seed=i)
        q = torch.rand(3, STEP_VOCAB, generator=gen).softmax(dim=-1) if i % 2 else None
        items.append((Request(f"r{i}", [1, 2, 3], params, max_tokens=32), Draft((4, 5, 6), "t", q)))
        rows.append(torch.randn(4, STEP_VOCAB, generator=gen))  # [k + 1, vocab]
    verifier = Verifier(Sampler(STEP_VOCAB, eos_token_ids=()))
    num_calls = 0

    def counting(real):
        def call(*args, **kwargs):
            nonlocal num_calls
            num_calls += 1
            return real(*args, **kwargs)

        return call

    logits = torch.cat(rows)  # [num_rows, vocab]
    with monkeypatch.context() as patch:
        for owner, name in RANDOM_CALLS:
            patch.setattr(owner, name, counting(getattr(owner, name)))
        with _CountingMode() as mode:
            results = verifier.run(logits, items)
    return num_calls, mode.num_ops, [r.token_ids for r in results]


def test_a_step_draws_in_a_constant_number_of_calls(monkeypatch) -> None:
    """A step of 2 or 16 seeded sampled requests, verifying drafts both ways, makes no torch
    generator and no per-row draw, and runs the same number of ops: the randomness of all its
    rows is one batched computation, not a launch per row."""
    few_rng, few_ops, few_tokens = _step_calls(2, monkeypatch)
    many_rng, many_ops, many_tokens = _step_calls(16, monkeypatch)
    assert few_rng == many_rng == 0
    assert few_ops == many_ops
    # Request i's tokens depend on its seed, position and drafts only, not on the batch.
    assert many_tokens[:2] == few_tokens


# ---- end to end ---------------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11], [12, 13, 12, 13, 12, 13]]


@pytest.mark.parametrize("speculation", [False, True])
def test_a_seed_gives_the_same_tokens_alone_and_in_a_batch(tiny_llama, speculation) -> None:
    """Temperature 1, seed set: the same tokens alone, beside other (seeded and unseeded)
    requests, and, with one-hot n-gram drafts, as without speculation."""
    llm = ngram_llm(tiny_llama) if speculation else LLM(str(tiny_llama), dtype="float32")
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True),
    ]
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others[0], seeded, others[1]])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=1235, max_tokens=24, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], other_seed)[0].outputs[0].token_ids != alone
    if speculation:
        assert llm.engine.spec_stats.num_draft_tokens > 0
        plain = LLM(str(tiny_llama), dtype="float32").generate([PROMPTS[0]], seeded)
        assert plain[0].outputs[0].token_ids == alone
