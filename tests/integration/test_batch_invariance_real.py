"""Batch invariance on the bundled SmolLM2-135M-Instruct in the forms it is served in on a CPU
(bfloat16 and float32 dense weights, its GGUF file's Q4_1/Q8_0 blocks with either
gguf_activations): every position's logits are bit-identical through every step shape
(tests/integration/test_batch_invariance.py says which)."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.integration.test_batch_invariance import BLOCK, check_step_shapes
from tests.smollm2 import ON_SMOLLM2_WITH_KERNELS

pytestmark = ON_SMOLLM2_WITH_KERNELS

FORMS = {
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "float32": dict(dtype="float32", quantization="none"),
    "gguf": dict(dtype="float32", quantization="gguf", gguf_activations="float32"),
    "gguf int8 activations, bfloat16": dict(
        dtype="bfloat16", quantization="gguf", gguf_activations="int8"
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_positions_logits_are_the_same_in_every_step_shape(form):
    llm = LLM(
        "smollm2-135m-instruct",
        block_size=BLOCK,
        num_kv_blocks=64,
        max_model_len=256,
        **FORMS[form],
    )
    check_step_shapes(llm)
