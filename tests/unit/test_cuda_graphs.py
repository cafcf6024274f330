"""CUDA graphs for decode/verify steps, checked on CPU with the CUDA pieces faked
(tests/unit/cuda_graph_fakes.py). The graph path runs the real padding, static metadata and
replay logic, and must give the logits and K/V the eager torch-backend forward gives; padding
writes only the pad block; a step takes the smallest bucket that holds it and runs eagerly where
none does; capture goes largest first; and the draft model's first forward of a step replays a
captured graph, whose buckets stay within the memory plan.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.attention.flash_attn import FlashAttentionBackend
from engine.attention.torch_attn import TorchAttentionBackend
from engine.core.chunks import SeqChunk
from engine.execution import graph_buckets
from engine.execution.cuda_graphs import NOT_CAPTURED, CudaGraphs, make_cuda_graphs
from engine.execution.graph_buckets import MAX_CAPTURE_TOKENS, Bucket
from engine.execution.runner import ModelRunner
from tests.unit.cuda_graph_fakes import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    FakeCaptureDevice,
    FakeCudaDevice,
    _config,
    _runner,
    reference_varlen,
)


def eager(runner: SimpleNamespace, chunks: list[SeqChunk]) -> torch.Tensor:
    return ModelRunner.forward(runner, chunks)  # type: ignore[arg-type]


SIZES = {1: (1, 2, 4, 8), 5: (2, 4, 8, 16)}  # decode graphs; verify graphs, up to 4 drafts


@pytest.fixture
def pair(model_parts):
    """(eager torch-backend runner, graph runner with its CudaGraphs) over the same prefilled KV:
    three sequences, one of them crossing a block boundary when it grows."""
    ref = _runner(model_parts, TorchAttentionBackend(), NUM_BLOCKS)
    graphed = _runner(model_parts, FlashAttentionBackend(reference_varlen), NUM_BLOCKS + 1)
    rng = random.Random(0)
    seqs = {"a": (250, [4, 1]), "b": (10, [3]), "c": (40, [5, 0])}  # context, blocks
    prompts = {}
    for name, (ctx_len, table) in seqs.items():
        prompt = [rng.randrange(3, 320) for _ in range(ctx_len)]
        eager(ref, [SeqChunk(prompt, 0, table, 1)])
        prompts[name] = (ctx_len, table)
    for (k, v), (k_ref, v_ref) in zip(graphed.kv_caches, ref.kv_caches, strict=True):
        k[:NUM_BLOCKS].copy_(k_ref)
        v[:NUM_BLOCKS].copy_(v_ref)
    capture = FakeCaptureDevice()
    graphs = CudaGraphs(graphed, SIZES, capture)
    return ref, graphed, graphs, capture, prompts


def _step(prompts, lens: dict[str, int], rng: random.Random) -> list[SeqChunk]:
    """One decode/verify step: `lens[name]` tokens for each named sequence, all with logits."""
    chunks = []
    for name, n in lens.items():
        start, table = prompts[name]
        chunks.append(SeqChunk([rng.randrange(3, 320) for _ in range(n)], start, table, n))
        prompts[name] = (start + n, table)
    return chunks


def _assert_same_kv(graphed, ref) -> None:
    """Every block a request owns holds the same K/V on both paths."""
    for (k, v), (k_ref, v_ref) in zip(graphed.kv_caches, ref.kv_caches, strict=True):
        torch.testing.assert_close(k[:NUM_BLOCKS], k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[:NUM_BLOCKS], v_ref, atol=1e-5, rtol=1e-5)


def test_replayed_steps_match_the_eager_forward(pair):
    ref, graphed, graphs, capture, prompts = pair
    rng = random.Random(1)
    steps = [
        {"a": 1, "b": 1, "c": 1},  # decode, padded 3 -> 4
        {"a": 1, "b": 3, "c": 5},  # ragged verify, 9 -> 16
        {"b": 2},  # one sequence verifying one draft, 2 -> 2
        {"a": 5, "c": 2},  # "a" crosses into its second block
        {"c": 1},  # decode, no padding
        {"a": 4, "b": 4, "c": 4},
    ]
    for lens in steps:
        chunks = _step(prompts, lens, rng)
        bucket = graphs.bucket(chunks)
        assert bucket is not None
        replays = sum(g.num_replays for g in capture.graphs)
        logits = graphs.forward(chunks)
        assert sum(g.num_replays for g in capture.graphs) == replays + 1
        expected = eager(ref, chunks)
        assert isinstance(logits, torch.Tensor)
        assert logits.shape == expected.shape == (sum(lens.values()), 320)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        _assert_same_kv(graphed, ref)


def test_padding_writes_only_the_pad_block(pair):
    ref, graphed, graphs, _, prompts = pair
    chunks = _step(prompts, {"a": 1, "b": 3, "c": 2}, random.Random(2))  # 6 tokens -> 8
    assert graphs.bucket(chunks) == Bucket(5, 8)
    before = [(k.clone(), v.clone()) for k, v in graphed.kv_caches]
    graphs.forward(chunks)
    eager(ref, chunks)
    _assert_same_kv(graphed, ref)
    bs = BLOCK_SIZE
    real = {
        c.block_table[p // bs] * bs + p % bs
        for c in chunks
        for p in range(c.start, c.start + len(c.token_ids))
    }
    for (k, v), (k0, v0) in zip(graphed.kv_caches, before, strict=True):
        for cache, old in ((k, k0), (v, v0)):
            changed = (cache != old).flatten(2).any(-1).flatten()  # [num_slots]
            changed_slots = set(changed.nonzero().flatten().tolist())
            assert real <= changed_slots  # every real slot was written
            assert all(s in real or s // bs == NUM_BLOCKS for s in changed_slots)


def test_bucket_is_the_smallest_that_holds_the_step(pair):
    _, _, graphs, _, prompts = pair
    rng = random.Random(3)

    def bucket(lens):
        return graphs.bucket(_step(dict(prompts), lens, rng))

    assert bucket({"a": 1}) == Bucket(1, 1)
    assert bucket({"a": 1, "b": 1, "c": 1}) == Bucket(1, 4)
    assert bucket({"a": 2}) == Bucket(5, 2)
    assert bucket({"a": 1, "b": 2}) == Bucket(5, 4)
    assert bucket({"a": 5, "b": 5, "c": 5}) == Bucket(5, 16)
    assert bucket({"a": 6}) is None  # a query longer than the verify graphs take
    assert graphs.buckets == tuple(Bucket(q, t) for q, s in SIZES.items() for t in s)


def test_steps_no_graph_holds_run_eagerly(pair):
    _, _, graphs, capture, prompts = pair
    start, table = prompts["a"]
    prompt_chunk = SeqChunk([7] * 6, start, table, 1)  # longer than the verify graphs' queries
    decode = SeqChunk([7], start, table, 1)
    assert graphs.forward([prompt_chunk]) is NOT_CAPTURED
    assert graphs.forward([decode, prompt_chunk]) is NOT_CAPTURED
    many = [SeqChunk([7] * 5, 0, [i % NUM_BLOCKS], 5) for i in range(4)]  # 20 tokens > 16
    assert graphs.forward(many) is NOT_CAPTURED
    too_long = SeqChunk([7], MAX_MODEL_LEN, [0, 1, 2], 1)  # past the longest context
    assert graphs.forward([too_long]) is NOT_CAPTURED
    assert graphs.forward([]) is NOT_CAPTURED
    assert sum(g.num_replays for g in capture.graphs) == 0
    # Of these, the steps a decode graph of their size exists for ran eagerly off the graphs:
    # the step-time model learns them apart (engine/policy/step_time.py).
    assert graphs.covers(7) and graphs.covers(16) and not graphs.covers(20)


def test_capture_is_largest_first_into_one_pool(pair):
    _, _, graphs, capture, _ = pair
    sizes = [g.out.shape[0] for g in capture.graphs]
    assert sizes == sorted(sizes, reverse=True)
    assert sorted(sizes) == sorted(t for s in SIZES.values() for t in s)


# ------------------------------------------------------------------ the draft model's first forward


def _engine_draft_max_query_len(num_speculative_tokens: int) -> int:
    """The max_query_len LLMEngine captures the draft runner's graphs with, read from its call
    in engine/build.py (building an engine captures no graph on a CPU)."""
    source = Path(__file__).parents[2] / "engine" / "build.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "allocate_kv_cache"
            and ast.unparse(node.func.value) == "draft_runner"
        ):
            (value,) = [k.value for k in node.keywords if k.arg == "max_query_len"]
            if isinstance(value, ast.Constant):
                return int(value.value)
            assert ast.unparse(value) == "draft_max_query_len(num_drafts)"
            return graph_buckets.draft_max_query_len(num_speculative_tokens)
    raise AssertionError("build.py allocates no draft KV cache")


def test_a_draft_first_forward_replays_a_captured_graph(pair, tiny_llama):
    """The draft model's first forward of a step gives each drafting request the tokens it has
    not seen with logits for the last (2 after a full accept, 1 + K + 1 after an n-gram step's
    full accept, 1 after a rejection), beside catch-up chunks with no logits. With the graphs
    the engine captures for the draft, such steps replay one, and give the eager forward's
    logits for exactly the rows asked for. Before: decode graphs only (max_query_len 1), and
    any chunk with fewer logits than tokens ran eagerly: every step after a full accept."""
    ref, graphed, _, _, prompts = pair
    num_drafts = 3
    spec = {"method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3}
    config = _config(tiny_llama, max_num_seqs=4, speculative_config=spec)
    graphed.device = FakeCudaDevice()
    capture = FakeCaptureDevice()
    max_query_len = _engine_draft_max_query_len(num_drafts)
    graphs = make_cuda_graphs(graphed, config, max_query_len=max_query_len, capture=capture)
    assert graphs is not None
    rng = random.Random(4)

    def chunk(name: str, n: int, num_logits: int) -> SeqChunk:
        start, table = prompts[name]
        prompts[name] = (start + n, table)
        return SeqChunk([rng.randrange(3, 320) for _ in range(n)], start, table, num_logits)

    steps = [
        [chunk("a", 2, 1), chunk("b", 1, 1), chunk("c", 2, 0)],  # full accept, reject, catch-up
        [chunk("a", 1 + num_drafts + 1, 1), chunk("c", 2, 1)],  # after an n-gram step
        [chunk("b", 2, 1)],
        [chunk("a", 3, 0), chunk("c", 1, 0)],  # catch-up only: no logits at all
    ]
    for chunks in steps:
        replays = sum(g.num_replays for g in capture.graphs)
        logits = graphs.forward(chunks)
        assert sum(g.num_replays for g in capture.graphs) == replays + 1, "ran eagerly"
        expected = eager(ref, chunks)
        if expected is None:
            assert logits is None
        else:
            assert isinstance(logits, torch.Tensor)
            assert logits.shape == expected.shape == (sum(c.num_logits for c in chunks), 320)
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        _assert_same_kv(graphed, ref)
    start, table = prompts["b"]
    long_catch_up = SeqChunk([7] * (max_query_len + 1), start, table, 0)
    assert graphs.forward([long_catch_up]) is NOT_CAPTURED  # bounded catch-up stays eager


@pytest.mark.parametrize(
    ("max_num_seqs", "num_drafts", "budget"),
    [(4, 3, 2048), (64, 5, 8192), (256, 4, 8192), (16, 8, 64), (1, 1, 512), (128, 2, 300)],
)
def test_draft_buckets_stay_within_the_memory_plan(tiny_llama, max_num_seqs, num_drafts, budget):
    """The draft's graphs take longer queries than the target's, never more tokens than the
    memory plan reserves a captured step's activations for (engine.execution.kv_plan.plan_for: at most
    max_num_seqs * (1 + K) tokens, the budget and MAX_CAPTURE_TOKENS), and they hold the common
    first forward of a full batch: 2 tokens for every sequence."""
    spec = {"method": "ngram", "num_speculative_tokens": num_drafts}
    config = _config(
        tiny_llama,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        speculative_config=spec,
    )
    max_query_len = _engine_draft_max_query_len(num_drafts)
    assert max_query_len >= 2 + num_drafts
    sizes = graph_buckets.graph_sizes(config, max_query_len)
    planned = min(budget, max_num_seqs * (1 + num_drafts), MAX_CAPTURE_TOKENS)
    assert max(max(s) for s in sizes.values()) <= planned
    assert max(sizes) == max_query_len
    full_batch = [SeqChunk([0, 0], 0, [0], 1) for _ in range(max_num_seqs)]
    if 2 * max_num_seqs <= planned:
        assert graph_buckets.choose_bucket(sizes, MAX_MODEL_LEN, full_batch) is not None


def test_the_runner_marks_eager_steps_a_graph_of_their_size_would_serve(pair):
    _, graphed, graphs, capture, prompts = pair
    start, table = prompts["a"]
    graphed.graphs = graphs
    decode = SeqChunk([7], start, table, 1)
    many = [SeqChunk([7] * 5, 0, [i % NUM_BLOCKS], 5) for i in range(4)]  # 20 tokens > 16
    for chunks, off_graph in (
        ([decode], False),  # replayed
        ([decode, SeqChunk([7] * 6, start, table, 1)], True),  # a 7-token step ran eagerly
        (many, False),  # eager, as every step of 20 tokens is
    ):
        ModelRunner.forward(graphed, chunks)
        assert graphed.last_off_graph is off_graph
    assert sum(g.num_replays for g in capture.graphs) == 1
