"""What the CPU paged-attention kernel costs a layer, at the shapes of served steps.

    python -m bench.attention [--context 600] [--rounds 15] [--against PATH] [--out FILE]

Times `paged_attention` (engine/kernels/cpu_layer.cpp) at the default model's shape (12 query
heads, 2 KV heads of 128 dimensions, 16-token blocks; float32 cache): one request's verify
chunk of 1 to 6 tokens after `--context` cached positions, and decode steps of 4 and 16
requests, one token each. In a served step each layer's keys and values come from memory, the
layer's weights having streamed through the cache since the last step read them, so the timed
calls cycle over 28 layers' caches and read a 32 MiB buffer before each: the figure is
microseconds per layer, cold, as the step pays it.

`--against PATH` times the same shapes with the kernels of another checkout (a worktree of an
earlier commit; each checkout builds its own) in a subprocess, round by round alternating with
this one, and reports the ratio: the two versions side by side on one host.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.common.processes import commit_of, side_by_side, write_result

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 12, 2, 128, 16, 28
FLUSH_BYTES = 32 << 20
# (name, query tokens per request, requests)
SHAPES = [*((f"verify {n}", n, 1) for n in range(1, 7)), ("decode x4", 1, 4), ("decode x16", 1, 16)]


def time_shapes(context: int, repeats: int) -> dict[str, float]:
    """Median seconds per layer of each shape over `repeats` passes over the layers."""
    import torch

    from engine.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels are unavailable here")
    gen = torch.Generator().manual_seed(0)
    per_request = -(-(context + 8) // BLOCK)
    most = max(requests for _, _, requests in SHAPES)
    num_blocks = per_request * most
    caches = [
        tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        for _ in range(LAYERS)
    ]
    flush = torch.zeros(FLUSH_BYTES // 4)
    out: dict[str, float] = {}
    for name, num_query, num_requests in SHAPES:
        tokens = num_query * num_requests
        query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
        value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
        # Request r's blocks every `most`-th one, so requests' blocks interleave as they come to.
        tables = torch.tensor(
            [[r + most * b for b in range(per_request)] for r in range(num_requests)],
            dtype=torch.int32,
        )
        seq_len = context + num_query
        slots = torch.tensor(
            [
                int(tables[r, p // BLOCK]) * BLOCK + p % BLOCK
                for r in range(num_requests)
                for p in range(context, seq_len)
            ],
            dtype=torch.int64,
        )
        seq_lens = torch.full((num_requests,), seq_len, dtype=torch.int32)
        starts = torch.arange(0, tokens + 1, num_query, dtype=torch.int32)
        passes = []
        for _ in range(repeats):
            total = 0.0
            for k_cache, v_cache in caches:
                flush[::16].add_(1.0)  # every cache line of the buffer read and written
                start = time.perf_counter()
                kernels.paged_attention(
                    query, key, value, k_cache, v_cache, slots, tables, seq_lens, starts,
                    HEAD_DIM**-0.5,
                )  # fmt: skip
                total += time.perf_counter() - start
            passes.append(total / LAYERS)
        out[name] = statistics.median(passes)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--context", type=int, default=600, help="cached positions a request")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the layers a round")
    parser.add_argument("--against", type=Path, help="another checkout to time side by side")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/attention.json")
    args = parser.parse_args(argv)
    roots, rounds = side_by_side(
        args.against,
        args.rounds,
        "bench.attention",
        "time_shapes",
        (args.context, args.repeats),
        lambda got: ", ".join(f"{s}: {t * 1e6:.0f} us" for s, t in got.items()),
    )
    shapes = [name for name, _, _ in SHAPES]
    result = {
        "host": platform.processor() or platform.machine(),
        "context": args.context,
        "rounds": args.rounds,
        "commits": {name: commit_of(root) for name, root in roots.items()},
        "median_us_per_layer": {
            name: {s: round(statistics.median(r[s] for r in runs) * 1e6, 1) for s in shapes}
            for name, runs in rounds.items()
        },
    }
    if args.against:
        medians = result["median_us_per_layer"]
        result["against_over_this"] = {
            s: round(medians["against"][s] / medians["this"][s], 3) for s in shapes
        }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
