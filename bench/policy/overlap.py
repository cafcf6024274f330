"""An engine step's wall time over a device that runs beside the host, steps overlapped or in
series, modes off and auto, as the batch grows, where nothing drafts.

    python -m bench.policy.overlap [--sizes 8,64,256] [--steps 150] [--rounds 3] [--out FILE]

The CPU proxy of a GPU step: the engine of bench/policy/host_time.py (the real `LLMEngine` step
over a small random-weight Qwen2-shaped model whose forward is scripted: the forward's host work,
then a sleep of the H200-shaped step time, hash logits that n-gram lookups never predict), with
the forward's seconds queued on a device timeline that runs beside the host (a mark is when the
device reaches it, a wait sleeps until then), as a CUDA stream runs the kernels the host has
queued while the host goes on. In series every step is the forward plus the host's work;
overlapped (`overlap_scheduling`) the host schedules and builds step t+1
while the "device" runs step t, so a step should take about max(forward, host). Reported per mode,
size and overlap: the mean wall time of a step, the share of steps that overlapped and that
drafted, and what overlap and auto cost against off in series.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.processes import commit_of, write_result
from bench.policy.host_time import build_model, scripted_engine, step_model
from engine.policy.calibration_cache import cpu_name

ROOT = Path(__file__).resolve().parents[2]
MODES = ("off", "auto")


def timeline_device() -> Any:
    """A CPU device with a timeline of its own, as a CUDA stream has: a forward queues its
    scripted seconds (`enqueue`) and returns at once; a mark is the time the device will reach
    it, and `wait` sleeps until then. The host's work (building inputs, sampling, bookkeeping)
    runs on the host thread as it does on a GPU node; only the forward's seconds run beside."""
    from engine.runtime.device import Device

    class TimelineDevice(Device):
        def __init__(self) -> None:
            super().__init__("cpu")
            self.busy_until = 0.0

        def enqueue(self, seconds: float) -> None:
            self.busy_until = max(time.perf_counter(), self.busy_until) + seconds

        def mark(self) -> float:
            return max(time.perf_counter(), self.busy_until)

        def wait(self, mark: Any) -> None:
            self.num_synchronizations += 1
            time.sleep(max(0.0, float(mark) - time.perf_counter()))

    return TimelineDevice()


def time_steps(
    num_requests: int, mode: str, overlap: bool, steps: int, model_dir: str
) -> dict[str, float]:
    """Mean wall seconds of an engine step of `num_requests` decoding requests, and the shares
    of the timed steps that overlapped and that drafted."""
    engine = scripted_engine(num_requests, mode, steps, model_dir, overlap=overlap)
    engine.runner.device = timeline_device()
    for _ in range(64):  # prompts, then decodes while auto learns the lookups' acceptance
        engine.step()
    metrics, stats = engine.metrics, engine.policy_stats
    overlapped, decided = metrics.num_overlapped_steps, dict(stats.decisions)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    granted = stats.decisions.get(("speculate", "goodput"), 0) - decided.get(
        ("speculate", "goodput"), 0
    )
    return {
        "step_seconds": wall / steps,
        "overlapped_share": (metrics.num_overlapped_steps - overlapped) / steps,
        "granted_per_step": granted / steps,
    }


def time_all(sizes: list[int], steps: int, model_dir: str) -> dict[str, Any]:
    """time_steps for each overlap, mode and size: {"overlapped"|"serial": {mode: {size: ..}}}."""
    return {
        ("overlapped" if overlap else "serial"): {
            mode: {str(n): time_steps(n, mode, overlap, steps, model_dir) for n in sizes}
            for mode in MODES
        }
        for overlap in (True, False)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy.overlap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", default="8,64,256", help="decoding requests a step")
    parser.add_argument("--steps", type=int, default=150, help="steps timed per point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/overlap.json")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        for r in range(args.rounds):
            rounds.append(time_all(sizes, args.steps, model_dir))
            print(f"round {r + 1}: {rounds[-1]}", flush=True)

    def median(kind: str, mode: str, n: int, field: str) -> float:
        return statistics.median(run[kind][mode][str(n)][field] for run in rounds)

    kinds = ("overlapped", "serial")
    step_ms = {
        kind: {mode: {str(n): median(kind, mode, n, "step_seconds") * 1e3 for n in sizes}
               for mode in MODES}
        for kind in kinds
    }  # fmt: skip
    forward_ms = {str(n): _forward_ms(n) for n in sizes}
    serial_off = step_ms["serial"]["off"]
    result: dict[str, Any] = {
        "host": cpu_name(),
        "commit": commit_of(ROOT),
        "model": "tests/gpu/smoke/models.py TINY (Qwen2 shape, 320 tokens), float32, CPU",
        "forward_ms": forward_ms,
        "steps": args.steps,
        "rounds": args.rounds,
        "step_ms": step_ms,
        "overlapped_share": {
            mode: {str(n): median("overlapped", mode, n, "overlapped_share") for n in sizes}
            for mode in MODES
        },
        "granted_per_step": {
            kind: {
                mode: {str(n): median(kind, mode, n, "granted_per_step") for n in sizes}
                for mode in MODES
            }
            for kind in kinds
        },  # fmt: skip
        # A step's wall time against serial off's: below 1 is faster.
        "over_serial_off": {
            kind: {
                mode: {str(n): step_ms[kind][mode][str(n)] / serial_off[str(n)] for n in sizes}
                for mode in MODES
            }
            for kind in kinds
        },  # fmt: skip
    }
    write_result(args.out, result)
    return 0


def _forward_ms(num_requests: int) -> float:
    """The scripted forward's sleep in a decode step of num_requests rows (ms)."""
    return round(step_model().predict(num_requests, 0, num_requests) * 1e3, 3)


if __name__ == "__main__":
    sys.exit(main())
