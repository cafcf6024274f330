"""Overlap scheduling overlaps: over a fake device whose forward takes a scripted time on a thread
of its own (a CUDA stream the host does not wait for), with a scripted host time in every step's
scheduling, an overlapped step's wall time is close to max(forward, host), not their sum; the
host schedules step t+1 while the device runs step t; each step waits on the device once; and
the answers equal those of the same fake run without overlap."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine import LLM, SamplingParams
from engine.runtime.device import Device

FORWARD_SECONDS = 0.04
HOST_SECONDS = 0.04
NUM_REQUESTS = 6
MAX_TOKENS = 16


class StreamDevice(Device):
    """A CPU device that runs each step's work on one worker thread, in order (a stream)."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self._stream = ThreadPoolExecutor(max_workers=1)

    def launch(self, work):  # type: ignore[no-untyped-def, override]
        return self._stream.submit(work)


def _scripted_forward(runner, vocab: int, spans: list[tuple[float, float]]):
    """A forward that sleeps FORWARD_SECONDS and returns logits whose argmax is a hash of each
    sampling row's input token and position (a carried token included, as the device has it)."""

    def forward(chunks, carry=None):
        start = time.perf_counter()
        step, _, ids = runner.step_inputs(chunks, carry)
        time.sleep(FORWARD_SECONDS)
        spans.append((start, time.perf_counter()))
        if not step.logit_rows:
            return None
        rows = torch.tensor(step.logit_rows)
        positions = torch.tensor(step.positions)[rows]
        key = ids[rows] * 1_000_003 + positions * 7_368_787
        tokens = (key ^ (key >> 13)) % (vocab - 3) + 3
        logits = torch.zeros(len(rows), vocab)
        logits[torch.arange(len(rows)), tokens] = 10.0
        return logits

    return forward


def _run(tiny_llama, overlap: bool):
    engine = LLM(str(tiny_llama), dtype="float32", overlap_scheduling=overlap).engine
    device = StreamDevice()
    engine.runner.device = device
    forwards: list[tuple[float, float]] = []
    engine.runner.forward = _scripted_forward(
        engine.runner, engine.model_config.vocab_size, forwards
    )
    schedules: list[tuple[float, float]] = []
    schedule = engine.scheduler.schedule

    def slow_schedule(offers):  # the host's work of a step
        start = time.perf_counter()
        time.sleep(HOST_SECONDS)
        out = schedule(offers)
        schedules.append((start, time.perf_counter()))
        return out

    engine.scheduler.schedule = slow_schedule
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(NUM_REQUESTS):
        engine.add_request(str(i), [5 + i, 9, 11 + 2 * i], params)
    outputs: dict[str, list[int]] = {}
    num_steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        num_steps += 1
    wall = time.perf_counter() - start
    assert device.num_synchronizations == engine.metrics.num_steps
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    return outputs, wall, forwards, schedules, engine.metrics


def test_an_overlapped_step_takes_max_not_sum(tiny_llama):
    plain, plain_wall, _, _, _ = _run(tiny_llama, overlap=False)
    got, wall, forwards, schedules, metrics = _run(tiny_llama, overlap=True)
    assert got == plain
    assert all(len(tokens) == MAX_TOKENS for tokens in got.values())
    assert metrics.num_overlapped_steps >= MAX_TOKENS - 2, vars(metrics)
    # The host scheduled the next step while the device ran one: most of the host's scheduling
    # time lies inside forwards (each is 40 ms of sleep; the rest of the host's work is less).
    inside = sum(max(0.0, min(s1, f1) - max(s0, f0)) for s0, s1 in schedules for f0, f1 in forwards)
    assert inside > 0.6 * sum(s1 - s0 for s0, s1 in schedules), (inside, schedules, forwards)
    # Side by side under the same load: the plain steps take forward + host, the overlapped
    # ones about max(forward, host), half of it here.
    assert wall < 0.8 * plain_wall, (wall, plain_wall)


def test_the_stream_device_runs_work_in_order():
    """The fake's premise: work is queued, not run by the caller, and runs in launch order."""
    device = StreamDevice()
    gate, order = threading.Event(), []
    first: Future = device.launch(lambda: (gate.wait(5), order.append(1)))
    second: Future = device.launch(lambda: order.append(2))
    assert not first.done() and order == []
    gate.set()
    second.result(5)
    assert order == [1, 2]
