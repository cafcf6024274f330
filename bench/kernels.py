"""How fast each CPU matmul formulation streams bfloat16 weights, side by side in one run.

Decode and verify steps are products of a few rows with large weights, so their speed is the
weight bandwidth. The weights of all 28 layers of Qwen2.5-Coder-1.5B's shapes are cycled through
so nothing sits in cache. Compared: our AVX2 kernel (engine/kernels, what
`engine.models.linears.linear` uses at any number of rows where it builds, so that a row's result
does not depend on what shares its step), F.linear (x @ W.T), torch.mv (one row), weight @ x.T
(the weight as the left operand) and float32 GEMMs over converted weight chunks
(`f32_chunked_linear`, not batch-invariant, shown for what invariance costs in prefill chunks,
where the product is compute-bound: GB/s x rows is the multiply-add rate).

--gguf times the GGUF block kernel instead (`quant_linear`, the shipped Q4_K_M's formats: Q4_K
for qkv, o and gate/up, Q6_K served as our Q6_K8 for down) at the rows of decode and verify
steps, in its AVX2 form (a child process started with SPECSERVE_CPU_ISA=avx2) and, where the CPU
has AVX-512, in the form this process takes (two rows per 16-lane register from 4 rows on).
--gguf --int8 puts the float32-activation product beside the int8-activation one
(`gguf_activations: int8`) and the dequantised-chunks route of prefills, with what r rows cost
in passes of 1 row.

    python -m bench.kernels [--rows 1 2 4 9 16 64 256]
    python -m bench.kernels --gguf [--rows 1 2 4 8 12 16]
    python -m bench.kernels --gguf --int8 [--rows 1 2 4 6 8 12 16 64 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import (
    cpu_kernels,
    dequantized_chunks_linear,
    f32_chunked_linear,
)

ROOT = Path(__file__).resolve().parents[1]
# (out, in) of the fused qkv, o, fused gate/up and down projections of one layer.
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
NUM_LAYERS = 28


def timed(fn, rounds: int = 3) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds


# GGML type ids of the formats the GGUF kernel multiplies by, and bytes per block of 256 weights.
Q4_K, Q6_K8, Q4_KT = 12, 1014, 1012
BLOCK_BYTES = {Q4_K: 144, Q6_K8: 274}


def random_blocks(rows: int, columns: int, qtype: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 [rows, bytes] of blocks with random quants and a normal float16 scale (d = 0.01, and
    dmin for Q4_K): the kernel's time does not depend on the values, only denormals would."""
    blocks = torch.randint(
        0, 256, (rows, columns // 256, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=generator
    )
    d = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    scale_at = (0, 2) if qtype == Q4_K else (272,)
    for offset in scale_at:
        blocks[:, :, offset : offset + 2] = d
    return blocks.reshape(rows, -1)


# The GGUF products by format: Q4_K_M's Q4_K projections (K = 1536) and its Q6_K8 down projection
# (K = 8960, so a batch of rows walks its columns in chunks).
GGUF_GROUPS = {"Q4_K": Q4_K, "Q6_K8": Q6_K8}


def gguf_rates(rows_list: list[int], product: str = "float32") -> dict[str, dict[int, float]]:
    """GB/s of blocks read by the GGUF product over all layers, per format and for all of them
    (the formats' bytes over the sum of their times), per activation row count. product: our
    kernel with float32 activations, with int8 ones, or (a prefill route) float32 GEMMs over
    dequantised chunks."""
    kernels = cpu_kernels()
    assert kernels is not None, "the GGUF kernel needs our CPU kernels"
    products = {
        "float32": kernels.quant_linear,
        # Q4_K served as Q4_KT, its weights in that product's order (random blocks either way).
        "int8": lambda x, w, qtype: kernels.quant_linear_int8(
            x, [w], [Q4_KT if qtype == Q4_K else qtype], None
        ),
        "dequantised chunks": dequantized_chunks_linear,
    }
    multiply = products[product]
    generator = torch.Generator().manual_seed(0)
    groups: dict[str, list[torch.Tensor]] = {name: [] for name in GGUF_GROUPS}
    for _ in range(NUM_LAYERS):
        for n, k in SHAPES:
            name = "Q4_K" if k == 1536 else "Q6_K8"
            groups[name].append(random_blocks(n, k, GGUF_GROUPS[name], generator))
    rates: dict[str, dict[int, float]] = {name: {} for name in (*GGUF_GROUPS, "all")}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for _, k in SHAPES}
        seconds = {}
        for name, weights in groups.items():
            qtype = GGUF_GROUPS[name]

            def one_pass(
                weights: list[torch.Tensor] = weights,
                qtype: int = qtype,
                xs: dict[int, torch.Tensor] = xs,
            ) -> None:
                for w in weights:
                    multiply(xs[w.shape[1] // BLOCK_BYTES[qtype] * 256], w, qtype)

            seconds[name] = min(timed(one_pass) for _ in range(2))
            rates[name][rows] = sum(w.numel() for w in weights) / seconds[name] / 1e9
        total = sum(w.numel() for weights in groups.values() for w in weights)
        rates["all"][rows] = total / sum(seconds.values()) / 1e9
    return rates


def gguf_main(rows_list: list[int], is_child: bool) -> None:
    if is_child:
        print(json.dumps(gguf_rates(rows_list)))
        return
    kernels = cpu_kernels()
    assert kernels is not None, "the GGUF kernel needs our CPU kernels"
    env = {**os.environ, "SPECSERVE_CPU_ISA": "avx2"}
    command = [sys.executable, "-m", "bench.kernels", "--gguf", "--child"]
    command += ["--rows", *map(str, rows_list)]
    # From the repository root, where `bench` is a package, wherever this process started.
    child = subprocess.run(command, env=env, cwd=ROOT, check=True, capture_output=True, text=True)
    avx2 = {
        name: {int(k): v for k, v in by_rows.items()}
        for name, by_rows in json.loads(child.stdout.splitlines()[-1]).items()
    }
    this = gguf_rates(rows_list) if kernels.quant_isa() != "avx2" else None
    isa = kernels.quant_isa()
    print(
        f"GGUF blocks, 28 layers of the 1.5B's shapes, GB/s read (higher is better); CPU form here: {isa}"
    )
    for name in avx2:
        print(f"{name}:")
        print(f"{'rows':>5} {'AVX2':>9} {isa:>9} {'ratio':>7}")
        for rows in rows_list:
            line = f"{rows:>5} {avx2[name][rows]:>9.2f}"
            if this is not None:
                ratio = this[name][rows] / avx2[name][rows]
                line += f" {this[name][rows]:>9.2f} {ratio:>6.2f}x"
            print(line)


def int8_main(rows_list: list[int]) -> None:
    """Float32 against int8 activations in this process, side by side, over all the formats:
    GB/s, and what a pass over the weights with r rows costs against one with 1 row (a verify
    step of r - 1 drafts against a decode step, in the linears)."""
    rates = {
        product: gguf_rates(rows_list, product)["all"]
        for product in ("float32", "int8", "dequantised chunks")
    }
    one = {product: by_rows[1] for product, by_rows in rates.items() if 1 in by_rows}
    print(
        "GGUF blocks, 28 layers of the 1.5B's shapes (Q4_K + Q6_K8), GB/s read (higher is "
        "better) and the cost of r rows in 1-row passes"
    )
    print(
        f"{'rows':>5} {'float32':>9} {'int8':>9} {'int8/f32':>9} {'f32 cost':>9} "
        f"{'int8 cost':>10} {'dequant. chunks':>16}"
    )
    for rows in rows_list:
        f32, i8, chunks = (rates[p][rows] for p in ("float32", "int8", "dequantised chunks"))
        line = f"{rows:>5} {f32:>9.2f} {i8:>9.2f} {i8 / f32:>8.2f}x"
        if one:
            line += f" {one['float32'] / f32:>9.2f} {one['int8'] / i8:>10.2f}"
        print(line + f" {chunks:>16.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernels", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rows", type=int, nargs="+")
    parser.add_argument(
        "--gguf", action="store_true", help="the GGUF block kernel, AVX2 and AVX-512"
    )
    parser.add_argument(
        "--int8", action="store_true", help="with --gguf: float32 against int8 activations"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gguf and args.int8:
        int8_main(args.rows or [1, 2, 4, 6, 8, 12, 16, 64, 256])
        return
    if args.gguf:
        gguf_main(args.rows or [1, 2, 4, 8, 12, 16], args.child)
        return
    args.rows = args.rows or [1, 2, 4, 9, 16, 64, 256]

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
