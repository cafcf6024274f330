"""CUDA graphs for the small steps: decode (one token per sequence) and verify (1 + k per sequence).

Such a step does little arithmetic per kernel, so on a GPU its time goes to launching hundreds of
kernels from Python. A CUDA graph records those launches once and replays them with one call.
A graph replays the exact kernels it captured, on the exact addresses, with the host-side
arguments of the capture, so everything that changes per step is copied into fixed tensors
before the replay, and the step is padded to a captured size.

- Buckets: padded token counts 1, 2, 4, then multiples of 8 up to 256, then of 32 (`capture_sizes`).
  Decode graphs (max_seqlen_q 1) go up to min(max_num_seqs, max_num_batched_tokens); verify graphs
  (max_seqlen_q q: 1 + K for the target, K the most draft tokens a step verifies; K + 2 for a
  draft model, `draft_max_query_len`) from 2 up to min(max_num_seqs * (1 + K),
  max_num_batched_tokens), the most tokens the memory plan reserves a captured step's
  activations for (engine.execution.kv_plan.plan_for). Both stop at MAX_CAPTURE_TOKENS: past a few hundred
  tokens a step is compute-bound, and launches no longer matter.
- A step replays the smallest bucket that holds it (`choose_bucket`): decode graphs when every
  sequence has one token, verify graphs when some has more, up to q. Which rows need logits does
  not matter to the captured body (every row's hidden state is computed; attention is causal
  per sequence either way), so a chunk with fewer logits than tokens (a short prompt tail, a
  draft model's catch-up) replays too, and `forward` keeps only the rows asked for. A step with a
  longer chunk, or bigger than every bucket, runs eagerly.
- Padding: padded tokens are token 0 at position 0 and write their K/V only into the runner's
  `pad_block`, a block no request owns; the attention backend lays out the padded step
  (`StaticFlashMetadata`). Output rows of padded tokens are dropped.
- What is captured: the model body (embeddings, rope lookup on the fixed positions tensor, every
  layer with its K/V writes and attention, final norm) into a fixed hidden-states tensor. The LM
  head runs eagerly on the real rows only, which also gives the caller a fresh logits tensor.
- EAGLE-3: a target an EAGLE-3 head taps (`model.aux_layers`) is captured with its taps, a second
  fixed output the replay hands to `model.aux_hidden` for the head's extend; the head itself (a
  model with `input_hidden_size`) reads a hidden state per token besides its ids, copied into a
  fixed input tensor before the replay (`hidden_states`: its draft steps, one token per request,
  take decode buckets). Its extend over what each step kept only writes K/V (`model.write_kv`):
  a second graph per bucket, `kv_states`, with no output.
- Memory: every graph is captured into one shared memory pool, largest first, so the smaller
  graphs reuse the larger ones' intermediate buffers. A graph's output is only valid until the
  next replay of any graph: `forward` turns it into logits at once.

The runner must not replace its KV tensors or weights after the capture: the graphs hold their
addresses. The CUDA primitives (capture, events) sit behind `CaptureDevice`, so tests run all of
this on CPU with a fake that re-runs the captured callable on replay.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from engine.attention.base import BatchLayout, flatten_step
from engine.config import EngineConfig
from engine.core.chunks import SeqChunk
from engine.execution.carry import Carry
from engine.execution.graph_buckets import Bucket, choose_bucket, graph_sizes, verify_query_len
from engine.models.llama import ForwardContext

logger = logging.getLogger(__name__)


class _NotCaptured(enum.Enum):
    NOT_CAPTURED = "not captured"


NOT_CAPTURED = _NotCaptured.NOT_CAPTURED
"""`CudaGraphs.forward`'s answer for a step no graph holds: the runner runs it eagerly."""


class Graph(Protocol):
    """A captured graph: replay() reruns its kernels on the tensors it captured."""

    def replay(self) -> None: ...


class CaptureDevice(Protocol):
    """The CUDA primitives CudaGraphs needs, behind an interface so tests run on CPU."""

    def capture(self, fn: Callable[[], Any]) -> tuple[Graph, Any]:
        """Warm `fn` up, capture it (into the shared pool) -> (graph, its output: a tensor or a
        tuple of tensors)."""
        ...

    def copies_queued(self) -> None:
        """Mark that copies reading the pinned host buffers were just queued."""
        ...

    def wait_copies(self) -> None:
        """Block until the copies marked last have run, so the host buffers can be rewritten."""
        ...


class StaticMetadata(Protocol):
    """Attention metadata at fixed addresses, refilled in place before each replay."""

    def view(self, num_tokens: int, max_seqlen_q: int, max_seqlen_k: int) -> Any: ...

    def fill(self, layout: BatchLayout, num_tokens: int, pad_block: int) -> None: ...


@runtime_checkable
class GraphableBackend(Protocol):
    """An attention backend whose forward can be captured (static shapes, no host syncs)."""

    def allocate_static_metadata(
        self, max_tokens: int, max_blocks_per_seq: int, block_size: int, device: torch.device
    ) -> StaticMetadata: ...


class CudaCaptureDevice:
    """torch.cuda graphs: one memory pool and one side stream shared by every capture.

    Everything names `device`: events, streams and captures otherwise act on the calling
    thread's current device, cuda:0 on the engine's threads whatever device it runs on."""

    def __init__(self, device: torch.device, num_warmups: int = 2) -> None:
        self._device = device
        self._num_warmups = num_warmups
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=device)
        with torch.cuda.device(device):
            self._copied = torch.cuda.Event()
        self._has_copies = False

    def capture(self, fn: Callable[[], Any]) -> tuple[Graph, Any]:
        # Warm up on the capture stream: lazy set-up (cuBLAS handles and workspaces, the first
        # launch of a kernel) must not happen during the capture. The inputs were copied on the
        # current stream, so the side stream waits for them.
        with torch.cuda.device(self._device):
            current = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                for _ in range(self._num_warmups):
                    fn()
            current.wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                out = fn()
        return graph, out

    def copies_queued(self) -> None:
        # The copies were queued on the device's current stream (the fixed tensors' device).
        self._copied.record(torch.cuda.current_stream(self._device))
        self._has_copies = True

    def wait_copies(self) -> None:
        if self._has_copies:
            self._copied.synchronize()


@dataclass(frozen=True)
class _Captured:
    graph: Graph
    hidden: torch.Tensor  # [num_tokens, hidden_size], rewritten by every replay
    # [num_tokens, len(aux_layers) * hidden_size]: the tapped layers' inputs, where an EAGLE-3
    # head taps the model; rewritten by every replay too.
    taps: torch.Tensor | None = None


class CudaGraphs:
    """Captured decode/verify graphs of one runner, and the fixed tensors they read.

    `runner` provides model, rope, kv_caches, backend (a GraphableBackend), block_size,
    pad_block, dtype and device (an engine.runtime.device.Device). `sizes` maps a max query length to
    the padded token counts captured with it (1: decode graphs; more: verify graphs, or a draft
    model's first forwards)."""

    def __init__(self, runner: Any, sizes: Mapping[int, Sequence[int]], capture: CaptureDevice):
        assert sizes and all(sizes.values()), "nothing to capture"
        self._runner = runner
        self._capture = capture
        self._sizes = {q: tuple(sorted(s)) for q, s in sorted(sizes.items())}
        # A backend whose captured attention takes any query length (Triton's) replays mixed
        # steps too: decodes beside a prompt chunk, a draft model's catch-up.
        self._any_query_len = bool(getattr(runner.backend, "any_query_len", False))
        device = runner.device.torch
        max_tokens = max(max(s) for s in self._sizes.values())
        # The rope table covers every position a sequence may reach: the longest context.
        self.max_model_len = int(runner.rope.cos.shape[0])
        max_blocks = -(-self.max_model_len // runner.block_size)
        self._metadata = runner.backend.allocate_static_metadata(
            max_tokens, max_blocks, runner.block_size, device
        )
        pin = device.type == "cuda"  # pinned host buffers: non-blocking copies
        self._ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # [max_tokens]
        self._positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._host_ids = torch.zeros(max_tokens, dtype=torch.int64, device="cpu", pin_memory=pin)
        self._host_positions = torch.zeros(
            max_tokens, dtype=torch.int64, device="cpu", pin_memory=pin
        )
        # A model that reads a hidden state per token besides its ids (an EAGLE-3 head) reads it
        # from a fixed tensor too; a model an EAGLE-3 head taps gives its taps as a second output.
        width = getattr(runner.model, "input_hidden_size", None)
        self._hidden_in = (
            None
            if width is None
            else torch.zeros(max_tokens, width, dtype=runner.dtype, device=device)
        )  # [max_tokens, width]
        self._tapped = bool(getattr(runner.model, "aux_layers", ()))
        self._graphs: dict[Bucket, _Captured] = {}
        # A model with a hidden input that can write its K/V alone gets those graphs too.
        self._writes_kv = self._hidden_in is not None and hasattr(runner.model, "write_kv")
        self._kv_graphs: dict[Bucket, Graph] = {}
        self._capture_all()

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Every captured bucket, smallest first within each max query length."""
        return tuple(Bucket(q, t) for q, sizes in self._sizes.items() for t in sizes)

    def covers(self, num_tokens: int) -> bool:
        """Some captured graph holds a step of `num_tokens` tokens (its decode steps replay)."""
        return any(sizes and sizes[-1] >= num_tokens for sizes in self._sizes.values())

    def bucket(self, chunks: Sequence[SeqChunk]) -> Bucket | None:
        """The smallest captured bucket that holds this step, or None (run it eagerly)."""
        return choose_bucket(self._sizes, self.max_model_len, chunks, self._any_query_len)

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[SeqChunk], carry: Carry | None = None
    ) -> torch.Tensor | None | _NotCaptured:
        """Replay the step's bucket -> logits [sum of num_logits, vocab_size] (float32), rows in
        chunk order, or None when no chunk asks for logits, as ModelRunner.forward returns
        them; NOT_CAPTURED when no bucket holds the step. A tapped model's taps of the step's
        tokens are left in `model.aux_hidden` (valid until the next replay)."""
        replayed = self._replay(chunks, None, carry)
        if replayed is NOT_CAPTURED:
            return NOT_CAPTURED
        step, hidden = replayed
        if not step.logit_rows:
            return None
        if len(step.logit_rows) < step.layout.num_tokens:  # some chunk is prompt-like: its rows
            rows = self._runner.device.tensor(step.logit_rows, torch.int64)  # [num_logits]
            hidden = hidden[rows]  # [num_logits, hidden_size]
        return self._runner.model.compute_logits(hidden)  # [num_logits, vocab_size]

    @torch.inference_mode()
    def hidden_states(
        self, chunks: Sequence[SeqChunk], hidden_in: torch.Tensor
    ) -> torch.Tensor | _NotCaptured:
        """For a model that reads a hidden state per token (`input_hidden_size`): replay the
        step's bucket with `hidden_in` [num_tokens, width] -> the model's output [num_tokens,
        hidden_size], a fresh tensor; NOT_CAPTURED when no bucket holds the step."""
        assert self._hidden_in is not None, "this model takes no hidden input"
        replayed = self._replay(chunks, hidden_in)
        if replayed is NOT_CAPTURED:
            return NOT_CAPTURED
        return replayed[1].clone()  # the graph's output is rewritten by the next replay

    @torch.inference_mode()
    def kv_states(self, chunks: Sequence[SeqChunk], hidden_in: torch.Tensor) -> None | _NotCaptured:
        """For a model that writes its K/V alone (`write_kv`): replay the step's K/V-only graph
        with `hidden_in` [num_tokens, width] -> None, or NOT_CAPTURED when no bucket holds it."""
        bucket = self.bucket(chunks) if self._kv_graphs else None
        if bucket is None:
            return NOT_CAPTURED
        self._load_step(chunks, bucket, hidden_in)
        self._kv_graphs[bucket].replay()
        return None

    def _load_step(
        self,
        chunks: Sequence[SeqChunk],
        bucket: Bucket,
        hidden_in: torch.Tensor | None,
        carry: Carry | None = None,
    ) -> Any:
        """Copy the step (and a hidden input, and the carried tokens) into the fixed tensors ->
        the flattened step."""
        step = flatten_step(chunks, self._runner.block_size)
        n = step.layout.num_tokens
        self._load(step.layout, step.token_ids, step.positions, bucket.num_tokens)
        if carry is not None:
            carry.apply(self._ids)  # device to device, after the ids' copy in stream order
        if self._hidden_in is not None:
            assert hidden_in is not None and hidden_in.shape[0] == n
            self._hidden_in[:n].copy_(hidden_in)  # device to device, in stream order
        return step

    def _replay(
        self,
        chunks: Sequence[SeqChunk],
        hidden_in: torch.Tensor | None,
        carry: Carry | None = None,
    ) -> tuple[Any, torch.Tensor] | _NotCaptured:
        """Load and replay the step's bucket -> (the flattened step, the output rows of its
        tokens, valid until the next replay), or NOT_CAPTURED."""
        bucket = self.bucket(chunks)
        if bucket is None:
            return NOT_CAPTURED
        step = self._load_step(chunks, bucket, hidden_in, carry)
        n = step.layout.num_tokens
        captured = self._graphs[bucket]
        captured.graph.replay()
        if captured.taps is not None:
            self._runner.model.aux_hidden = captured.taps[:n]
        return step, captured.hidden[:n]  # [num_tokens, hidden_size]

    def _load(
        self, layout: BatchLayout, token_ids: list[int], positions: list[int], num_tokens: int
    ) -> None:
        """Copy a step, padded to `num_tokens`, into the fixed tensors (pinned, non-blocking)."""
        n, t = layout.num_tokens, num_tokens
        self._capture.wait_copies()  # the last step's copies may still read the host buffers
        for host, values, dev in (
            (self._host_ids, token_ids, self._ids),
            (self._host_positions, positions, self._positions),
        ):
            host[:n].copy_(torch.tensor(values, dtype=torch.int64, device="cpu"))
            host[n:t].zero_()
            dev[:t].copy_(host[:t], non_blocking=True)
        self._metadata.fill(layout, t, self._runner.pad_block)
        self._capture.copies_queued()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones then fit in the pool the largest
        left), each over an all-padding step: during warm-up only the pad block is written."""
        no_slots = torch.zeros(0, dtype=torch.int64, device="cpu")
        padding = BatchLayout((), (), (), no_slots, self._runner.block_size)
        for bucket in sorted(self.buckets, key=lambda b: (-b.num_tokens, -b.max_query_len)):
            self._load(padding, [], [], bucket.num_tokens)
            graph, out = self._capture.capture(self._body(bucket))
            self._graphs[bucket] = _Captured(graph, *out) if self._tapped else _Captured(graph, out)
            if self._writes_kv:
                self._kv_graphs[bucket] = self._capture.capture(self._body(bucket, kv_only=True))[0]
        if self._tapped:
            self._runner.model.aux_hidden = None  # the capture's, not a step's

    def _body(self, bucket: Bucket, kv_only: bool = False) -> Callable[[], Any]:
        """The captured work for one bucket (`kv_only`: the model's write_kv). It reads only
        fixed tensors and ints fixed here: whatever else it read would be frozen at its
        capture-time value on replay."""
        runner, t = self._runner, bucket.num_tokens
        ids, positions = self._ids[:t], self._positions[:t]  # [t]
        metadata = self._metadata.view(t, bucket.max_query_len, self.max_model_len)
        hidden_in = None if self._hidden_in is None else self._hidden_in[:t]  # [t, width]
        tapped = self._tapped

        def body() -> Any:
            cos, sin = runner.rope(positions, runner.dtype)  # [t, head_dim]
            ctx = ForwardContext(
                backend=runner.backend,
                attn_metadata=metadata,
                kv_caches=runner.kv_caches,
                cos=cos,
                sin=sin,
                fused=runner.fused,
            )
            if kv_only:
                return runner.model.write_kv(ids, ctx, hidden_in)  # None: only K/V written
            if hidden_in is not None:
                return runner.model(ids, ctx, hidden_in)  # [t, hidden_size]
            hidden = runner.model(ids, ctx)  # [t, hidden_size]
            if tapped:
                return hidden, runner.model.aux_hidden  # and [t, n_aux * hidden_size]
            return hidden

        return body


def make_cuda_graphs(
    runner: Any,
    config: EngineConfig,
    *,
    max_query_len: int | None = None,
    capture: CaptureDevice | None = None,
) -> CudaGraphs | None:
    """Capture `runner`'s decode/verify graphs, or None where graphs do not apply: not CUDA,
    `config.enforce_eager`, or an attention backend that cannot be captured (torch builds
    data-dependent shapes). Call it once the KV cache is allocated, and never replace the KV
    tensors afterwards.

    `max_query_len`: the longest query a captured step may give one sequence; default
    `verify_query_len(config)` (1 without speculation: decode graphs only; a draft model's
    runner passes `draft_max_query_len`). The token counts stay within the memory plan whatever
    it is (`graph_sizes`). `capture`: the CUDA primitives (tests pass a CPU fake)."""
    if config.enforce_eager or not runner.device.is_cuda:
        return None
    if not isinstance(runner.backend, GraphableBackend):
        logger.info("attention backend %s runs eagerly: no CUDA graphs", runner.backend.name)
        return None
    sizes = graph_sizes(config, max_query_len or verify_query_len(config))
    start = time.perf_counter()
    before = runner.device.memory_info()
    graphs = CudaGraphs(runner, sizes, capture or CudaCaptureDevice(runner.device.torch))
    after = runner.device.memory_info()
    used = (before[0] - after[0]) / 2**20 if before and after else float("nan")
    logger.info(
        "captured %d CUDA graphs in %.1f s (%.0f MiB): %s",
        len(graphs.buckets),
        time.perf_counter() - start,
        used,
        "; ".join(f"up to {q} tokens per sequence: {list(s)}" for q, s in sizes.items()),
    )
    return graphs
