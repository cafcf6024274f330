"""CUDA graphs for decode/verify steps, checked on CPU with the CUDA pieces faked.

The fakes: a capture device whose "graph" re-runs the captured callable on replay (writing into
the output tensor it returned at capture, as a real graph writes into its captured memory), and a
plain-torch flash_attn_varlen_func with the kernel's contract asserted (int32 offsets, query and
key lengths within the fixed maxima, one query token per entry on the single-query path) and NaN
in every output row no sequence covers. The graph path then runs the real padding, static
metadata and replay logic, and must give the logits the eager torch-backend forward gives.
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
from engine.config import EngineConfig
from engine.core.chunks import SeqChunk
from engine.execution import cuda_graphs, graph_buckets
from engine.execution.cuda_graphs import NOT_CAPTURED, CudaGraphs, make_cuda_graphs
from engine.execution.graph_buckets import MAX_CAPTURE_TOKENS, Bucket, capture_sizes
from engine.execution.runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.loader import load_model
from engine.models.rope import RotaryEmbedding
from engine.runtime.device import Device

BLOCK_SIZE = 256  # flash-attn's page size
NUM_BLOCKS = 6  # blocks requests own; the pad block is one more
MAX_MODEL_LEN = 512


def reference_varlen(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """flash_attn_varlen_func over a paged cache, in plain torch: each sequence's queries attend
    to the first seq_len keys its block table points at, causally aligned to the bottom right."""
    assert causal
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
    num_seqs = cu_seqlens_q.numel() - 1
    assert cu_seqlens_k.numel() == num_seqs + 1 and block_table.shape[0] == num_seqs
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if max_seqlen_q == 1 and num_heads > num_kv_heads:
        # flash-attn's single-query path ignores cu_seqlens_q: one query token per entry.
        assert q.shape[0] == num_seqs
        assert cu_seqlens_q.tolist() == list(range(num_seqs + 1))
    bs = k_cache.shape[1]
    out = torch.full_like(q, float("nan"))  # the kernel leaves uncovered rows unwritten
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(num_seqs):
        q_len, k_len = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        assert 0 <= q_len <= max_seqlen_q and 0 <= k_len <= max_seqlen_k
        if q_len == 0:
            continue
        assert q_len <= k_len
        blocks = block_table[b, : -(-k_len // bs)].long()
        assert int(blocks.max()) < k_cache.shape[0]
        k = k_cache[blocks].reshape(-1, num_kv_heads, k_cache.shape[3])[:k_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, v_cache.shape[3])[:k_len]
        groups = num_heads // num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu_q[b] : cu_q[b + 1]], k) * softmax_scale
        q_pos = torch.arange(k_len - q_len, k_len)[:, None]
        scores = scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf"))
        out[cu_q[b] : cu_q[b + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


class FakeGraph:
    """Replay re-runs the captured callable into the tensor (or tensors) the capture returned."""

    def __init__(self, fn, out: torch.Tensor | tuple[torch.Tensor, ...] | None) -> None:
        self.fn, self.out, self.num_replays = fn, out, 0

    def replay(self) -> None:
        self.num_replays += 1
        new = self.fn()
        if self.out is None:  # a graph whose work is its writes (K/V only)
            assert new is None
        elif isinstance(self.out, tuple):
            for out, value in zip(self.out, new, strict=True):
                out.copy_(value)
        else:
            self.out.copy_(new)


class FakeCaptureDevice:
    """Records what was captured, in order; host copies are synchronous on CPU."""

    def __init__(self) -> None:
        self.graphs: list[FakeGraph] = []

    def capture(self, fn):
        out = fn()
        self.graphs.append(FakeGraph(fn, out))
        return self.graphs[-1], out

    def copies_queued(self) -> None:
        pass

    def wait_copies(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_parts(tiny_llama):
    cfg = ModelConfig.from_path(tiny_llama)
    model = load_model(cfg, torch.float32, torch.device("cpu"))
    rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim, MAX_MODEL_LEN, torch.device("cpu"))
    return cfg, model, rope


def _runner(model_parts, backend, num_blocks: int) -> SimpleNamespace:
    """A runner-like object: what ModelRunner.forward and CudaGraphs read."""
    cfg, model, rope = model_parts
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    runner = SimpleNamespace(
        model=model,
        rope=rope,
        backend=backend,
        block_size=BLOCK_SIZE,
        pad_block=NUM_BLOCKS,
        dtype=torch.float32,
        device=Device("cpu"),
        kv_caches=tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)),
        graphs=None,
    )
    runner.step_inputs = lambda chunks: ModelRunner.step_inputs(runner, chunks)  # type: ignore[arg-type]
    return runner


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


def test_capture_is_largest_first_into_one_pool(pair):
    _, _, graphs, capture, _ = pair
    sizes = [g.out.shape[0] for g in capture.graphs]
    assert sizes == sorted(sizes, reverse=True)
    assert sorted(sizes) == sorted(t for s in SIZES.values() for t in s)


def test_capture_sizes():
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(20, smallest=2) == (2, 4, 8, 16, 20)
    assert capture_sizes(300)[-3:] == (256, 288, 300)
    assert capture_sizes(1, smallest=2) == ()


# ------------------------------------------------------------------------------ make_cuda_graphs


class FakeCudaDevice(Device):
    """Says CUDA, allocates on the CPU: lets make_cuda_graphs run its CUDA branch here."""

    def __init__(self) -> None:
        super().__init__("cpu")

    @property
    def is_cuda(self) -> bool:
        return True

    def memory_info(self) -> tuple[int, int] | None:
        return None


def _config(tiny_llama, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(tiny_llama), device="cpu", **kwargs)


def test_make_cuda_graphs_derives_buckets_from_the_config(model_parts, tiny_llama):
    runner = _runner(model_parts, FlashAttentionBackend(reference_varlen), NUM_BLOCKS + 1)
    runner.device = FakeCudaDevice()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    config = _config(tiny_llama, max_num_seqs=4, speculative_config=spec)
    graphs = make_cuda_graphs(runner, config, capture=FakeCaptureDevice())
    assert graphs is not None
    decode = [Bucket(1, t) for t in (1, 2, 4)]
    verify = [Bucket(4, t) for t in (2, 4, 8, 16)]  # 4 sequences x (1 + 3 drafts)
    assert graphs.buckets == (*decode, *verify)
    config = _config(tiny_llama, max_num_seqs=4, max_num_batched_tokens=10, speculative_config=spec)
    graphs = make_cuda_graphs(runner, config, capture=FakeCaptureDevice())
    assert graphs is not None and graphs.buckets[-1] == Bucket(4, 10)
    # max_query_len 1: decode graphs only.
    graphs = make_cuda_graphs(runner, config, max_query_len=1, capture=FakeCaptureDevice())
    assert graphs is not None and graphs.buckets == tuple(decode)


def test_no_graphs_on_cpu_when_eager_or_with_the_torch_backend(model_parts, tiny_llama):
    flash = _runner(model_parts, FlashAttentionBackend(reference_varlen), NUM_BLOCKS + 1)
    capture = FakeCaptureDevice()
    assert make_cuda_graphs(flash, _config(tiny_llama), capture=capture) is None  # CPU
    flash.device = FakeCudaDevice()
    eager_config = _config(tiny_llama, enforce_eager=True)
    assert make_cuda_graphs(flash, eager_config, capture=capture) is None
    torch_runner = _runner(model_parts, TorchAttentionBackend(), NUM_BLOCKS + 1)
    torch_runner.device = FakeCudaDevice()
    assert make_cuda_graphs(torch_runner, _config(tiny_llama), capture=capture) is None
    assert capture.graphs == []


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


def test_the_graphable_backends_by_name_are_the_ones_that_capture():
    """The memory plan reserves a graph pool by backend name (GRAPHABLE_BACKENDS), before any
    backend is built; the runner captures where the backend is a GraphableBackend."""
    from engine.attention.cpu_paged import CpuAttentionBackend
    from engine.attention.triton_attn import TritonAttentionBackend

    backends = {
        "flash_attn": FlashAttentionBackend(reference_varlen),
        "triton": TritonAttentionBackend(),
        "torch": TorchAttentionBackend(),
        "cpu": CpuAttentionBackend(),
    }
    graphable = {n for n, b in backends.items() if isinstance(b, cuda_graphs.GraphableBackend)}
    assert graphable == set(graph_buckets.GRAPHABLE_BACKENDS)
