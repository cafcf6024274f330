"""CUDA graphs for EAGLE-3, checked on CPU with the CUDA pieces faked (tests/unit/
test_cuda_graphs.py's capture device and plain-torch flash-attn kernel): a target an EAGLE-3 head
taps replays its decode/verify steps with the taps as a second output, equal to the eager
forward's; the head's extend over decoding requests (1 + accepted tokens each) and its chained
draft steps (one token each) replay graphs that read the hidden input from a fixed tensor, and
give the eager head's outputs and K/V, and its K/V-only extend replays graphs of its own; the
memory plan reserves both in the graph pool."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.flash_attn import FlashAttentionBackend
from engine.attention.torch_attn import TorchAttentionBackend
from engine.core.chunks import SeqChunk
from engine.execution.cuda_graphs import NOT_CAPTURED, CudaGraphs
from engine.execution.runner import ModelRunner
from engine.models.config import ModelConfig
from engine.models.eagle3.checkpoint import load_head
from engine.models.eagle3.config import Eagle3Config
from engine.models.loader import load_model
from engine.models.rope import RotaryEmbedding
from tests.eagle3_heads import build_tiny_eagle3_head
from tests.unit.test_cuda_graphs import (
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    SIZES,
    FakeCaptureDevice,
    _assert_same_kv,
    _runner,
    eager,
    reference_varlen,
)

CPU = torch.device("cpu")
TAPS = (0, 1)  # the tiny target has two layers: the inputs of both


def _pair(parts, prefill):
    """(eager torch-backend runner, graphed runner with fake-captured CudaGraphs, the capture
    device) over the same model and the same prefilled KV (`prefill(runner)` on the eager one)."""
    ref = _runner(parts, TorchAttentionBackend(), NUM_BLOCKS)
    graphed = _runner(parts, FlashAttentionBackend(reference_varlen), NUM_BLOCKS + 1)
    prefill(ref)
    for (k, v), (k_ref, v_ref) in zip(graphed.kv_caches, ref.kv_caches, strict=True):
        k[:NUM_BLOCKS].copy_(k_ref)
        v[:NUM_BLOCKS].copy_(v_ref)
    capture = FakeCaptureDevice()
    graphed.graphs = CudaGraphs(graphed, SIZES, capture)
    return ref, graphed, capture


def _num_replays(capture: FakeCaptureDevice) -> int:
    return sum(g.num_replays for g in capture.graphs)


SEQS = {"a": (250, [4, 1]), "b": (10, [3]), "c": (40, [5, 0])}  # context, blocks


@pytest.fixture
def tapped_target(tiny_llama):
    cfg = ModelConfig.from_path(tiny_llama)
    model = load_model(cfg, torch.float32, CPU)
    model.aux_layers = TAPS
    return cfg, model, RotaryEmbedding(cfg.hf_config, cfg.head_dim, MAX_MODEL_LEN, CPU)


def test_a_tapped_target_replays_with_its_taps(tapped_target):
    cfg, model, _ = tapped_target
    rng = random.Random(0)
    prompts = {name: [rng.randrange(3, 320) for _ in range(n)] for name, (n, _) in SEQS.items()}

    def prefill(runner):
        for name, (_, table) in SEQS.items():
            eager(runner, [SeqChunk(prompts[name], 0, table, 1)])

    ref, graphed, capture = _pair(tapped_target, prefill)
    assert model.aux_hidden is None  # the capture's taps are not left for a step to read
    starts = {name: n for name, (n, _) in SEQS.items()}
    for lens in ({"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 2, "c": 5}, {"b": 3}):
        chunks = []
        for name, n in lens.items():
            ids = [rng.randrange(3, 320) for _ in range(n)]
            chunks.append(SeqChunk(ids, starts[name], SEQS[name][1], n))
            starts[name] += n
        replays = _num_replays(capture)
        logits = ModelRunner.forward(graphed, chunks)  # type: ignore[arg-type]
        assert _num_replays(capture) == replays + 1, "ran eagerly"
        taps = model.aux_hidden.clone()
        expected = eager(ref, chunks)
        num_tokens = sum(lens.values())
        assert taps.shape == model.aux_hidden.shape == (num_tokens, len(TAPS) * cfg.hidden_size)
        torch.testing.assert_close(taps, model.aux_hidden, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        _assert_same_kv(graphed, ref)


@pytest.fixture
def head_parts(tiny_llama, tmp_path):
    path = build_tiny_eagle3_head(
        tmp_path, tiny_llama, with_embedding=True, aux_layer_ids=list(TAPS), dtype=torch.float32
    )
    head = Eagle3Config.from_path(path)
    target = ModelConfig.from_path(tiny_llama)
    cfg = head.as_model_config(target)
    model = load_head(head, cfg, len(TAPS), torch.float32, CPU)
    return cfg, model, RotaryEmbedding(cfg.hf_config, cfg.head_dim, MAX_MODEL_LEN, CPU)


def _head_prefill(rng, hidden):
    """The head's KV of every sequence's prompt, as the prompts' extends write it."""

    def prefill(runner):
        for _, (n, table) in SEQS.items():
            ids = [rng.randrange(3, 320) for _ in range(n)]
            ModelRunner.hidden_forward(runner, [SeqChunk(ids, 0, table, 0)], hidden(n))

    return prefill


def _next_chunks(rng, starts, lens):
    """Random tokens for each named sequence's next `lens[name]` positions (starts advance)."""
    chunks = []
    for name, n in lens.items():
        ids = [rng.randrange(3, 320) for _ in range(n)]
        chunks.append(SeqChunk(ids, starts[name], SEQS[name][1], 0))
        starts[name] += n
    return chunks


def test_the_heads_extend_and_draft_steps_replay_with_their_hidden_input(head_parts):
    cfg, model, _ = head_parts
    width = model.input_hidden_size
    assert width == cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)

    def hidden(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen)

    ref, graphed, capture = _pair(head_parts, _head_prefill(rng, hidden))
    starts = {name: n for name, (n, _) in SEQS.items()}
    steps = [
        {"a": 1, "b": 1, "c": 1},  # chained draft steps: one token each
        {"a": 3, "b": 1, "c": 5},  # an extend: 1 + accepted tokens per decoding request
        {"c": 1},
        {"a": 5, "b": 2},
    ]
    for lens in steps:
        chunks = _next_chunks(rng, starts, lens)
        given = hidden(sum(lens.values()))
        replays = _num_replays(capture)
        out = ModelRunner.hidden_forward(graphed, chunks, given)  # type: ignore[arg-type]
        assert _num_replays(capture) == replays + 1, "ran eagerly"
        expected = ModelRunner.hidden_forward(ref, chunks, given)  # type: ignore[arg-type]
        assert out.shape == expected.shape == (sum(lens.values()), cfg.hidden_size)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        _assert_same_kv(graphed, ref)
        # A fresh tensor: the next replay does not rewrite what the proposer keeps.
        kept = out.clone()
        one, one_hidden = [SeqChunk([5], starts["b"], SEQS["b"][1], 0)], hidden(1)
        graphed.graphs.hidden_states(one, one_hidden)
        assert torch.equal(out, kept)
        ModelRunner.hidden_forward(ref, one, one_hidden)  # the same K/V on both sides
    # A prompt's extend (longer than any bucket's query) runs eagerly.
    long = [SeqChunk([7] * 6, starts["a"], SEQS["a"][1], 0)]
    assert graphed.graphs.hidden_states(long, hidden(6)) is NOT_CAPTURED


def test_the_heads_extend_replays_a_kv_only_graph(head_parts):
    """The extend writes only the head's K/V: a graph per bucket of its own (and eagerly where
    none holds the step), whose K/V equal what the eager head's whole forward writes."""
    cfg, model, _ = head_parts
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(3)

    def hidden(n: int) -> torch.Tensor:
        return torch.randn(n, model.input_hidden_size, generator=gen)

    ref, graphed, capture = _pair(head_parts, _head_prefill(rng, hidden))
    starts = {name: n for name, (n, _) in SEQS.items()}
    for lens in ({"a": 3, "b": 1, "c": 5}, {"a": 1, "b": 1, "c": 1}, {"a": 6}):
        chunks = _next_chunks(rng, starts, lens)
        given = hidden(sum(lens.values()))
        captured = graphed.graphs.bucket(chunks) is not None
        replays = _num_replays(capture)
        assert ModelRunner.kv_forward(graphed, chunks, given) is None  # type: ignore[arg-type]
        assert _num_replays(capture) == replays + captured
        ModelRunner.hidden_forward(ref, chunks, given)  # type: ignore[arg-type]
        _assert_same_kv(graphed, ref)
    assert not captured  # the last step's 6-token query is longer than any bucket's
