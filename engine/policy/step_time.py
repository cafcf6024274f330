"""The policy's cost model: how long one target step takes, learned from measured steps.

t(n, context, rows) = v(n) + c * max(context - R(n), 0) + r * (rows - 1), where n is the step's
query tokens, context its attention's KV reads (`attention_reads`: each query token reads every
position up to its own, so a sequence's chunk of q tokens after s cached ones reads
q * s + q (q + 1) / 2) and rows the logits rows it computes and verifies (one per sampling
sequence plus one per draft token). Reads, not the sum of the sequences' lengths: a decode token
over 2,048 cached positions costs the same attention whether it is alone or a verify row beside 7
drafts, and a single length per sequence priced the verify's rows (and, calibrated on 8-token
chunks, every decode step) wrong by up to 8x. v is calibrated on forwards shaped as served steps
of n tokens are (n one-token sequences, or verify chunks of 1 + K, past that a prompt chunk),
with one logits row (engine/policy/calibration.py), so on a GPU they replay the graphs
served steps do. R(n) is the reads those calibration shapes made themselves (their queries
reading their own positions), already in v: c prices only reads beyond them. On a device that
attends to a step's queries in parallel (CUDA), c is kept per query count (context_grid,
context_coefs): there a read costs less the more queries share the step. (Subtracting
c * R(n) from v instead drove v below zero on a GPU, where a 4,096-token chunk's 8 million reads
run in parallel and cost far less than c, timed on a few queries, says.) r, the cost of a row
beyond the first, is calibrated on multi-sequence batches shaped like verify steps (every row
scored). A draft token costs v's slope plus r: without r, a batch of sixteen sequences verifying
four drafts each was priced like an 80-token prompt chunk, which computes one logits row where
the verify computes 80.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

# Weight of one measured step in the online refinement of v.
STEP_TIME_RATE = 0.1
# The knee: the first n past which one more token costs this share of a one-token step.
KNEE_THRESHOLD = 0.02


class StepTimePredictor(Protocol):
    """Anything that predicts t(n, context); the allocator needs nothing more."""

    def predict(self, n: int, context: int = 0, rows: int = 1) -> float: ...


class MemoPredictor:
    """A predictor's answers, each computed once: for the span of one decision, when the model
    does not change."""

    def __init__(self, model: StepTimePredictor) -> None:
        self._model = model
        self._seen: dict[tuple[int, int, int], float] = {}

    def predict(self, n: int, context: int = 0, rows: int = 1) -> float:
        key = (n, context, rows)
        seconds = self._seen.get(key)
        if seconds is None:
            seconds = self._seen[key] = self._model.predict(n, context, rows)
        return seconds


class StepTimeModel:
    """t(n, context, rows) = v(n) + c(n) * max(context - R(n), 0) + r * (rows - 1), v and R
    piecewise linear over a grid of n, v non-decreasing; c one slope, or per query count where
    the attention runs queries in parallel (see the module's docstring).

    A grid with a free value per point follows a memory-bound plateau, the knee, and a concave
    compute-bound tail without assuming a shape; the context term is linear in the attention's
    KV reads beyond the grid's own. Beyond the last grid point v extends along its last slope.
    `observe` refines the grid values online (an EWMA toward each measurement, split between the
    two neighbouring grid points by their interpolation weights); the context and row costs stay as
    calibrated. Steps that ran eagerly where graphs serve their token count are learned into a
    table of their own (`predict_off_graph`): the grid prices the path decode and verify steps
    take.
    """

    def __init__(
        self,
        grid: Sequence[int],
        values: Sequence[float],
        context_coef: float = 0.0,
        row_coef: float = 0.0,
        knee_threshold: float = KNEE_THRESHOLD,
        rate: float = STEP_TIME_RATE,
        base_reads: Sequence[float] | None = None,
        context_grid: Sequence[int] | None = None,
        context_coefs: Sequence[float] | None = None,
    ) -> None:
        if not grid or len(grid) != len(values) or list(grid) != sorted(set(grid)) or grid[0] < 1:
            raise ValueError(f"grid must be strictly increasing positive ints, got {grid}")
        if base_reads is not None and len(base_reads) != len(grid):
            raise ValueError("base_reads needs one value per grid point")
        self.grid = [int(g) for g in grid]
        # `learned`: what each grid point has learned on its own (`observe`); `values`, what
        # predictions read, is their non-decreasing envelope. Learned values that were raised to
        # the envelope would ratchet: a burst of slow one-token steps lifts t(1), the envelope
        # lifts t(2) with it, and t(2) comes back down only through steps of two tokens, which
        # the policy, now pricing them too dear, stops taking. Kept apart, t(2) is back when
        # t(1) is.
        self.learned: list[float] = []
        self.values: list[float] = []
        # What steps run eagerly where graphs serve their token count teach (`observe`): kept
        # apart, so a burst of them does not price every graph step as eager (None until one).
        self.eager_learned: list[float] | None = None
        self.eager_values: list[float] | None = None
        self.rescale(values)
        self.context_coef = max(float(context_coef), 0.0)
        self.row_coef = max(float(row_coef), 0.0)
        # The KV reads each grid point's own timing already holds (its shape's queries reading
        # their own positions): only reads beyond them are priced at context_coef.
        self.base_reads = [max(float(r), 0.0) for r in (base_reads or [0.0] * len(self.grid))]
        # Where the attention runs a step's queries in parallel (a GPU), a KV read costs less the
        # more queries share the step: the slope per read as measured at a few query counts,
        # interpolated in n (held past both ends). None: one slope, context_coef, for every n.
        if (context_grid is None) != (context_coefs is None):
            raise ValueError("context_grid and context_coefs go together")
        self.context_grid: list[int] | None = None
        self.context_coefs: list[float] | None = None
        if context_grid is not None and context_coefs is not None:
            if len(context_grid) != len(context_coefs) or list(context_grid) != sorted(
                set(context_grid)
            ):
                raise ValueError("context_grid must be increasing, one coefficient a point")
            self.context_grid = [int(g) for g in context_grid]
            self.context_coefs = [max(float(c), 0.0) for c in context_coefs]
        self.knee_threshold = knee_threshold
        self.rate = rate

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[int, int, float]], grid: Sequence[int] | None = None, **kw: Any
    ) -> StepTimeModel:
        """Least squares over samples (n, context, seconds); the grid defaults to the distinct n."""
        rows = [(int(n), int(ctx), float(s)) for n, ctx, s in samples]
        if not rows:
            raise ValueError("no samples to fit")
        grid = sorted(set(grid if grid is not None else (n for n, _, _ in rows)))
        has_context = len({ctx for _, ctx, _ in rows}) > 1
        design = torch.tensor(
            [_hat_weights(grid, n) + ([float(ctx)] if has_context else []) for n, ctx, _ in rows],
            dtype=torch.float64,
            device="cpu",
        )  # [num_samples, len(grid) (+1)]
        target = torch.tensor(
            [[s] for _, _, s in rows], dtype=torch.float64, device="cpu"
        )  # [num_samples, 1]
        solution = torch.linalg.lstsq(design, target, driver="gelsd").solution[:, 0].tolist()
        context_coef = solution[len(grid)] if has_context else 0.0
        if context_coef < 0.0:
            # A negative context slope is noise; refit the grid alone instead of clamping it.
            return cls.fit([(n, 0, s) for n, _, s in rows], grid, **kw)
        counts = [
            sum(w[j] for w in (_hat_weights(grid, n) for n, _, _ in rows)) for j in range(len(grid))
        ]
        values = pool_adjacent_violators(solution[: len(grid)], counts)
        return cls(grid, values, context_coef, **kw)

    def predict(self, n: int, context: int = 0, rows: int = 1) -> float:
        return self._predict(self.values, n, context, rows)

    def _predict(self, values: Sequence[float], n: int, context: int, rows: int) -> float:
        if n >= self.grid[-1]:
            base = values[-1] + _slope(self.grid, values, len(self.grid) - 2) * (n - self.grid[-1])
        else:
            base = _lerp(self.grid, values, n)
        extra = max(context - _lerp(self.grid, self.base_reads, n), 0.0)
        return base + self.context_coef_at(n) * extra + self.row_coef * max(rows - 1, 0)

    def context_coef_at(self, n: int) -> float:
        """Seconds per KV read beyond the grid's own, in a step of n query tokens."""
        if self.context_grid is None or self.context_coefs is None:
            return self.context_coef
        return _lerp(self.context_grid, self.context_coefs, n)

    def observe(
        self, n: int, context: int, seconds: float, rows: int = 1, off_graph: bool = False
    ) -> None:
        """Move the learned grid values around n a step `rate` toward one measured step time,
        judged against what they predict (not the envelope: a neighbour's excess is not n's).
        `off_graph`: the step ran eagerly where a decode step of n tokens replays a CUDA graph
        (a prompt chunk beside decodes on flash-attn, a draft model's catch-up); it teaches the
        eager table (`predict_off_graph`), never the grid the graph steps are priced on."""
        if off_graph:
            if self.eager_learned is None:
                self.eager_learned = list(self.learned)
            self._learn(self.eager_learned, n, context, seconds, rows)
            self.eager_values = _non_decreasing(self.eager_learned)
            return
        self._learn(self.learned, n, context, seconds, rows)
        self.values = _non_decreasing(self.learned)

    def predict_off_graph(self, n: int, context: int = 0, rows: int = 1) -> float:
        """t of a step that runs eagerly where graphs would serve its token count: the eager
        table once such steps have been seen, the graph grid until then."""
        return self._predict(self.eager_values or self.values, n, context, rows)

    def _learn(self, learned: list[float], n: int, context: int, seconds: float, rows: int) -> None:
        predicted = self._predict(learned, n, context, rows)
        # A step slowed by something else (another process, a page fault) says little about
        # the device: one measurement moves the model by at most half its prediction.
        error = max(-0.5 * predicted, min(seconds - predicted, 0.5 * predicted))
        weights = _hat_weights(self.grid, n)
        for j, w in enumerate(weights):
            learned[j] = max(learned[j] + self.rate * w * error, 0.0)

    def rescale(self, values: Sequence[float]) -> None:
        """Replace the grid values, learned and predicted alike (the eager table starts over)."""
        self.values = _non_decreasing([max(float(v), 0.0) for v in values])
        self.learned = list(self.values)
        self.eager_learned = self.eager_values = None

    @property
    def knee(self) -> int:
        """The first n past which a token costs more than knee_threshold of the base step.

        The last grid point when no segment is that steep: flat as far as it was measured.
        """
        limit = self.knee_threshold * self.values[0]
        for j in range(len(self.grid) - 1):
            if self._slope(j) > limit:
                return self.grid[j]
        return self.grid[-1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 5,
            "grid": list(self.grid),
            "values": list(self.values),
            "base_reads": list(self.base_reads),
            "context_grid": self.context_grid,
            "context_coefs": self.context_coefs,
            "context_coef": self.context_coef,
            "row_coef": self.row_coef,
            "knee_threshold": self.knee_threshold,
            "rate": self.rate,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTimeModel:
        # Version 1 had no row cost, 2 a context of sequence lengths, 3 grid values less their
        # shapes' own reads at the context slope (negative on a GPU, whose attention runs the
        # queries in parallel, and clamped to zero): calibrate again. Version 4 is 5 with one
        # context slope for every n.
        if data.get("version") not in (4, 5):
            raise ValueError(f"unknown step-time model version {data.get('version')!r}")
        return cls(
            data["grid"],
            data["values"],
            data["context_coef"],
            data["row_coef"],
            data["knee_threshold"],
            data["rate"],
            data["base_reads"],
            data.get("context_grid"),
            data.get("context_coefs"),
        )

    def _slope(self, j: int) -> float:
        return _slope(self.grid, self.values, j)


def _slope(grid: Sequence[int], ys: Sequence[float], j: int) -> float:
    """The slope of ys over grid segment j (0 on a grid of one point)."""
    if j < 0:
        return 0.0
    return (ys[j + 1] - ys[j]) / (grid[j + 1] - grid[j])


def _lerp(grid: Sequence[int], ys: Sequence[float], n: int) -> float:
    """ys interpolated linearly over the grid at n, held past both ends (one bisection, no
    temporaries: the policy predicts hundreds of steps a decision)."""
    if n <= grid[0]:
        return ys[0]
    if n >= grid[-1]:
        return ys[-1]
    hi = bisect.bisect_right(grid, n)
    lo = hi - 1
    return ys[lo] + (n - grid[lo]) / (grid[hi] - grid[lo]) * (ys[hi] - ys[lo])


def _hat_weights(grid: Sequence[int], n: int) -> list[float]:
    """Linear-interpolation weights of n over the grid (clamped at both ends); they sum to 1."""
    weights = [0.0] * len(grid)
    if n <= grid[0]:
        weights[0] = 1.0
    elif n >= grid[-1]:
        weights[-1] = 1.0
    else:
        hi = bisect.bisect_right(grid, n)
        frac = (n - grid[hi - 1]) / (grid[hi] - grid[hi - 1])
        weights[hi - 1], weights[hi] = 1.0 - frac, frac
    return weights


def _non_decreasing(values: Sequence[float]) -> list[float]:
    out: list[float] = []
    for v in values:
        out.append(max(v, out[-1]) if out else v)
    return out


def pool_adjacent_violators(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit to values (isotonic regression)."""
    blocks: list[list[float]] = []  # [mean, weight, size]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, max(w, 1e-9), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, s2), (m1, w1, s1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, s1 + s2])
    return [m for m, _, size in blocks for _ in range(int(size))]
