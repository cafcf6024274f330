"""What the sampler tests share: the EOS ids their sampler is built with, and a sampling row of
given params (by default over the prompt 1 3 3, with no output and no random key)."""

from __future__ import annotations

from engine.sampling.rows import SamplingRow
from engine.sampling_params import SamplingParams

EOS = (2, 7)


def _row(params: SamplingParams, prompt=(1, 3, 3), output=(), random_key=None) -> SamplingRow:
    return SamplingRow(params, tuple(prompt), tuple(output), random_key)
