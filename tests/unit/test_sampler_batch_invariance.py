"""The sampler's batch invariance: seeded top_p and min_p rows process and sample the same, bit for
bit, alone and beside any other rows in the step, even where top_p sits on a cumulative mass or
min_p on a probability ratio to the last float32 bit."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import _mix
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.unit.sampler_helpers import EOS, _row

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
