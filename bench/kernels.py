"""How fast each CPU matmul formulation streams bfloat16 weights, side by side in one run.

Decode and verify steps are products of a few rows with large weights, so their speed is the
weight bandwidth. The weights of all 28 layers of Qwen2.5-Coder-1.5B's shapes are cycled through
so nothing sits in cache. Compared: our AVX2 kernel (engine/kernels, what
`engine.models.llama.linear` uses up to ALWAYS_ROWS rows where it builds), F.linear
(x @ W.T), torch.mv (one row), weight @ x.T (the weight as the left operand) and float32 GEMMs
over converted weight chunks (`f32_chunked_linear`). Past ALWAYS_ROWS rows (prefill chunks) the
product is compute-bound: GB/s x rows is the multiply-add rate, and the engine takes whichever of
ours, the float32 chunks and F.linear its start-up probe measures fastest (`prefill_route`).

    python bench/kernels.py [--rows 1 2 4 9 16 64 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.kernels import cpu_kernels, f32_chunked_linear  # noqa: E402

# (out, in) of the fused qkv, o, fused gate/up and down projections of one layer.
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
NUM_LAYERS = 28


def timed(fn, rounds: int = 3) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 9, 16, 64, 256])
    args = parser.parse_args()

    weights = [
        [torch.randn(n, k, dtype=torch.bfloat16) for n, k in SHAPES] for _ in range(NUM_LAYERS)
    ]
    total_bytes = sum(n * k * 2 for n, k in SHAPES) * NUM_LAYERS
    print(f"bfloat16 weights, {total_bytes / 1e9:.2f} GB per pass, GB/s read (higher is better)")
    kernels = cpu_kernels()
    print(f"{'rows':>5} {'ours':>9} {'F.linear':>9} {'mv':>9} {'W @ x.T':>9} {'f32 chunks':>11}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for _, k in SHAPES}

        def run(product, xs: dict[int, torch.Tensor] = xs) -> float:
            def one_pass() -> None:
                for layer in weights:
                    for w in layer:
                        product(xs[w.shape[1]], w)

            return total_bytes / timed(one_pass) / 1e9

        ours = run(lambda x, w: kernels.bf16_linear(x, w, None)) if kernels else float("nan")
        linear = run(lambda x, w: F.linear(x, w))
        left = run(lambda x, w: torch.mm(w, x.t()))
        mv = run(lambda x, w: torch.mv(w, x[0])) if rows == 1 else float("nan")
        chunks = run(lambda x, w: f32_chunked_linear(x, w))
        print(f"{rows:>5} {ours:>9.1f} {linear:>9.1f} {mv:>9.1f} {left:>9.1f} {chunks:>11.1f}")


if __name__ == "__main__":
    main()
