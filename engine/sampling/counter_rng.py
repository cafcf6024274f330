"""Counter-based random numbers: the uniforms of every row of a step in one batched computation.

A row of randomness is named by a 64-bit key (a request's seed mixed with the output position and
the stream, `Request.random_key`), and its values are a pure function of that key and the column:

    uniform[row, col] = f(keys[row], col)

so a seeded request's draws depend on (seed, position, stream, column) only: not on the rows
beside it, their order or count, nor on the device (only integer ops and exact float ops produce
them, and every device does those alike). There is no generator state: nothing advances, so a
step's draws for all its rows are one computation of about twenty elementwise ops, on a GPU one
launch each whatever the number of rows, where a torch.Generator per row costs an object and a
launch per row (about 10 ms of host time at 64 requests). The host runs the same ops over
cache-sized blocks of rows (`_block_rows`).

f is SplitMix64's output function at state key + (pair + 1) * gamma, each 64-bit output giving
two uniforms: bits 0..22 make column 2 * pair, bits 32..54 column 2 * pair + 1. Consecutive pairs
of one key are SplitMix64's own sequence, which passes BigCrush; distinct keys walk that sequence
from unrelated offsets (keys are hashes, `Request.random_key`), so two rows share a value with
odds of about columns / 2^63. The int64 tensors hold the 64-bit words in two's complement: sums
and products wrap modulo 2^64 as the words do, and right shifts are made logical with a mask.

A uniform is (h + 0.5) * 2^-23 for its 23 bits h: exact in float32, strictly inside (0, 1), so
-log(U) is finite and positive without a floor (within [6e-8, 16.7]). Only the logarithm of
`exponentials` is left to each device's math library (CPU and CUDA may differ in its last bit).

On the host it costs less than the per-row generators did: 16 rows x 151,936 columns of Exp(1)
noise took about 12 ms against 18 ms on one thread of the 2-core AVX2 host, 7 against 12 ms on
two (best of 40; 64 rows: 82 against 90 ms, 54 against 74 ms).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.runtime.device import to_device

_MASK64 = (1 << 64) - 1
_BITS = 23  # per uniform: two per 64-bit word, each exact in float32's 24-bit significand


def _int64(word: int) -> int:
    """A 64-bit word as the int64 value with the same bits (torch scalars are signed)."""
    word &= _MASK64
    return word - (1 << 64) if word >> 63 else word


_GAMMA = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
# (shift of the xor-shift, multiplier after it; None: the last step has none)
_ROUNDS = ((30, _MIX1), (27, _MIX2), (31, None))
# Bits 0..22 and 32..54 of a word: the mantissas of its two float32 halves.
_MANTISSAS = ((1 << _BITS) - 1) * (1 + (1 << 32))
_ONES = 0x3F800000 * (1 + (1 << 32))  # float32 1.0 in both halves
_ONE_LESS_HALF_ULP = 1.0 - 2.0**-24
_HOST_BLOCK_WORDS = 1 << 18  # 2 MiB of int64


def uniforms(keys: torch.Tensor, num_columns: int, first_column: int = 0) -> torch.Tensor:
    """keys [num_rows] int64 -> [num_rows, num_columns] float32 uniforms in (0, 1): column c of
    the result is column first_column + c of each key's sequence. On the keys' device."""
    if num_columns < 0 or first_column < 0:
        raise ValueError(f"columns must be non-negative, got {first_column} and {num_columns}.")
    num_rows, device = keys.shape[0], keys.device
    if num_rows == 0 or num_columns == 0:  # an empty result has no words to view
        return torch.empty((num_rows, num_columns), dtype=torch.float32, device=device)
    first_pair = first_column // 2
    num_pairs = (first_column + num_columns + 1) // 2 - first_pair
    pairs = torch.arange(first_pair + 1, first_pair + 1 + num_pairs, device=device)
    pairs.mul_(_GAMMA)  # [num_pairs], each pair's step from the key
    words = torch.empty((num_rows, num_pairs), dtype=torch.int64, device=device)
    block = _block_rows(device, num_rows, num_pairs)
    spare = torch.empty((block, num_pairs), dtype=torch.int64, device=device)
    for start in range(0, num_rows, block):
        rows = words[start : start + block]  # [<= block, num_pairs]
        _splitmix(rows, keys[start : start + block], pairs, spare[: rows.shape[0]])
        # Each 32-bit half becomes the float32 1.m with 23 random mantissa bits m, in [1, 2);
        # the halves are columns 2 * pair (low) and 2 * pair + 1 (high) on little-endian devices.
        rows.bitwise_and_(_MANTISSAS).bitwise_or_(_ONES)
    ones = words.view(torch.float32)  # [num_rows, 2 * num_pairs], in [1, 2)
    start = first_column - 2 * first_pair
    # 1.m - (1 - 2^-24) = (m + 0.5) * 2^-23, exact (Sterbenz).
    return ones[:, start : start + num_columns].sub_(_ONE_LESS_HALF_ULP)


def exponentials(keys: torch.Tensor, num_columns: int, first_column: int = 0) -> torch.Tensor:
    """[num_rows, num_columns] float32 E = -log(U) ~ Exp(1), from `uniforms` of the same
    columns: positive and finite (U is never 0 nor 1)."""
    return uniforms(keys, num_columns, first_column).log_().neg_()


def row_keys(keys: Sequence[int | None], device: torch.device) -> torch.Tensor:
    """[num_rows] int64 keys on `device` from host keys; a None row gets a fresh random key, all
    of them from one draw of torch's default (host) generator. One copy to the device."""
    host = torch.tensor(
        [0 if k is None else _int64(k) for k in keys], dtype=torch.int64, device="cpu"
    )
    fresh = [i for i, k in enumerate(keys) if k is None]
    if fresh:
        index = torch.tensor(fresh, dtype=torch.int64, device="cpu")
        bound = 1 << 62  # any 63-bit pattern: keys need only be distinct, not positive
        host[index] = torch.randint(-bound, bound, (len(fresh),), dtype=torch.int64, device="cpu")
    return to_device(host, device)


def _block_rows(device: torch.device, num_rows: int, num_pairs: int) -> int:
    """Rows that go through the rounds together. A GPU takes all of them (one launch per op for
    the step); the host takes blocks of about _HOST_BLOCK_WORDS words, which stay in cache
    through the dozen passes (measured at 64 rows x 151,936 columns: about half the time of
    passes over all rows at once). The values do not depend on the blocks: every op is
    elementwise and exact."""
    if device.type != "cpu":
        return num_rows
    return max(1, min(num_rows, _HOST_BLOCK_WORDS // num_pairs))


def _splitmix(
    out: torch.Tensor, keys: torch.Tensor, pairs: torch.Tensor, spare: torch.Tensor
) -> None:
    """out [n, num_pairs] int64 = SplitMix64's output at state keys[row] + pairs[col] (keys [n],
    pairs [num_pairs]); spare, like out, is scratch."""
    torch.add(keys.to(torch.int64).unsqueeze(1), pairs, out=out)
    for shift, multiplier in _ROUNDS:
        torch.bitwise_right_shift(out, shift, out=spare)
        out.bitwise_xor_(spare.bitwise_and_((1 << (64 - shift)) - 1))
        if multiplier is not None:
            out.mul_(multiplier)
