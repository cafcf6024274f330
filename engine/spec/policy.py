"""The speculation policy's pure core: step-time model, acceptance estimates, draft allocation.

Nothing here knows the engine. The caller measures step times and verify results, feeds them in,
and asks each step for a draft length per decoding request. Words used throughout:

- step time t(n, context): wall seconds of one target forward over n query tokens when the batch
  holds `context` tokens in total (the sum of sequence lengths).
- alpha: the probability that a drafted token is accepted, given every earlier one was.
- expected tokens E(alpha, k): tokens a verify of k drafts emits (accepted + recovered or bonus).
- goodput: Σ_i E(alpha_i, k_i) / (t(base + Σ_i k_i, context) + draft time), tokens per second.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

Reason = Literal[
    "speculating", "compute_bound", "low_acceptance", "request_opt_out", "batch_size", "utilization"
]
CAP_REASONS: frozenset[str] = frozenset(
    {"request_opt_out", "batch_size", "utilization", "compute_bound"}
)
DEFAULT_PRIORS: Mapping[str, float] = {"ngram": 0.5, "draft_model": 0.6, "prediction": 0.8}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify of k drafts emits: Σ_{j=0..k} alpha^j = (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class StepTimePredictor(Protocol):
    """Anything that predicts t(n, context); the allocator needs nothing more."""

    def predict(self, n: int, context: int) -> float: ...


class StepTimeModel:
    """t(n, context) = v(n) + c * context, v piecewise linear over a grid of n, non-decreasing.

    A grid with a free value per point follows a memory-bound plateau, the knee, and a concave
    compute-bound tail without assuming a shape; the context term is linear because attention
    reads every cached token once. Beyond the last grid point v extends along its last slope.
    `observe` refines the grid values online (an EWMA toward each measurement, split between the
    two neighbouring grid points by their interpolation weights); the context slope stays as fit.
    """

    def __init__(
        self,
        grid: Sequence[int],
        values: Sequence[float],
        context_coef: float = 0.0,
        knee_threshold: float = 0.02,
        rate: float = 0.1,
    ) -> None:
        if not grid or len(grid) != len(values) or list(grid) != sorted(set(grid)) or grid[0] < 1:
            raise ValueError(f"grid must be strictly increasing positive ints, got {grid}")
        self.grid = [int(g) for g in grid]
        self.values = _non_decreasing([max(float(v), 0.0) for v in values])
        self.context_coef = max(float(context_coef), 0.0)
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

    def predict(self, n: int, context: int = 0) -> float:
        if n <= self.grid[0]:
            base = self.values[0]
        elif n >= self.grid[-1]:
            base = self.values[-1] + self._last_slope() * (n - self.grid[-1])
        else:
            base = sum(w * v for w, v in zip(_hat_weights(self.grid, n), self.values, strict=True))
        return base + self.context_coef * max(context, 0)

    def observe(self, n: int, context: int, seconds: float) -> None:
        """Move the grid values around n a step `rate` toward one measured step time."""
        predicted = self.predict(n, context)
        # A step slowed by something else (another process, a page fault) says little about
        # the device: one measurement moves the model by at most half its prediction.
        error = max(-0.5 * predicted, min(seconds - predicted, 0.5 * predicted))
        weights = _hat_weights(self.grid, n)
        for j, w in enumerate(weights):
            self.values[j] = max(self.values[j] + self.rate * w * error, 0.0)
        self.values = _non_decreasing(self.values)

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
            "version": 1,
            "grid": list(self.grid),
            "values": list(self.values),
            "context_coef": self.context_coef,
            "knee_threshold": self.knee_threshold,
            "rate": self.rate,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTimeModel:
        if data.get("version") != 1:
            raise ValueError(f"unknown step-time model version {data.get('version')!r}")
        return cls(
            data["grid"], data["values"], data["context_coef"], data["knee_threshold"], data["rate"]
        )

    def _slope(self, j: int) -> float:
        return (self.values[j + 1] - self.values[j]) / (self.grid[j + 1] - self.grid[j])

    def _last_slope(self) -> float:
        return self._slope(len(self.grid) - 2) if len(self.grid) > 1 else 0.0


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


class AcceptanceTracker:
    """Per-request acceptance estimate alpha: a decayed maximum-likelihood estimate with a prior.

    A verify of k drafts that accepts a of them is a truncated geometric draw: positions 1..a
    passed, position a+1 failed if a < k, and positions past the first failure were never tested.
    Its likelihood is alpha^a (1 - alpha)^[a < k], so the MLE over many verifies is
    Σ accepted / (Σ accepted + Σ [a < k]). Plain accepted / drafted would count the untested
    positions as failures and read far low (alpha = 0.6 with k = 5 gives 0.28). Both sums decay by
    `decay` per verify (an EWMA, so a request whose text turns predictable is followed), and
    `prior_weight` pseudo-trials at the method's prior keep alpha inside (0, 1) and give a request
    with no history a sensible start.

    Decisions take `upper_bound`: alpha plus `optimism` standard errors. An estimate moves only
    when its request drafts, so judged by alpha alone a request whose prior says "does not pay"
    would never draft and never learn otherwise (a draft model whose code-edit drafts are mostly
    accepted stayed off for whole answers at a prior of 0.6). The bound is wide while a request has few
    trials, so it is tried on its first steps, and narrows as its verifies come in.
    """

    def __init__(
        self,
        priors: Mapping[str, float] = DEFAULT_PRIORS,
        decay: float = 0.9,
        prior_weight: float = 2.0,
        optimism: float = 1.0,
    ) -> None:
        if not 0.0 < decay <= 1.0 or prior_weight <= 0.0 or optimism < 0.0:
            raise ValueError("need 0 < decay <= 1, prior_weight > 0 and optimism >= 0")
        self.priors = dict(priors)
        self.decay = decay
        self.prior_weight = prior_weight
        self.optimism = optimism
        self._state: dict[str, tuple[str, float, float]] = {}  # id -> (method, accepted, trials)

    def observe(
        self, request_id: str, method: str, num_draft_tokens: int, num_accepted: int
    ) -> None:
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} drafts")
        if num_draft_tokens == 0:
            return
        _, accepted, trials = self._state.get(request_id, (method, 0.0, 0.0))
        is_rejected = num_accepted < num_draft_tokens
        accepted = self.decay * accepted + num_accepted
        trials = self.decay * trials + num_accepted + is_rejected
        self._state[request_id] = (method, accepted, trials)

    def alpha(self, request_id: str, method: str) -> float:
        """The estimate for a request; its method's prior when it has no history yet."""
        prior = self.priors[method]
        _, accepted, trials = self._state.get(request_id, (method, 0.0, 0.0))
        return (accepted + self.prior_weight * prior) / (trials + self.prior_weight)

    def upper_bound(self, request_id: str, method: str) -> float:
        """alpha plus `optimism` standard errors of it, its trials counting the prior's: what
        the policy decides by (see the class docstring)."""
        _, _, trials = self._state.get(request_id, (method, 0.0, 0.0))
        alpha = self.alpha(request_id, method)
        error = math.sqrt(alpha * (1.0 - alpha) / (trials + self.prior_weight))
        return min(1.0, alpha + self.optimism * error)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)


@dataclass(frozen=True)
class Allocation:
    """Draft lengths for one step, a reason per request, and the goodput they were chosen for."""

    num_draft_tokens: tuple[int, ...]
    reasons: tuple[Reason, ...]
    goodput: float  # predicted tokens per second of the step

    def __post_init__(self) -> None:
        assert len(self.num_draft_tokens) == len(self.reasons)
        for k, reason in zip(self.num_draft_tokens, self.reasons, strict=True):
            assert (k > 0) == (reason == "speculating"), (k, reason)


DraftCost = float | Callable[[int], float]  # seconds per draft token, or f(total draft tokens)


def goodput(
    alphas: Sequence[float],
    ks: Sequence[int],
    base_tokens: int,
    context: int,
    model: StepTimePredictor,
    draft_cost: DraftCost,
) -> float:
    """Predicted tokens per second of a step that verifies ks on top of base_tokens."""
    num_drafts = sum(ks)
    seconds = model.predict(base_tokens + num_drafts, context) + _draft_seconds(
        draft_cost, num_drafts
    )
    tokens = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
    return tokens / seconds if seconds > 0 else math.inf


def allocate_draft_lengths(
    alphas: Sequence[float],
    caps: Sequence[int],
    base_tokens: int,
    context: int,
    model: StepTimePredictor,
    draft_cost: DraftCost = 0.0,
    cap_reasons: Sequence[Reason | None] | None = None,
    max_num_draft_tokens: int | None = None,
) -> Allocation:
    """Choose k_i in 0..caps[i] per decoding request to maximise the step's predicted goodput.

    base_tokens counts the step's tokens without drafts (one per decoding request plus prefill
    chunks). Greedy marginal allocation: one draft token at a time goes to the request whose next
    token is likeliest to be accepted (E(alpha, k+1) - E(alpha, k) = alpha^(k+1)); because step
    time depends only on the total, that is also the best goodput increment. The walk goes on
    past a token that lowers goodput (a concave curve can rise again) until no later prefix can
    win, and the best prefix is kept. draft_cost, when callable, must be non-decreasing.

    A cap of 0 comes with its reason in cap_reasons (request_opt_out, batch_size, utilization).
    A request with a positive cap left at 0 is compute_bound when it would speculate alone in
    this step (one decode token at this context), so the batch's load switched it off; otherwise
    its acceptance is too low to pay for even a free verify slot: low_acceptance.
    """
    if len(alphas) != len(caps):
        raise ValueError("alphas and caps differ in length")
    ks = _greedy(alphas, caps, base_tokens, context, model, draft_cost, max_num_draft_tokens)
    reasons = [
        _reason(i, k, alphas, caps, cap_reasons, context, model, draft_cost)
        for i, k in enumerate(ks)
    ]
    value = goodput(alphas, ks, base_tokens, context, model, draft_cost)
    return Allocation(tuple(ks), tuple(reasons), value)


def best_goodput(
    alphas: Sequence[float],
    caps: Sequence[int],
    base_tokens: int,
    context: int,
    model: StepTimePredictor,
    draft_cost: DraftCost = 0.0,
    max_num_draft_tokens: int | None = None,
) -> float:
    """The goodput allocate_draft_lengths would reach, without working out reasons (cheap)."""
    ks = _greedy(alphas, caps, base_tokens, context, model, draft_cost, max_num_draft_tokens)
    return goodput(alphas, ks, base_tokens, context, model, draft_cost)


def _greedy(
    alphas: Sequence[float],
    caps: Sequence[int],
    base_tokens: int,
    context: int,
    model: StepTimePredictor,
    draft_cost: DraftCost,
    max_num_draft_tokens: int | None,
) -> list[int]:
    heap = [
        (-a, 0, i) for i, (a, cap) in enumerate(zip(alphas, caps, strict=True)) if cap > 0 and a > 0
    ]
    heapq.heapify(heap)
    # Upper bound on tokens any later prefix can add: every remaining draft accepted as expected.
    tail = sum(expected_tokens(alphas[i], caps[i]) - 1.0 for _, _, i in heap)
    tokens = float(len(alphas))
    best, best_len, picks = -math.inf, 0, list[int]()
    limit = max_num_draft_tokens if max_num_draft_tokens is not None else math.inf
    while True:
        seconds = model.predict(base_tokens + len(picks), context)
        seconds += _draft_seconds(draft_cost, len(picks))
        value = tokens / seconds if seconds > 0 else math.inf
        if value > best:
            best, best_len = value, len(picks)
        # Step time never falls as drafts are added, so this bounds every longer prefix.
        if not heap or len(picks) >= limit or (tokens + tail) / seconds <= best:
            break
        neg_gain, k, i = heapq.heappop(heap)
        picks.append(i)
        tokens -= neg_gain
        tail += neg_gain
        if k + 1 < caps[i]:
            heapq.heappush(heap, (-(alphas[i] ** (k + 2)), k + 1, i))
    ks = [0] * len(alphas)
    for i in picks[:best_len]:
        ks[i] += 1
    return ks


def _reason(
    i: int,
    k: int,
    alphas: Sequence[float],
    caps: Sequence[int],
    cap_reasons: Sequence[Reason | None] | None,
    context: int,
    model: StepTimePredictor,
    draft_cost: DraftCost,
) -> Reason:
    if k > 0:
        return "speculating"
    if caps[i] <= 0:
        reason = cap_reasons[i] if cap_reasons is not None else None
        if reason not in CAP_REASONS:
            raise ValueError(f"request {i} has cap 0 without a reason from {sorted(CAP_REASONS)}")
        return reason  # type: ignore[return-value]
    alone = _greedy([alphas[i]], [caps[i]], 1, context, model, draft_cost, None)
    return "compute_bound" if alone[0] > 0 else "low_acceptance"


def _draft_seconds(draft_cost: DraftCost, num_draft_tokens: int) -> float:
    if callable(draft_cost):
        return float(draft_cost(num_draft_tokens))
    return draft_cost * num_draft_tokens


class Hysteresis:
    """Keeps each request's last on/off decision unless switching gains more than `margin`.

    Around the break-even point the estimates wobble step to step, and every switch has a cost
    the goodput model does not see (a draft model catching up, a cold n-gram index). A switch is
    taken only when the step's predicted goodput with it beats the goodput without it by the
    margin; staying on keeps the request's previous k (within its cap). Caps of 0 are never held
    back: operator limits and opt-outs act at once.
    """

    def __init__(self, margin: float = 0.03) -> None:
        self.margin = margin
        self._last_k: dict[str, int] = {}

    def allocate(
        self,
        request_ids: Sequence[str],
        alphas: Sequence[float],
        caps: Sequence[int],
        base_tokens: int,
        context: int,
        model: StepTimePredictor,
        draft_cost: DraftCost = 0.0,
        cap_reasons: Sequence[Reason | None] | None = None,
        max_num_draft_tokens: int | None = None,
    ) -> Allocation:
        """allocate_draft_lengths, then hold back the switches that do not clear the margin."""
        proposed = allocate_draft_lengths(
            alphas, caps, base_tokens, context, model, draft_cost, cap_reasons, max_num_draft_tokens
        )
        ks = list(proposed.num_draft_tokens)
        reasons = list(proposed.reasons)
        limit = max_num_draft_tokens if max_num_draft_tokens is not None else math.inf
        for i, request_id in enumerate(request_ids):
            last = self._last_k.get(request_id)
            if last is None or caps[i] <= 0 or (last > 0) == (ks[i] > 0):
                continue
            held = min(last, caps[i])
            if ks[i] == 0 and sum(ks) + held > limit:
                continue
            other = [*ks[:i], held, *ks[i + 1 :]]
            now = goodput(alphas, ks, base_tokens, context, model, draft_cost)
            before = goodput(alphas, other, base_tokens, context, model, draft_cost)
            if now <= before * (1.0 + self.margin):
                reasons[i] = (
                    "speculating"
                    if held > 0
                    else _reason(i, 0, alphas, caps, cap_reasons, context, model, draft_cost)
                )
                ks[i] = held
        self._last_k.update(zip(request_ids, ks, strict=True))
        value = goodput(alphas, ks, base_tokens, context, model, draft_cost)
        return Allocation(tuple(ks), tuple(reasons), value)

    def forget(self, request_id: str) -> None:
        self._last_k.pop(request_id, None)
