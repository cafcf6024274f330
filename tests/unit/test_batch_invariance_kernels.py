"""Batch invariance of the CPU kernels, op by op: a row's result is bit-identical whatever the
number of rows M it is computed with and wherever it sits among them.

Every linear the model runs on a CPU (bfloat16 and float32 dense weights, the GGUF formats with
float32 and with int8 activations, fused projections mixing formats) and the paged attention
(a request's tokens in one prompt chunk, in chunks of any size, one at a time, beside other
requests' rows) are held to torch.equal against the row, or the token, computed alone. Where the
CPU has AVX-512 the same checks run again in a child process told SPECSERVE_CPU_ISA=avx2, so
both instruction sets are covered.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import kernels
from engine.attention.base import BatchLayout
from engine.attention.cpu_paged import CpuAttentionBackend
from engine.models.gguf import QuantTensor, int8_layout, serving_layout
from engine.models.linears import float32_linear, linear
from tests.gguf_models import Q, random_blocks

pytestmark = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)

# Rows per product: every count up to 40 (past the old 16-row switch of routes, through the
# kernels' tiles of 4, 6 and 8 and the 16-row blocks), and two prefill-sized ones.
ROW_COUNTS = [*range(1, 41), 64, 300]
OUT, IN = 96, 512  # enough weight rows for the threads to split them; IN a multiple of 256


def _quant(qtype: Q, rows: int, seed: int) -> QuantTensor:
    blocks = random_blocks(np.random.default_rng(seed), qtype, rows, IN)
    return serving_layout(QuantTensor(torch.from_numpy(blocks), int(qtype), IN))


def _products() -> dict[str, object]:
    """name -> x [M, IN] float32 -> [M, OUT]: every CPU linear the model takes."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(OUT, IN, generator=gen) * 0.05
    bias = torch.randn(OUT, generator=gen)
    bf16 = dense.bfloat16()
    products: dict[str, object] = {
        "bfloat16 weights, bfloat16 rows": lambda x: linear(x.bfloat16(), bf16, bias.bfloat16()),
        "bfloat16 weights, float32 rows (LM head)": lambda x: float32_linear(x, bf16),
        "float32 weights": lambda x: linear(x, dense, bias),
        "float32 weights (LM head)": lambda x: float32_linear(x, dense),
    }
    for i, qtype in enumerate((Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0)):
        for int8 in (False, True):
            part = _quant(qtype, OUT, seed=i)
            part = int8_layout(part) if int8 else part  # as the loader serves it
            name = f"{part.format} blocks, {'int8' if int8 else 'float32'} activations"
            products[name] = lambda x, p=part, int8=int8: kernels.quant_linear(
                x, [p.blocks], [p.qtype], bias, int8=int8
            )
    # A fused projection mixing formats, as Q4_K_M files store q/k/v: with int8 activations the
    # K-quant runs take the int8 product and the Q8_0 run the float32 one, in one call.
    mixed = [_quant(Q.Q4_K, 32, 10), _quant(Q.Q6_K, 16, 11), _quant(Q.Q8_0, 48, 12)]
    for int8 in (False, True):
        runs = [int8_layout(p) for p in mixed] if int8 else mixed
        products[f"mixed formats, {'int8' if int8 else 'float32'} activations"] = (
            lambda x, int8=int8, runs=runs: kernels.quant_linear(
                x, [p.blocks for p in runs], [p.qtype for p in runs], bias, int8=int8
            )
        )
    return products


PRODUCTS = _products()


def _check_linear(name: str) -> None:
    product = PRODUCTS[name]
    x = torch.randn(max(ROW_COUNTS) + 7, IN, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([product(x[i : i + 1]) for i in range(x.shape[0])])  # [rows, OUT]
    for rows in ROW_COUNTS:
        for first in (0, 7) if rows <= 40 else (0, 5):  # the same rows at other positions
            out = product(x[first : first + rows])
            assert torch.equal(out, alone[first : first + rows]), (name, rows, first)


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_a_linear_rows_result_does_not_depend_on_the_other_rows(name):
    _check_linear(name)


def _random_cache(
    num_blocks: int, block_size: int, dtype: torch.dtype, seed: int, kv_heads: int | None = None
):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads or KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


# head_dim 72: whole passes of 16, 32 or 64 value columns and a last one of 8.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 72, 4
PROMPT_LEN = 70


class _Request:
    """One request's query/K/V per position, and its blocks (scattered: every other block)."""

    def __init__(
        self,
        seed: int,
        first_block: int,
        dtype: torch.dtype,
        heads: int = HEADS,
        kv_heads: int = KV_HEADS,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.q = torch.randn(PROMPT_LEN, heads, HEAD_DIM, generator=gen).to(dtype)
        self.k = torch.randn(PROMPT_LEN, kv_heads, HEAD_DIM, generator=gen).to(dtype)
        self.v = torch.randn(PROMPT_LEN, kv_heads, HEAD_DIM, generator=gen).to(dtype)
        num_blocks = -(-PROMPT_LEN // BLOCK)
        self.table = tuple(first_block + 2 * i for i in range(num_blocks))

    def slots(self, start: int, end: int) -> list[int]:
        return [self.table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]


def _attend(steps, caches, dtype) -> dict[tuple[int, int], torch.Tensor]:
    """Run `steps` (each a list of (request index, request, start, end) chunks) through the CPU
    backend over `caches`; -> {(request index, position): output [HEADS, HEAD_DIM]}."""
    backend = CpuAttentionBackend()
    k_cache, v_cache = caches
    outputs = {}
    for chunks in steps:
        layout = BatchLayout(
            query_lens=tuple(end - start for _, _, start, end in chunks),
            seq_lens=tuple(end for _, _, _, end in chunks),
            block_tables=tuple(req.table for _, req, _, _ in chunks),
            slot_mapping=torch.tensor(
                [s for _, req, start, end in chunks for s in req.slots(start, end)]
            ),
            block_size=BLOCK,
        )
        q = torch.cat([req.q[start:end] for _, req, start, end in chunks])
        k = torch.cat([req.k[start:end] for _, req, start, end in chunks])
        v = torch.cat([req.v[start:end] for _, req, start, end in chunks])
        meta = backend.build_metadata(layout, torch.device("cpu"))
        out = backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
        row = 0
        for index, _, start, end in chunks:
            for p in range(start, end):
                outputs[index, p] = out[row]
                row += 1
    return outputs


def _chunked(index, req, sizes):
    chunks, start = [], 0
    for size in sizes:
        end = min(PROMPT_LEN, start + size)
        chunks.append([(index, req, start, end)])
        start = end
    assert start == PROMPT_LEN
    return chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Query heads per KV head 3, then 1 (multi-head), 2, 4, 7 and 8: the kernel shares each key row
# among up to 3 heads and each value row among up to 6, so each takes other passes.
@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(HEADS, KV_HEADS), (2, 2), (4, 2), (8, 2), (7, 1), (16, 2)]
)
def test_an_attention_tokens_output_does_not_depend_on_the_step(dtype, heads, kv_heads):
    """A request's 70 tokens attended one at a time (decode steps) are the reference; the same
    tokens in one prompt chunk, in chunks of many sizes (past 16 queries too), in verify-sized
    chunks, and beside other requests' decode rows and prompt chunks in the same steps, give the
    same bits."""
    num_blocks = 90
    a = _Request(0, 1, dtype, heads, kv_heads)
    b = _Request(1, 2, dtype, heads, kv_heads)  # its blocks interleave with a's
    c = _Request(2, 50, dtype, heads, kv_heads)

    def cache():
        return _random_cache(num_blocks, BLOCK, dtype, 9, kv_heads)

    one_by_one = _attend(_chunked(0, a, [1] * PROMPT_LEN), cache(), dtype)
    reference = torch.stack([one_by_one[0, p] for p in range(PROMPT_LEN)])

    def check(steps, what):
        out = _attend(steps, cache(), dtype)
        got = torch.stack([out[0, p] for p in range(PROMPT_LEN)])
        assert torch.equal(got, reference), what

    check(_chunked(0, a, [PROMPT_LEN]), "one prompt chunk")
    check(_chunked(0, a, [17, 40, 13]), "chunked prefill")
    check(_chunked(0, a, [33, 4, 5, 3, 8, 2, 15]), "prefill then verify chunks of 1 + k")
    # Beside others: b decodes one token a step (its prompt first, in one chunk), c's prompt
    # arrives in chunks of 23 while a is in its middle.
    steps = [[(0, a, 0, 20), (1, b, 0, 30)]]
    steps.append([(1, b, 30, 31), (0, a, 20, 37), (2, c, 0, 23)])
    steps.append([(2, c, 23, 46), (0, a, 37, 41), (1, b, 31, 32)])
    steps.append([(1, b, 32, 33), (2, c, 46, 69), (0, a, 41, 70)])
    check(steps, "beside other requests' decode rows and prompt chunks")


def test_the_avx2_path_is_batch_invariant_too():
    """Where the CPU has AVX-512 the products above took its forms; a child process told
    SPECSERVE_CPU_ISA=avx2 checks the AVX2 forms the same way."""
    module = kernels.cpu_kernels()
    if {module.cpu_isa(), module.quant_isa(), module.int8_isa()} == {"avx2"}:
        pytest.skip("this CPU runs the AVX2 forms already (the tests above covered them)")
    code = (
        "from tests.unit.test_batch_invariance_kernels import PRODUCTS, _check_linear\n"
        "for name in PRODUCTS: _check_linear(name)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "SPECSERVE_CPU_ISA": "avx2"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
