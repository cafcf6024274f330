"""Calibration times steps on the path served steps take (issue 33, F3).

On a GPU a served decode or verify step replays a CUDA graph, while a step with a long prompt
chunk runs eagerly, launch-bound and several times slower at a few tokens. A calibration that
timed n tokens as one prompt chunk fitted the eager path, and the verify batches it priced rows
with (which do replay graphs) then came out cheaper than the one-row curve: the row cost clamped
to 0. Here a fake runner decides each forward's path with the graphs' own bucket rule
(engine.execution.graph_buckets.choose_bucket over the sizes make_cuda_graphs would capture for the config)
and advances a scripted clock by that path's cost, so the tests see which path every timed step
took and what the fit makes of it. No wall clock is read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from engine.core.chunks import SeqChunk, attention_reads
from engine.execution.graph_buckets import choose_bucket, graph_sizes, verify_query_len
from engine.policy import calibration, calibration_cache
from engine.policy.calibration import calibration_grid, measure
from engine.policy.step_time import StepTimeModel
from engine.scheduling.block_manager import BlockManager
from engine.speculative_config import SpeculativeConfig

MAX_NUM_SEQS = 8
NUM_DRAFTS = 3  # verify chunks of 4 tokens
BUDGET = 64  # max_num_batched_tokens
MAX_MODEL_LEN = 4096

# The scripted device: a replayed graph pays a small fixed cost and its padded token count; an
# eager step pays the Python launches of every layer (far more at a few tokens) and its tokens.
# Both pay the eager LM head per logits row and the attention per KV position read.
GRAPH_BASE, GRAPH_PER_TOKEN = 0.004, 1e-4
EAGER_BASE, EAGER_PER_TOKEN = 0.020, 2e-4
PER_ROW = 3e-4
PER_READ = 1e-8


def _config() -> SimpleNamespace:
    spec = SpeculativeConfig("ngram", num_speculative_tokens=NUM_DRAFTS)
    return SimpleNamespace(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        speculative_config=spec,
        enforce_eager=False,
    )


SIZES = graph_sizes(_config(), verify_query_len(_config()))  # what the target would capture
CAPTURED_TOKENS = max(max(s) for s in SIZES.values())


class ScriptedClock:
    """Device.now(): the seconds the forwards so far took."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.is_cuda = False  # the CPU's attention: one context slope for every n

    def now(self) -> float:
        return self.seconds


class GraphedRunner:
    """Runs nothing: each forward records its chunks and whether a captured graph holds it, and
    advances the clock by that path's cost."""

    def __init__(self) -> None:
        self.config = _config()
        self.device = ScriptedClock()
        self.graphs = SimpleNamespace(buckets=())
        self.steps: list[tuple[list[SeqChunk], bool]] = []  # (chunks, replayed a graph)

    def forward(self, chunks: Sequence[SeqChunk]) -> None:
        bucket = choose_bucket(SIZES, MAX_MODEL_LEN, chunks)
        self.steps.append((list(chunks), bucket is not None))
        self.device.seconds += _cost(chunks, None if bucket is None else bucket.num_tokens)


def _cost(chunks: Sequence[SeqChunk], padded_tokens: int | None) -> float:
    """Seconds of a step on the scripted device (padded_tokens: the graph's, None: eager)."""
    num_tokens = sum(len(c.token_ids) for c in chunks)
    rows = sum(c.num_logits for c in chunks)
    reads = sum(attention_reads(c.start, len(c.token_ids)) for c in chunks)
    if padded_tokens is None:
        body = EAGER_BASE + EAGER_PER_TOKEN * num_tokens
    else:
        body = GRAPH_BASE + GRAPH_PER_TOKEN * padded_tokens
    return body + PER_ROW * rows + PER_READ * reads


def _served_step(query_lens: list[int], context: int) -> float:
    """What a served decode/verify step of these sequences (every token scored) costs."""
    chunks = [SeqChunk([0] * q, context, [0], q) for q in query_lens]
    bucket = choose_bucket(SIZES, MAX_MODEL_LEN, chunks)
    assert bucket is not None  # served decode/verify steps of this size replay a graph
    return _cost(chunks, bucket.num_tokens)


def _calibrate() -> tuple[GraphedRunner, SimpleNamespace]:
    runner = GraphedRunner()
    blocks = BlockManager(num_blocks=128, block_size=16)
    model = measure(runner, blocks, BUDGET, MAX_MODEL_LEN, repeats=1).model  # type: ignore[arg-type]
    assert blocks.num_used_blocks == 0  # every borrowed block returned
    return runner, model


def test_served_shapes_are_decode_rows_then_verify_chunks_then_a_prompt_chunk():
    served_query_lens = calibration.served_query_lens
    assert served_query_lens(5, 8, 4) == [1] * 5
    assert served_query_lens(8, 8, 4) == [1] * 8
    assert served_query_lens(12, 8, 4) == [4, 4, 4]
    assert served_query_lens(14, 8, 4) == [4, 4, 4, 2]
    assert served_query_lens(32, 8, 4) == [4] * 8
    assert served_query_lens(33, 8, 4) == [33]  # 9 sequences: a step this big has a prompt
    assert served_query_lens(9, 8, 1) == [9]  # no drafts: no verify chunks


def test_every_timed_step_takes_the_path_its_served_shape_takes():
    """Each grid point up to the largest captured step is timed as decode rows (n up to
    max_num_seqs) or verify chunks, and replays a graph, as served steps of that size do; only
    steps too big for every graph run eagerly, as served ones (which carry a prompt chunk) do.
    The verify batches that price a logits row are verify steps of 1 + K tokens a sequence.
    Timing n tokens as one prompt chunk (the issue) ran every n >= 2 eagerly."""
    runner, _ = _calibrate()
    timed_sizes = set()
    for chunks, replayed in runner.steps:
        n, rows = sum(len(c.token_ids) for c in chunks), sum(c.num_logits for c in chunks)
        if rows > 1:  # a verify batch, pricing rows: every token scored
            assert rows == n and all(len(c.token_ids) == 1 + NUM_DRAFTS for c in chunks)
        else:  # a grid point: one logits row
            assert rows == 1
            timed_sizes.add(n)
            if n <= MAX_NUM_SEQS:
                assert all(len(c.token_ids) == 1 for c in chunks), f"{n} tokens not decode rows"
        if n <= CAPTURED_TOKENS:
            assert replayed, f"a step of {n} tokens ran eagerly; served ones replay a graph"
            assert all(len(c.token_ids) <= 1 + NUM_DRAFTS for c in chunks)
        else:
            assert not replayed and len(chunks) == 1
    grid = calibration_grid(BUDGET, 1 + NUM_DRAFTS)
    assert set(range(1, 2 + NUM_DRAFTS)) <= set(grid) <= timed_sizes  # every verify size timed
    eager_sizes = {n for n in timed_sizes if n > CAPTURED_TOKENS}
    assert eager_sizes == {n for n in grid if n > CAPTURED_TOKENS}


def test_the_fit_prices_served_steps_as_they_replay():
    """The fit predicts served decode and verify steps (every token a logits row) at what the
    replayed graphs cost, and the row cost is the head's: before, the eager one-row curve made
    the replayed verify batches look cheaper than one row, and the row cost clamped to 0."""
    _, model = _calibrate()
    assert model.row_coef == pytest.approx(PER_ROW, rel=1e-6)
    assert model.context_coef == pytest.approx(PER_READ, rel=1e-6)
    for num_seqs, query_len, context in [(1, 1, 0), (4, 1, 0), (8, 1, 500), (4, 4, 0), (8, 4, 60)]:
        n = num_seqs * query_len
        reads = num_seqs * attention_reads(context, query_len)
        seconds = _served_step([query_len] * num_seqs, context)
        assert model.predict(n, reads, n) == pytest.approx(seconds, rel=1e-6), (num_seqs, context)
    # Past the graphs, a step with a prompt chunk: the eager one-row chunk it was timed as.
    assert model.predict(BUDGET, attention_reads(0, BUDGET)) == pytest.approx(
        _cost([SeqChunk([0] * BUDGET, 0, [0], 1)], None), rel=1e-6
    )


def _parallel_runner(per_key: float, is_cuda: bool) -> GraphedRunner:
    """The scripted device, but attending as a GPU does: every query at once, so a step's
    attention costs its longest row's keys, not the sum of every row's."""

    class ParallelRunner(GraphedRunner):
        def forward(self, chunks: Sequence[SeqChunk]) -> None:
            bucket = choose_bucket(SIZES, MAX_MODEL_LEN, chunks)
            self.steps.append((list(chunks), bucket is not None))
            self.device.seconds += _parallel_cost(chunks, bucket, per_key)

    runner = ParallelRunner()
    runner.device.is_cuda = is_cuda
    return runner


def _parallel_cost(chunks: Sequence[SeqChunk], bucket, per_key: float) -> float:
    serial = _cost(chunks, None if bucket is None else bucket.num_tokens)
    reads = sum(attention_reads(c.start, len(c.token_ids)) for c in chunks)
    longest = max(c.start + len(c.token_ids) for c in chunks)
    return serial - PER_READ * reads + per_key * longest


def test_a_gpu_prices_context_per_query_count():
    """On a CUDA device the context slope is timed at several step sizes and kept per query
    count, so decode and verify steps over a long context are priced as a device that attends
    in parallel runs them: a verify step's extra queries read their keys beside the others, not
    after them. (One slope, timed on a few queries, priced a 4-token verify at 1,000 cached
    positions 28% over a decode step on an H200.) The CPU keeps one slope for every n."""
    per_key = 1e-6
    runner = _parallel_runner(per_key, is_cuda=True)
    blocks = BlockManager(num_blocks=600, block_size=16)
    model = measure(runner, blocks, MAX_MODEL_LEN, MAX_MODEL_LEN, repeats=1).model  # type: ignore[arg-type]
    assert model.context_grid is not None and len(model.context_grid) >= 4
    assert model.context_coefs == sorted(model.context_coefs, reverse=True)
    for num_seqs, query_len, context in [(1, 1, 1000), (8, 1, 1000), (1, 4, 1000), (8, 4, 700)]:
        chunks = [SeqChunk([0] * query_len, context, [0], query_len) for _ in range(num_seqs)]
        bucket = choose_bucket(SIZES, MAX_MODEL_LEN, chunks)
        seconds = _parallel_cost(chunks, bucket, per_key)
        n = num_seqs * query_len
        reads = num_seqs * attention_reads(context, query_len)
        assert model.predict(n, reads, n) == pytest.approx(seconds, rel=0.02), (num_seqs, context)
    restored = StepTimeModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert restored.predict(32, 8 * attention_reads(700, 4), 32) == model.predict(
        32, 8 * attention_reads(700, 4), 32
    )

    serial = _parallel_runner(per_key, is_cuda=False)
    blocks = BlockManager(num_blocks=600, block_size=16)
    cpu = measure(serial, blocks, MAX_MODEL_LEN, MAX_MODEL_LEN, repeats=1).model  # type: ignore[arg-type]
    assert cpu.context_grid is None and cpu.context_coefs is None
    long_steps = [sum(len(c.token_ids) for c in chunks) for chunks, _ in serial.steps
                  if chunks[0].start > 0 and sum(c.num_logits for c in chunks) == 1]  # fmt: skip
    assert long_steps and max(long_steps) <= 8  # no larger step timed at a long context
    long_steps = [sum(len(c.token_ids) for c in chunks) for chunks, _ in runner.steps
                  if chunks[0].start > 0 and sum(c.num_logits for c in chunks) == 1]  # fmt: skip
    assert max(long_steps) == 512


def test_a_device_that_attends_in_parallel_keeps_every_timing_in_the_fit():
    """On a GPU a step's queries attend at once: a step costs its longest row's keys, not the sum
    of every row's. A slope timed on a few decode queries at a long context then prices a
    4,096-token prompt chunk's 8 million own reads far above what the chunk took; subtracting
    them from the grid drove the values below zero (an H200 logged t(1) = 0.0 ms and
    t(4096) = 0.0 ms), and every price the policy read was wrong. Each grid point now keeps its
    timing, and only reads beyond its own shape's are priced at the slope."""
    per_key = 1e-6
    budget = MAX_MODEL_LEN

    class ParallelRunner(GraphedRunner):
        def forward(self, chunks: Sequence[SeqChunk]) -> None:
            bucket = choose_bucket(SIZES, MAX_MODEL_LEN, chunks)
            self.steps.append((list(chunks), bucket is not None))
            serial = _cost(chunks, None if bucket is None else bucket.num_tokens)
            reads = sum(attention_reads(c.start, len(c.token_ids)) for c in chunks)
            longest = max(c.start + len(c.token_ids) for c in chunks)
            self.device.seconds += serial - PER_READ * reads + per_key * longest

    runner = ParallelRunner()
    blocks = BlockManager(num_blocks=600, block_size=16)
    model = measure(runner, blocks, budget, MAX_MODEL_LEN, repeats=1).model  # type: ignore[arg-type]
    timed = {}  # grid point -> (its shape's own reads, what its one-row step took)
    for chunks, replayed in runner.steps:
        n = sum(len(c.token_ids) for c in chunks)
        if all(c.start == 0 for c in chunks) and sum(c.num_logits for c in chunks) == 1:
            reads = sum(attention_reads(0, len(c.token_ids)) for c in chunks)
            longest = max(len(c.token_ids) for c in chunks)
            body = _cost(chunks, None) if not replayed else None
            if body is None:
                bucket = choose_bucket(SIZES, MAX_MODEL_LEN, chunks)
                body = _cost(chunks, bucket.num_tokens)
            timed[n] = (reads, body - PER_READ * reads + per_key * longest)
    assert model.grid[-1] == budget and set(model.grid) <= set(timed)
    assert model.context_coef > 0.0
    for n in model.grid:
        reads, seconds = timed[n]
        assert model.predict(n, reads) == pytest.approx(seconds, rel=1e-6), n
    assert model.predict(1) == pytest.approx(GRAPH_BASE + GRAPH_PER_TOKEN + PER_ROW + per_key)
    # A decode step still pays for its context: more cached positions, a dearer step.
    assert model.predict(8, 8 * attention_reads(1000, 1)) > model.predict(8, 8 * 1)
    assert calibration_cache.is_plausible(model)
