"""Structured outputs on the device: grammar masks built on the host, unpacked and applied on
the device's logits. At temperature 1 every output is valid against its schema with speculation
off, n-gram and a draft model; greedy output is the same JSON in all three (float32, so the
backends' rounding cannot part them)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine import LLM, SamplingParams
from engine.structured import StructuredOutput
from tests.gpu.node import TORCH_FP32, needs_device

pytestmark = [pytest.mark.gpu, needs_device, pytest.mark.gpu_check("structured outputs")]
jsonschema = pytest.importorskip("jsonschema")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "level": {"enum": ["low", "mid", "high"]},
        "ids": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "level", "ids"],
    "additionalProperties": False,
}
SETUPS: dict[str, dict[str, Any] | None] = {
    "off": {"method": "ngram", "mode": "off"},
    "ngram": {
        "method": "ngram",
        "mode": "always",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 1,
    },
    "draft_model": {"method": "draft_model", "mode": "always", "num_speculative_tokens": 3},
}
_GREEDY: dict[str, list[int]] = {}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_schema_valid_output_on_the_device(gpu_chat_model, device, setup) -> None:
    spec = SETUPS[setup]
    if spec is not None and spec["method"] == "draft_model":
        spec = {**spec, "model": str(gpu_chat_model)}  # itself: every draft verified
    llm = LLM(str(gpu_chat_model), **TORCH_FP32.engine_kwargs(device, speculative_config=spec))
    structured = StructuredOutput.json_schema(SCHEMA)
    sampled = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=120, structured=structured)
    greedy = SamplingParams(temperature=0.0, max_tokens=120, structured=structured)
    outs = llm.generate(["Describe a job as JSON.", "Another one."], [sampled, greedy])
    for c in outs[0].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    jsonschema.validate(json.loads(outs[1].outputs[0].text), SCHEMA)
    _GREEDY[setup] = outs[1].outputs[0].token_ids
    assert all(ids == next(iter(_GREEDY.values())) for ids in _GREEDY.values())
