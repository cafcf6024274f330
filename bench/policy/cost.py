"""What one decision of mode auto costs the host, per step, as the batch grows.

    python -m bench.policy.cost [--sizes 8,64,256] [--steps 200] [--against PATH] [--out FILE]

On a GPU the policy's decision runs on the host between forwards of a few milliseconds (an H200
measured auto's host-side step overhead at 6.2 ms against off's 0.9 at 64 requests, beside a
7-ms forward: bench/results/gpu-h200-bench.json), so its cost is part of whether speculation
pays. This times SpeculationPolicy.decide alone, in a step shaped like that node's: a step-time
fit with its figures (t(1) = 3.5 ms, flat to 8 tokens, 4.8 ms at 64; 0.2 us per KV read), 500
cached positions a sequence, n-gram and draft-model requests with acceptances spread over
0.2-0.95, the draft model behind on some of them, up to 5 drafts each. Each step's decision is
fed back (the policy's hold reads its last decisions), as the engine does.

`--against PATH` times the same steps with the engine package of another checkout (a worktree
of an earlier commit) in a subprocess, round by round alternating with this one, and reports the
ratio: the two versions side by side on one host.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common.processes import commit_of, side_by_side, write_result

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 500  # cached positions of each decoding sequence
MAX_DRAFTS = 5


def _policy(num_requests: int, seed: int):
    from engine.core.chunks import attention_reads
    from engine.core.request import Request
    from engine.core.schedule import Candidate, StepShape
    from engine.policy.policy import SpeculationPolicy
    from engine.policy.step_time import StepTimeModel
    from engine.sampling_params import SamplingParams

    grid = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    ms = [3.46, 3.47, 3.5, 3.9, 4.0, 4.3, 4.77, 6.0, 8.5, 13.0]
    model = StepTimeModel(grid, [m / 1e3 for m in ms], context_coef=2.0e-7, row_coef=2.0e-6)
    policy = SpeculationPolicy(
        "auto",
        MAX_DRAFTS,
        model,
        draft_forward_seconds=1.0e-3,
        catch_up_seconds_per_token=2.0e-6,
    )
    rng = random.Random(seed)
    candidates = []
    for i in range(num_requests):
        request = Request(f"r{i}", [1] * 16, SamplingParams(max_tokens=256), 256)
        request.output_token_ids.extend([5] * rng.randrange(1, 100))
        source = "draft_model" if i % 2 else "ngram"
        behind = rng.choice([0, 0, 0, rng.randrange(1, 600)]) if source == "draft_model" else 0
        candidates.append(Candidate(request, MAX_DRAFTS, source, num_catch_up=behind))
        # What the tracker has learned of each: acceptances spread over 0.2-0.95.
        alpha = rng.uniform(0.2, 0.95)
        for _ in range(20):
            accepted = 0
            while accepted < MAX_DRAFTS and rng.random() < alpha:
                accepted += 1
            policy.tracker.observe(candidates[-1].key, source, MAX_DRAFTS, accepted)
    reads = num_requests * attention_reads(CONTEXT, 1)
    shape = StepShape(num_requests, num_requests, reads, 4096, num_requests, float(CONTEXT))
    return policy, candidates, shape


def time_decisions(num_requests: int, steps: int, seed: int = 0) -> float:
    """Mean seconds of one decide() over `steps` steps of `num_requests` requests."""
    policy, candidates, shape = _policy(num_requests, seed)
    for _ in range(3):  # warm-up: the hold's last decisions exist from here on
        policy.decide(candidates, shape)
    start = time.perf_counter()
    for _ in range(steps):
        decisions = policy.decide(candidates, shape)
        for d in decisions:
            policy._last_k[f"{d.request_id}/{d.source}"] = d.num_draft_tokens
    return (time.perf_counter() - start) / steps


def time_sizes(sizes: list[int], steps: int) -> dict[str, float]:
    """time_decisions at each batch size, by size."""
    return {str(n): time_decisions(n, steps) for n in sizes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy.cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", default="8,64,256", help="decoding requests a step")
    parser.add_argument("--steps", type=int, default=200, help="decisions timed per size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout to time side by side")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/policy-cost.json")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    roots, rounds = side_by_side(
        args.against,
        args.rounds,
        "bench.policy.cost",
        "time_sizes",
        (sizes, args.steps),
        lambda got: ", ".join(f"{n}: {s * 1e3:.2f} ms" for n, s in got.items()),
    )
    result = {
        "host": platform.processor() or platform.machine(),
        "steps": args.steps,
        "rounds": args.rounds,
        "commits": {name: commit_of(root) for name, root in roots.items()},
        "median_ms": {
            name: {str(n): statistics.median(r[str(n)] for r in runs) * 1e3 for n in sizes}
            for name, runs in rounds.items()
        },
    }
    if args.against:
        result["against_over_this"] = {
            str(n): result["median_ms"]["against"][str(n)] / result["median_ms"]["this"][str(n)]
            for n in sizes
        }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
