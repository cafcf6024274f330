"""Start-up calibration of the step-time model t(n, context, rows), cached per model and device.

A step of n query tokens is timed at a grid of n (1 up to the token budget) with a short
context, and at a few n with a long one for the context slope, each in the shape a served step of
n tokens has (`served_query_lens`): n decode rows while n sequences may share a step, verify
chunks of 1 + K tokens while they fit the sequence budget, one prompt chunk past that. The step
goes through runner.forward like a served one, so on a GPU it takes the path served steps take:
decode and verify shapes replay the CUDA graph a served step of that size replays, a step too big
for a graph runs eagerly like a served one. A grid point computes one logits row (the last
sequence's last token: the same captured body, only the eager LM head is smaller), so v(n) is the
one-row cost; batches shaped like verify steps (sequences of 1 + K tokens, a logits row for every
token, the same graphs) then give the cost of a logits row beyond the first. The KV the forwards
attend to is whatever the borrowed blocks hold: timing does not depend on its values. One warm-up
forward runs first; each point is the minimum of `repeats` timings (the least disturbed by other
work), and t(1) is timed again after each stage, so its minimum is taken over moments spread
through the whole calibration.

The fit is cached as JSON under <cache root>/calibration/, keyed by the model directory, device
(for a CPU its model name, threads and our kernels' build and instruction sets: a fit taken on
another CPU or with other kernels is not this machine's), dtype, quantisation, torch version, the
grid and what decides the path and shape of the timed steps (attention backend, enforce_eager,
the captured CUDA graphs, max_num_seqs and K: a fit taken eagerly is not the graphs' fit), so
only the first start on a machine pays for it (a few seconds for a 1.5B model on CPU);
SPECSERVE_CALIBRATION_CACHE=0 turns the cache off. Online refinement (StepTimeModel.observe)
starts from it.

A fit timed while another job held the machine must not mislead every later start, so:
- A calibration is not cached when its t(1) timings spread (median over minimum above
  QUIET_SPREAD: other work disturbed at least half of them), nor when its curve is flat
  (`is_plausible`). That start still uses it; the next one calibrates again.
- A steady load inflates every timing alike and shows no spread, so every fit in the cache
  (loaded, or measured now and written) is on probation (cached_fit.CachedFit): the median of the
  first served decode-shaped steps confirms it, or, when the fit over-predicts them by more than
  the margin, shows it was taken under load. Then it is rescaled in place to the served steps
  (the policy's next decision uses it; no forward is timed again while serving, which would stall
  every running request) and removed from the cache, so the next start calibrates again. Steps
  slower than the fit mean the machine is busy now: the fit and its file are kept.
The log says which fit a start uses ("cached fit from <path> (taken <date>)" or "measured now")
and what the served steps made of it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.chunks import SeqChunk, attention_reads
from engine.execution.graph_buckets import verify_query_len
from engine.execution.runner import ModelRunner
from engine.policy.step_time import StepTimeModel, pool_adjacent_violators
from engine.scheduling.block_manager import BlockManager

logger = logging.getLogger(__name__)

_CALIBRATION_ID = "__calibration__"
_BASE_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 64, 128, 256, 512)
_LONG_CONTEXT_NS = (1, 4, 8)
# ... and on a device that attends in parallel (CUDA), at larger steps too (cheap there).
_PARALLEL_CONTEXT_NS = (32, 128, 512)
# Sequences in the verify-shaped batches (of 1 + K tokens each) that price a logits row.
_VERIFY_NUM_SEQS = (1, 4, 8)
# A calibration whose t(1) timings have a median above this factor of their minimum was disturbed
# for at least half of them (a quiet machine repeats a forward within a few per cent): not cached.
QUIET_SPREAD = 1.3


def calibration_grid(max_num_batched_tokens: int, max_query_len: int = 1) -> list[int]:
    """The n to time: the base grid and every n up to max_query_len (1 + K: each size a verify
    step of one request can have, timed rather than interpolated; where a row past a kernel's
    tile starts a second pass over the weights, the grid's 4 and 8 would not show it) below the
    budget, and the budget itself."""
    small = set(range(1, max_query_len + 1))
    grid = sorted(n for n in small.union(_BASE_GRID) if n < max_num_batched_tokens)
    return [*grid, max_num_batched_tokens]


def served_query_lens(n: int, max_num_seqs: int, max_query_len: int) -> list[int]:
    """The query lengths of the sequences in a served step of n tokens: n decode rows while n
    sequences fit in a step, else verify chunks of max_query_len tokens (the last one shorter)
    while they fit, else one prompt chunk (a step that big carries one)."""
    if n <= max_num_seqs:
        return [1] * n
    num_full, rest = divmod(n, max_query_len)
    if max_query_len > 1 and num_full + (rest > 0) <= max_num_seqs:
        return [max_query_len] * num_full + ([rest] if rest else [])
    return [n]


def time_step(
    runner: ModelRunner,
    block_manager: BlockManager,
    query_lens: list[int],
    context: int,
    repeats: int,
    every_row: bool = False,
) -> float:
    """Minimum seconds of `repeats` forwards over one sequence per query length, each after
    `context` cached positions, through runner.forward as a served step goes (so a runner with
    CUDA graphs replays one where it would for the served step). One logits row (the last
    token's), or with `every_row` one per token as a verify step scores them. Borrows blocks and
    returns them."""
    ids = [f"{_CALIBRATION_ID}{i}" for i in range(len(query_lens))]
    try:
        chunks = []
        for i, (seq_id, n) in enumerate(zip(ids, query_lens, strict=True)):
            if not block_manager.allocate_slots(seq_id, context + n):
                raise RuntimeError("calibration needs more KV slots; the pool is too small")
            table = block_manager.get_block_table(seq_id)
            num_logits = n if every_row else int(i == len(ids) - 1)
            chunks.append(SeqChunk([0] * n, context, table, num_logits))
        best = float("inf")
        for _ in range(repeats):
            start = runner.device.now()
            runner.forward(chunks)
            best = min(best, runner.device.now() - start)
        return best
    finally:
        for seq_id in ids:
            block_manager.free(seq_id)


def time_forward(
    runner: ModelRunner, block_manager: BlockManager, n: int, context: int, repeats: int
) -> float:
    """Minimum seconds of `repeats` forwards of ONE chunk of n tokens after `context` cached
    positions, one logits row: a draft model's catch-up, which is served in that shape."""
    return time_step(runner, block_manager, [n], context, repeats)


def time_verify_batch(
    runner: ModelRunner, block_manager: BlockManager, num_seqs: int, num_tokens: int
) -> float:
    """Seconds of one forward over num_seqs sequences of num_tokens each, every token with its
    logits row (a verify step's shape)."""
    return time_step(runner, block_manager, [num_tokens] * num_seqs, 0, 1, every_row=True)


@dataclass(frozen=True)
class Calibration:
    """A fit and every timing of t(1) it was taken with (the grid's passes and one after each
    stage)."""

    model: StepTimeModel
    t1_seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.t1_seconds:
            raise ValueError("a calibration times t(1) at least once")

    @property
    def spread(self) -> float:
        """The median of the t(1) timings over their minimum: 1 on a quiet machine."""
        low = min(self.t1_seconds)
        return statistics.median(self.t1_seconds) / low if low > 0 else 1.0

    @property
    def is_quiet(self) -> bool:
        return self.spread <= QUIET_SPREAD


def measure(
    runner: ModelRunner,
    block_manager: BlockManager,
    max_num_batched_tokens: int,
    max_model_len: int,
    repeats: int = 2,
    timer: Callable[[int, int], float] | None = None,
    batch_timer: Callable[[int, int], float] | None = None,
) -> Calibration:
    """Time the grid and fit t(n, context, rows); t(1) is timed again after each stage, and the
    fit takes the least of its timings. `timer(n, context)` (a served step of n tokens, shaped
    by `served_query_lens`, each sequence after `context` cached positions, one logits row) and
    `batch_timer(num_seqs, num_tokens)` replace real forwards (tests); with a timer and no
    batch_timer the row cost is left at 0."""
    max_query_len = verify_query_len(runner.config)
    grid = calibration_grid(min(max_num_batched_tokens, max_model_len), max_query_len)
    # A served step holds a block per sequence at least: no more sequences than the pool has.
    max_num_seqs = min(runner.config.max_num_seqs, block_manager.num_blocks)

    def shape(n: int) -> list[int]:
        return served_query_lens(n, max_num_seqs, max_query_len)

    # A GPU attends to a step's queries in parallel, so its slope per KV read falls as queries
    # join the step: there it is timed at larger steps too, and kept per query count. The CPU's
    # attention reads every query's keys in turn: one slope serves every n.
    parallel = runner.device.is_cuda
    long_ns = _LONG_CONTEXT_NS + (_PARALLEL_CONTEXT_NS if parallel else ())
    # Every sequence of the longest long-context step holds that context: half the pool at most.
    num_long_seqs = max(len(shape(n)) for n in long_ns)
    long_context = min(
        max_model_len // 2,
        2048,
        block_manager.num_blocks * block_manager.block_size // (2 * num_long_seqs),
    )
    if timer is None:

        def timer(n: int, context: int) -> float:
            return time_step(runner, block_manager, shape(n), context, 1)

        timer(1, 0)  # warm-up: first-call allocations and kernel selection

        def batch_timer(num_seqs: int, num_tokens: int) -> float:
            return time_verify_batch(runner, block_manager, num_seqs, num_tokens)

    t1_seconds: list[float] = []  # every timing of t(1) without context but the warm-up

    def timed(n: int, context: int) -> float:
        seconds = timer(n, context)
        if n == 1 and context == 0:
            t1_seconds.append(seconds)
        return seconds

    # Passes over the grid, keeping each point's minimum: a burst of other work on the machine
    # then spoils one timing of a point, not a whole region of the curve. t(1) is timed again
    # after each stage, so that its timings span the calibration.
    short = {n: timed(n, 0) for n in grid}
    timed(1, 0)
    for _ in range(repeats - 1):
        for n in grid:
            short[n] = min(short[n], timed(n, 0))
        timed(1, 0)
    context_coef = 0.0
    context_grid: list[int] | None = None
    context_coefs: list[float] | None = None
    ns = [n for n in long_ns if n in short]
    if ns and long_context > 0 and long_context + max(ns) <= max_model_len:
        # The model's context is the attention's KV reads, the queries' own positions included,
        # so the slope comes from the same n at two contexts (the grid alone cannot separate
        # them): n query tokens over L more cached positions read n * L more, in any shape.
        slopes = [
            (min(timed(n, long_context), timed(n, long_context)) - short[n]) / (n * long_context)
            for n in ns
        ]
        context_coef = max(0.0, sorted(slopes)[len(slopes) // 2])
        if parallel:
            # Non-increasing in n (more queries share the keys' cost), never below 0.
            falling = pool_adjacent_violators([-max(0.0, x) for x in slopes], [1.0] * len(ns))
            context_grid, context_coefs = ns, [-x for x in falling]
    timed(1, 0)
    short[1] = min(t1_seconds)  # the grid starts at 1
    values = pool_adjacent_violators([short[n] for n in grid], [1.0] * len(grid))
    reads = [_reads(shape(n)) for n in grid]  # in v already: the context term prices the rest
    model = StepTimeModel(
        grid,
        values,
        context_coef,
        base_reads=reads,
        context_grid=context_grid,
        context_coefs=context_coefs,
    )
    if batch_timer is not None:
        shapes = [(s, max_query_len) for s in _VERIFY_NUM_SEQS if s <= max_num_seqs]
        model.row_coef = _row_cost(model, batch_timer, repeats, grid[-1], shapes)
    return Calibration(model, tuple(t1_seconds))


def _reads(query_lens: list[int]) -> int:
    """KV positions a step of these sequences reads without context."""
    return sum(attention_reads(0, n) for n in query_lens)


def _row_cost(
    model: StepTimeModel,
    batch_timer: Callable[[int, int], float],
    repeats: int,
    max_n: int,
    shapes: list[tuple[int, int]],
) -> float:
    """The median over verify-shaped batches (sequences, tokens each) of what they took beyond
    the one-row model, per extra row."""
    costs = []
    for num_seqs, num_tokens in shapes:
        n = num_seqs * num_tokens
        if n > max_n or n < 2:
            continue
        seconds = min(batch_timer(num_seqs, num_tokens) for _ in range(repeats))
        reads = num_seqs * attention_reads(0, num_tokens)
        costs.append((seconds - model.predict(n, reads)) / (n - 1))
    return max(0.0, sorted(costs)[len(costs) // 2]) if costs else 0.0
