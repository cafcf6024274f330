"""Which CUDA graphs get made, checked on CPU with the CUDA pieces faked
(tests/unit/cuda_graph_fakes.py): the capture sizes, the decode and verify buckets
make_cuda_graphs derives from the engine config, no graphs on a CPU, when eager or with the torch
backend, and the graphable backends by name are the ones that capture."""

from __future__ import annotations

from engine.attention.flash_attn import FlashAttentionBackend
from engine.attention.torch_attn import TorchAttentionBackend
from engine.execution import cuda_graphs, graph_buckets
from engine.execution.cuda_graphs import make_cuda_graphs
from engine.execution.graph_buckets import Bucket, capture_sizes
from tests.unit.cuda_graph_fakes import (
    NUM_BLOCKS,
    FakeCaptureDevice,
    FakeCudaDevice,
    _config,
    _runner,
    reference_varlen,
)


def test_capture_sizes():
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(20, smallest=2) == (2, 4, 8, 16, 20)
    assert capture_sizes(300)[-3:] == (256, 288, 300)
    assert capture_sizes(1, smallest=2) == ()


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


def test_a_backend_of_any_query_length_replays_mixed_steps():
    """flash-attn's captured attention is built for a longest query, so a prompt chunk longer
    than the verify graphs' runs eagerly; Triton's reads each token's own position, so the
    smallest bucket with room holds any mix of chunks."""
    from engine.attention.triton_attn import TritonAttentionBackend
    from engine.core.chunks import SeqChunk
    from engine.execution.graph_buckets import choose_bucket

    sizes = {1: (1, 2, 4, 8), 5: (2, 4, 8, 16)}
    mixed = [SeqChunk([7], 30, [0], 1), SeqChunk([7] * 9, 0, [1], 0)]  # a decode, a prompt chunk
    assert choose_bucket(sizes, 512, mixed) is None
    assert choose_bucket(sizes, 512, mixed, any_query_len=True) == Bucket(5, 16)
    verify = [SeqChunk([7] * 3, 30, [0], 3)]
    assert choose_bucket(sizes, 512, verify) == Bucket(5, 4)
    assert choose_bucket(sizes, 512, verify, any_query_len=True) == Bucket(1, 4)
    too_long = [SeqChunk([7] * 17, 0, [0], 1)]
    assert choose_bucket(sizes, 512, too_long, any_query_len=True) is None
    assert choose_bucket(sizes, 20, [SeqChunk([7] * 2, 19, [0], 1)], any_query_len=True) is None
    assert TritonAttentionBackend.any_query_len
    assert not getattr(FlashAttentionBackend, "any_query_len", False)
