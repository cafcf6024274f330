"""A step's device work, as the engine launches it (`device_work`) and reads it back (`Launched`):
its flattened batch (`build_batch`), the input tokens it carries from the step in flight
(`carry_indices`), and its results, verified within the work or sampled into device tensors with
one packed copy to the host (an overlapped step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.chunks import SeqChunk
from engine.core.drafts import Draft
from engine.core.emitted import StepTokens
from engine.core.request import Request
from engine.core.schedule import SchedulerOutput
from engine.execution.carry import Carry
from engine.runtime.device import Device, to_host
from engine.sampling.rows import SamplingRow
from engine.scheduling.block_manager import BlockManager
from engine.verification.verifier import Verifier, pack, sampled_results, unpack


@dataclass
class DeviceResult:
    """What a step's device work returns: its start and end marks, and either its verified
    tokens (read back within the work) or its samples on the device (`tokens`, [rows] int64,
    which the next step may carry) with their packed copy to the host (`host`, valid once the
    end mark has passed)."""

    start: Any
    end: Any
    verified: list[StepTokens] | None = None
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    off_graph: bool = False  # the forward ran eagerly where its token count has a graph


@dataclass
class Launched:
    """A step queued on the device, read back by `LLMEngine._complete`."""

    schedule: SchedulerOutput
    chunks: list[SeqChunk]
    drafts: dict[str, Draft]
    items: list[tuple[Request, Draft | None]]
    width: int | None  # the top logprobs' width (None: no row asked for logprobs)
    result: Future[DeviceResult]
    overlapped: bool
    mode: str
    draft_seconds: float
    skipped: tuple[tuple[str, int], ...]
    host_seconds: float = 0.0  # the host's work of scheduling and launching it

    def results(self, out: DeviceResult) -> list[StepTokens]:
        """Each sampling request's tokens, from the work's output once its end mark passed."""
        if out.verified is not None:
            return out.verified
        if out.host is None:
            return []
        num_rows = len(self.items)
        return sampled_results(unpack(out.host, num_rows, self.width), num_rows)


def build_batch(
    schedule: SchedulerOutput, drafts: dict[str, Draft], block_manager: BlockManager
) -> tuple[list[SeqChunk], list[tuple[Request, Draft | None]], list[int]]:
    """The step's chunks, its sampling requests with their drafts, and the chunks whose one
    token is in flight (its value comes from the device: a placeholder 0 here)."""
    chunks: list[SeqChunk] = []
    items: list[tuple[Request, Draft | None]] = []
    carried: list[int] = []
    for s in schedule.scheduled:
        request, start = s.request, s.request.num_computed_tokens
        draft = drafts.get(request.request_id)
        draft_ids = list(draft.token_ids) if draft is not None else []
        end = start + s.num_new_tokens
        samples = end == request.num_tokens + request.num_in_flight
        known = request.all_token_ids[start:end]
        if len(known) < s.num_new_tokens:  # the token the step in flight is sampling
            carried.append(len(chunks))
            known.append(0)
        chunks.append(
            SeqChunk(
                known + draft_ids,
                start,
                # A copy: the table may grow or be freed while the step runs.
                tuple(block_manager.get_block_table(request.request_id)),
                1 + len(draft_ids) if samples else 0,
            )
        )
        if samples:
            items.append((request, draft))
    return chunks, items, carried


def carry_indices(
    schedule: SchedulerOutput,
    chunks: list[SeqChunk],
    carried: list[int],
    inflight: Launched | None,
    device: Device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the carried tokens go in the flattened step, and their rows in the samples of the
    step in flight (both on the device), or None when no chunk carries one."""
    if not carried:
        return None
    assert inflight is not None, "a token in flight without a step in flight"
    offsets, offset = [], 0
    for chunk in chunks:
        offsets.append(offset)
        offset += len(chunk.token_ids)
    # The carried token is its chunk's first (a decode chunk of one token, no drafts).
    rows = {r.request_id: i for i, (r, _) in enumerate(inflight.items)}  # its sample rows
    dst = [offsets[i] for i in carried]
    src = [rows[schedule.scheduled[i].request.request_id] for i in carried]
    return device.tensor(dst, torch.int64), device.tensor(src, torch.int64)


def logprobs_width(items: Sequence[tuple[Request, Draft | None]], vocab_size: int) -> int | None:
    """The width of a step's top logprobs (`with_logprobs`), None when no row asks for any."""
    widths = [r.params.logprobs for r, _ in items if r.params.logprobs is not None]
    return min(max(widths), vocab_size) if widths else None


def device_work(
    runner: Any,
    verifier: Verifier,
    chunks: list[SeqChunk],
    items: list[tuple[Request, Draft | None]],
    rows: list[SamplingRow],
    carry: tuple[torch.Tensor, torch.Tensor] | None,
    inflight: Launched | None,
    overlapped: bool,
) -> Callable[[], DeviceResult]:
    """The step's work for `Device.launch`: the forward (its carried tokens taken from the step
    in flight's samples, there by then: the device runs steps in order) and the verify, or for
    an overlapped step the sampling and one packed copy to the host, between two marks."""
    device = runner.device
    previous = inflight.result if inflight is not None else None

    def work() -> DeviceResult:
        start = device.mark()
        if carry is None:
            logits = runner.forward(chunks)
        else:
            assert previous is not None
            tokens = previous.result().tokens
            assert tokens is not None
            logits = runner.forward(chunks, Carry(carry[0], tokens.index_select(0, carry[1])))
        off_graph = bool(getattr(runner, "last_off_graph", False))
        if not overlapped:
            verified = verifier.run(logits, items, rows) if logits is not None else []
            return DeviceResult(start, device.mark(), verified=verified, off_graph=off_graph)
        if logits is None:
            return DeviceResult(start, device.mark(), off_graph=off_graph)
        sampled = verifier.sample(logits, rows)
        host = to_host(pack(sampled))
        return DeviceResult(
            start, device.mark(), tokens=sampled.token_ids, host=host, off_graph=off_graph
        )

    return work
