"""Valid requests into engine inputs: chat and completion requests -> SamplingParams (defaults,
the model's sampling defaults, seeds, opt-in speculation stats), the prompt and the predicted
output of a request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.models.generation_defaults import GenerationDefaults
from server import errors
from server.engine_inputs import prediction_of, prompt_of, to_sampling_params, wants_spec_stats
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from tests.unit.protocol.helpers import CHAT, COMPLETION, DROP, patched_body


def test_chat_request_to_sampling_params():
    body = patched_body(
        CHAT,
        temperature=0.7,
        top_p=0.9,
        n=3,
        stop=["a", "b"],
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"5": -100, "7": 2.5},
        logprobs=True,
        top_logprobs=3,
        max_tokens=10,
        max_completion_tokens=20,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[9],
        skip_special_tokens=False,
        speculation={"enabled": False, "max_draft_tokens": 0},
    )
    req = parse_request(ChatCompletionRequest, json.dumps(body))
    params = to_sampling_params(req, default_max_tokens=None)
    assert (params.temperature, params.top_p, params.n) == (0.7, 0.9, 3)
    assert params.stop == ("a", "b") and params.seed == 42
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)
    assert dict(params.logit_bias) == {5: -100.0, 7: 2.5}
    assert params.logprobs == 3
    assert params.max_tokens == 20  # max_completion_tokens wins over max_tokens
    assert (params.top_k, params.min_p, params.repetition_penalty) == (40, 0.05, 1.1)
    assert (params.min_tokens, params.ignore_eos, params.stop_token_ids) == (2, True, (9,))
    assert params.skip_special_tokens is False
    assert (params.speculate, params.max_draft_tokens) == (False, 0)
    assert not wants_spec_stats(req, server_default=False)
    assert wants_spec_stats(req, server_default=True)


def test_defaults_and_single_mappings():
    req = parse_request(ChatCompletionRequest, CHAT)
    params = to_sampling_params(req, default_max_tokens=123)
    assert params.max_tokens == 123 and params.logprobs is None and params.seed is None
    assert (params.temperature, params.top_p, params.n, params.stop) == (1.0, 1.0, 1, ())
    assert params.skip_special_tokens is True and params.ignore_eos is False
    assert to_sampling_params(req, default_max_tokens=None).max_tokens is None

    def params_of(**patch: Any):
        return to_sampling_params(
            parse_request(ChatCompletionRequest, patched_body(CHAT, **patch)),
            default_max_tokens=None,
        )

    assert params_of(max_tokens=7).max_tokens == 7
    assert params_of(max_tokens=10**12).max_tokens == 10**12  # the engine checks the context
    assert params_of(logprobs=True).logprobs == 0
    assert params_of(logprobs=False).logprobs is None
    assert params_of(stop="x").stop == ("x",)
    assert params_of(temperature=1).temperature == 1.0  # a JSON integer is a fine number
    greedy = params_of(top_p=0, temperature=0.8)
    assert (greedy.temperature, greedy.top_p, greedy.is_greedy) == (0.0, 1.0, True)
    assert (params.speculate, params.max_draft_tokens) == (True, None)
    capped = params_of(speculation={"max_draft_tokens": 2})
    assert (capped.speculate, capped.max_draft_tokens) == (True, 2)
    assert params_of(speculation={"enabled": False}).speculate is False
    assert params_of(speculation=None).speculate is True


MODEL_DEFAULTS = GenerationDefaults(
    temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1
)


def _sampling(params) -> tuple[float, float, int, float, float]:
    return (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty)


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_model_defaults_fill_only_the_fields_a_request_leaves_out(model):
    base = CHAT if model is ChatCompletionRequest else COMPLETION

    def params_of(defaults: GenerationDefaults | None = MODEL_DEFAULTS, **patch: Any):
        req = parse_request(model, patched_body(base, **patch))
        if defaults is None:
            return to_sampling_params(req, default_max_tokens=None)
        return to_sampling_params(req, default_max_tokens=None, defaults=defaults)

    assert _sampling(params_of()) == (0.6, 0.9, 20, 0.05, 1.1)
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    assert _sampling(params_of(**dict.fromkeys(names))) == (0.6, 0.9, 20, 0.05, 1.1)  # null
    # Explicit values win, the neutral ones too, field by field.
    neutral = params_of(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)
    assert _sampling(neutral) == (1.0, 1.0, 0, 0.0, 1.0)
    assert _sampling(params_of(temperature=0, top_k=-1)) == (0.0, 0.9, 0, 0.05, 1.1)
    assert params_of(top_p=0).is_greedy  # top_p 0 is greedy whatever the model's temperature
    # A model without defaults, and none given: OpenAI's (and the extensions' neutral values).
    assert _sampling(params_of(None)) == (1.0, 1.0, 0, 0.0, 1.0)
    assert _sampling(params_of(GenerationDefaults())) == (1.0, 1.0, 0, 0.0, 1.0)
    greedy_model = GenerationDefaults(temperature=0.0)
    assert params_of(greedy_model).is_greedy
    assert params_of(greedy_model, temperature=0.8).temperature == 0.8


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_spec_stats_are_opt_in(model):
    base = CHAT if model is ChatCompletionRequest else COMPLETION
    opted_in = parse_request(model, patched_body(base, speculation={"return_stats": True}))
    assert opted_in.speculation is not None and opted_in.speculation.enabled is True
    assert wants_spec_stats(opted_in, server_default=False)
    for speculation in (DROP, None, {}, {"enabled": True, "return_stats": False}):
        req = parse_request(model, patched_body(base, speculation=speculation))
        assert not wants_spec_stats(req, server_default=False)
        assert wants_spec_stats(req, server_default=True)
    params = to_sampling_params(
        parse_request(
            model, patched_body(base, speculation={"enabled": False, "max_draft_tokens": 3})
        ),
        default_max_tokens=None,
    )
    assert (params.speculate, params.max_draft_tokens) == (False, 3)


@pytest.mark.parametrize(
    ("seed", "engine_seed"),
    [(0, 0), (2**63 - 1, 2**63 - 1), (-1, 2**64 - 1), (-(2**63), 2**63)],
)
def test_seed_maps_int64_into_unsigned_64_bits(seed, engine_seed):
    req = parse_request(ChatCompletionRequest, patched_body(CHAT, seed=seed))
    assert to_sampling_params(req, default_max_tokens=None).seed == engine_seed


def test_completion_request_to_sampling_params():
    req = parse_request(CompletionRequest, patched_body(COMPLETION, logprobs=3, n=2, best_of=2))
    params = to_sampling_params(req, default_max_tokens=99)
    assert (params.logprobs, params.n, params.max_tokens) == (3, 2, 16)  # spec default: 16
    # An explicit null is the endpoint's default too, not "up to the end of the context".
    req = parse_request(CompletionRequest, patched_body(COMPLETION, max_tokens=None))
    assert req.max_tokens == 16
    assert to_sampling_params(req, default_max_tokens=None).max_tokens == 16
    assert to_sampling_params(req, default_max_tokens=99).max_tokens == 16


def test_invalid_combination_raises_value_error_with_param():
    req = parse_request(ChatCompletionRequest, patched_body(CHAT, min_tokens=5, max_tokens=2))
    with pytest.raises(ValueError) as info:
        to_sampling_params(req, default_max_tokens=None)
    err = errors.from_value_error(info.value, ChatCompletionRequest.model_fields)
    assert (err.status, err.param) == (400, "min_tokens")
    err = errors.from_value_error(ValueError("messages[2].role must be one of ..."), {"messages"})
    assert err.param == "messages.2.role"
    assert (
        errors.from_value_error(ValueError("this model has no chat template"), {"n"}).param is None
    )


def test_prompt_of_and_prediction_of():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache": 1}]
    body = patched_body(
        CHAT,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": parts, "name": "bob"},
        ],
        prediction={"type": "content", "content": parts},
    )
    req = parse_request(ChatCompletionRequest, body)
    assert prompt_of(req) == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert prediction_of(req) == "ab"
    assert prediction_of(parse_request(ChatCompletionRequest, CHAT)) is None
    cases = [
        ("x", ["x"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        (["a", "b"], ["a", "b"]),
    ]
    for prompt, expected in cases:
        assert (
            prompt_of(parse_request(CompletionRequest, patched_body(COMPLETION, prompt=prompt)))
            == expected
        )
