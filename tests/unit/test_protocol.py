"""The OpenAI protocol layer: request validation to 400 envelopes, request -> SamplingParams,
token text/bytes for logprobs, and responses/chunks validated against the official OpenAPI spec.

The spec (../shared/openai/openapi.yaml beside the repo, or $SPECSERVE_OPENAPI) is loaded once per module;
its `$ref`s are resolved and OpenAPI's `nullable: true` rewritten into JSON Schema, and our
serialized bodies are checked with `jsonschema`. Tokenizers are trained here (no downloads).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.spec.stats import SpecStats
from server import errors, protocol
from server.engine_inputs import prediction_of, prompt_of, to_sampling_params, wants_spec_stats
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from server.response_builders import (
    ChatStream,
    CompletionStream,
    ResponseMeta,
    build_chat_response,
    build_completion_response,
    usage_of,
)
from server.responses import ModelCard, ModelList
from server.token_text import TextOffsets, TokenDecoder
from tests.openapi_spec import SPEC_PATH, to_json_schema
from tests.tiny_tokenizers import byte_level_bpe, llama_byte_fallback

jsonschema = pytest.importorskip("jsonschema")

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Un café naïve, déjà vu — résumé!",
    "中文 文本 测试 你好 🙂 smile 🙂🙂",
] * 10
TEXT = "Hello café 中文 🙂 world"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
DROP = object()  # a patch value that removes the key


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    if not SPEC_PATH.is_file():
        pytest.skip(f"OpenAPI spec not found at {SPEC_PATH}")
    yaml = pytest.importorskip("yaml")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with SPEC_PATH.open(encoding="utf-8") as f:
        return yaml.load(f, Loader=loader)["components"]["schemas"]


def _validator(schemas: dict[str, Any], name: str) -> Any:
    schema = to_json_schema(schemas[name], schemas, (name,))
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def validators(openapi) -> dict[str, Any]:
    names = [
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "CreateCompletionResponse",
        "ListModelsResponse",
        "ErrorResponse",
    ]
    found = {name: _validator(openapi, name) for name in names}
    # The spec shares one schema between completions responses and chunks, but a chunk's
    # finish_reason is null until the last one (as OpenAI streams it): allow null there.
    chunk = copy.deepcopy(openapi["CreateCompletionResponse"])
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]["nullable"] = True
    chunk["properties"]["usage"] = {"$ref": "#/x/CompletionUsage", "nullable": True}
    found["CompletionChunk"] = jsonschema.Draft202012Validator(to_json_schema(chunk, openapi))
    return found


def _check(validator: Any, model: Any) -> dict[str, Any]:
    body = json.loads(model.model_dump_json())
    errors_found = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    assert not errors_found, [f"{list(e.path)}: {e.message}" for e in errors_found]
    return body


def _byte_level() -> PreTrainedTokenizerFast:
    return byte_level_bpe(CORPUS, 300, ["<|endoftext|>"])


def _llama_byte_fallback() -> PreTrainedTokenizerFast:
    return llama_byte_fallback(CORPUS, 120)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level()


@pytest.fixture(scope="module", params=["byte_level", "llama_byte_fallback"])
def any_tokenizer(request) -> PreTrainedTokenizerFast:
    return {"byte_level": _byte_level, "llama_byte_fallback": _llama_byte_fallback}[request.param]()


# --------------------------------------------------------------------------- bad requests


def _body(base: dict[str, Any], **patch: Any) -> dict[str, Any]:
    body = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


USER = {"role": "user", "content": "hi"}
IMAGE = {"type": "image_url", "image_url": {"url": "x"}}
# (id, fields patched into a good body, expected param)
CHAT_CASES = [
    ("n-str", {"n": "1"}, "n"),
    ("n-bool", {"n": True}, "n"),
    ("n-float", {"n": 1.0}, "n"),
    ("n-zero", {"n": 0}, "n"),
    ("n-over-max", {"n": protocol.N_MAX + 1}, "n"),
    ("n-huge", {"n": 10**30}, "n"),
    ("max-tokens-float", {"max_tokens": 1.5}, "max_tokens"),
    ("max-tokens-zero", {"max_tokens": 0}, "max_tokens"),
    ("max-tokens-neg", {"max_tokens": -5}, "max_tokens"),
    ("max-completion-str", {"max_completion_tokens": "10"}, "max_completion_tokens"),
    ("stream-yes", {"stream": "yes"}, "stream"),
    ("stream-int", {"stream": 1}, "stream"),
    ("temperature-high", {"temperature": 2.5}, "temperature"),
    ("temperature-neg", {"temperature": -0.1}, "temperature"),
    ("temperature-str", {"temperature": "0.5"}, "temperature"),
    ("temperature-nan", {"temperature": math.nan}, "temperature"),
    ("top-p-high", {"top_p": 1.5}, "top_p"),
    ("presence-high", {"presence_penalty": 3}, "presence_penalty"),
    ("frequency-low", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("logprobs-int", {"logprobs": 1}, "logprobs"),
    ("top-logprobs-21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top-logprobs-alone", {"top_logprobs": 5}, "top_logprobs"),
    ("top-logprobs-false", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("seed-65-bits", {"seed": 2**64}, "seed"),
    ("seed-below-int64", {"seed": -(2**63) - 1}, "seed"),
    ("seed-str", {"seed": "42"}, "seed"),
    ("messages-empty", {"messages": []}, "messages"),
    ("messages-missing", {"messages": DROP}, "messages"),
    ("messages-str", {"messages": "hi"}, "messages"),
    ("message-not-object", {"messages": [5]}, "messages.0"),
    ("role-missing", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("role-unknown", {"messages": [USER, {"role": "bot", "content": "x"}]}, "messages.1.role"),
    ("role-tool", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ("content-missing", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("content-int", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("content-no-parts", {"messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ("content-image", {"messages": [{"role": "user", "content": [IMAGE]}]}, "messages.0.content"),
    (
        "assistant-null-content",
        {"messages": [USER, {"role": "assistant", "content": None}]},
        "messages.1.content",
    ),
    (
        "assistant-tool-calls",
        {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
        "messages.0.tool_calls",
    ),
    ("stop-5", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop-empty-string", {"stop": [""]}, "stop"),
    ("stop-int", {"stop": 5}, "stop"),
    ("stop-list-of-int", {"stop": ["a", 1]}, "stop"),
    ("stop-too-long", {"stop": "x" * 513}, "stop"),
    ("stream-options-alone", {"stream_options": {"include_usage": True}}, "stream_options"),
    (
        "stream-options-stream-false",
        {"stream": False, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    (
        "include-usage-str",
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
    ),
    ("tools", {"tools": [{"type": "function"}]}, "tools"),
    ("tool-choice", {"tool_choice": "auto"}, "tool_choice"),
    ("functions", {"functions": [{"name": "f"}]}, "functions"),
    ("function-call", {"function_call": "auto"}, "function_call"),
    ("audio", {"audio": {"voice": "alloy"}}, "audio"),
    ("modalities-audio", {"modalities": ["audio"]}, "modalities.0"),
    ("json-schema", {"response_format": {"type": "json_schema"}}, "response_format.type"),
    ("json-object", {"response_format": {"type": "json_object"}}, "response_format.type"),
    ("format-unknown", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("logit-bias-key", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit-bias-unicode-digit", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ("logit-bias-range", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("logit-bias-str", {"logit_bias": {"5": "1"}}, "logit_bias.5"),
    ("logit-bias-many", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("prediction-no-content", {"prediction": {"type": "content"}}, "prediction.content"),
    ("prediction-type", {"prediction": {"type": "x", "content": "x"}}, "prediction.type"),
    ("model-missing", {"model": DROP}, "model"),
    ("model-int", {"model": 5}, "model"),
    ("top-k", {"top_k": -2}, "top_k"),
    ("min-p", {"min_p": 1.5}, "min_p"),
    ("repetition-zero", {"repetition_penalty": 0}, "repetition_penalty"),
    ("min-tokens-neg", {"min_tokens": -1}, "min_tokens"),
    ("ignore-eos-str", {"ignore_eos": "true"}, "ignore_eos"),
    ("stop-token-neg", {"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ("speculation-str", {"speculation": {"enabled": "no"}}, "speculation.enabled"),
    (
        "speculation-neg",
        {"speculation": {"max_draft_tokens": -1}},
        "speculation.max_draft_tokens",
    ),
    (
        "speculation-max-float",
        {"speculation": {"max_draft_tokens": 2.0}},
        "speculation.max_draft_tokens",
    ),
    (
        "speculation-max-bool",
        {"speculation": {"max_draft_tokens": True}},
        "speculation.max_draft_tokens",
    ),
    ("speculation-stats-str", {"speculation": {"return_stats": "yes"}}, "speculation.return_stats"),
    ("speculation-unknown-key", {"speculation": {"max_drafts": 2}}, "speculation.max_drafts"),
    ("speculation-not-object", {"speculation": True}, "speculation"),
    ("speculation-list", {"speculation": [{"enabled": False}]}, "speculation"),
]
COMPLETION_CASES = [
    ("prompt-empty", {"prompt": ""}, "prompt"),
    ("prompt-empty-list", {"prompt": []}, "prompt"),
    ("prompt-empty-ids", {"prompt": [[]]}, "prompt"),
    ("prompt-mixed", {"prompt": [1, "a"]}, "prompt"),
    ("prompt-negative-id", {"prompt": [-1]}, "prompt"),
    ("prompt-bool-ids", {"prompt": [True]}, "prompt"),
    ("prompt-int", {"prompt": 5}, "prompt"),
    ("prompt-missing", {"prompt": DROP}, "prompt"),
    ("prompts-too-many", {"prompt": ["a"] * 65}, "prompt"),
    ("echo", {"echo": True}, "echo"),
    ("suffix", {"suffix": "x"}, "suffix"),
    ("best-of", {"best_of": 3}, "best_of"),
    ("completion-logprobs-6", {"logprobs": 6}, "logprobs"),
    ("completion-logprobs-bool", {"logprobs": True}, "logprobs"),
    ("completion-max-tokens", {"max_tokens": 1.5}, "max_tokens"),
    ("completion-n-str", {"n": "2"}, "n"),
    (
        "completion-speculation-neg",
        {"speculation": {"max_draft_tokens": -3}},
        "speculation.max_draft_tokens",
    ),
    (
        "completion-speculation-unknown",
        {"speculation": {"enabled": False, "stats": True}},
        "speculation.stats",
    ),
    ("completion-speculation-enabled-int", {"speculation": {"enabled": 0}}, "speculation.enabled"),
]
NAN_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
# Whole bodies that are wrong, sent raw (or, for the list, already decoded).
RAW_CASES = [
    ("array-body", ChatCompletionRequest, b"[1, 2]", None),
    ("string-body", ChatCompletionRequest, b'"hello"', None),
    ("null-body", CompletionRequest, b"null", None),
    ("malformed-json", ChatCompletionRequest, b'{"model": "m", ', None),
    ("empty-body", ChatCompletionRequest, b"", None),
    ("decoded-list", ChatCompletionRequest, ["not", "an", "object"], None),
    ("json-nan", ChatCompletionRequest, NAN_BODY, "temperature"),
    ("json-float-n", CompletionRequest, b'{"model": "m", "prompt": "x", "n": 2.0}', "n"),
]
BAD_BODIES = (
    [
        (name, ChatCompletionRequest, _body(CHAT, **patch), param)
        for name, patch, param in CHAT_CASES
    ]
    + [
        (name, CompletionRequest, _body(COMPLETION, **patch), param)
        for name, patch, param in COMPLETION_CASES
    ]
    + RAW_CASES
)


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_bodies_are_400_with_param(model, body, param):
    with pytest.raises(errors.OpenAIError) as info:
        parse_request(model, body)
    err = info.value
    assert err.status == 400
    envelope = err.body()
    assert set(envelope) == {"error"}
    assert set(envelope["error"]) == {"message", "type", "param", "code"}
    assert envelope["error"]["type"] == "invalid_request_error"
    assert envelope["error"]["param"] == param
    assert envelope["error"]["message"]
    if param is not None:
        assert f"'{param}'" in envelope["error"]["message"]


def test_table_is_large_and_ids_unique():
    ids = [case[0] for case in BAD_BODIES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)


def test_same_errors_for_decoded_and_raw_bodies():
    # The route may hand either bytes or a decoded dict: both paths must agree.
    for _, model, body, param in BAD_BODIES:
        if isinstance(body, dict):
            with pytest.raises(errors.OpenAIError) as info:
                parse_request(model, json.dumps(body, allow_nan=True).encode())
            assert info.value.param == param


@pytest.mark.parametrize(
    ("model", "body", "code"),
    [
        (ChatCompletionRequest, _body(CHAT, tools=[{"type": "function"}]), "unsupported_parameter"),
        (
            ChatCompletionRequest,
            _body(CHAT, response_format={"type": "json_object"}),
            "unsupported_value",
        ),
        (CompletionRequest, _body(COMPLETION, suffix="x"), "unsupported_parameter"),
        (CompletionRequest, _body(COMPLETION, echo=True), "unsupported_value"),
        (ChatCompletionRequest, _body(CHAT, n="1"), None),
    ],
)
def test_unsupported_features_have_a_code(model, body, code):
    with pytest.raises(errors.OpenAIError) as info:
        parse_request(model, body)
    assert info.value.code == code
    if code is not None:
        assert "not supported" in info.value.message


def test_n_max_is_read_at_validation_time(monkeypatch):
    monkeypatch.setattr(protocol, "N_MAX", 2)
    with pytest.raises(errors.OpenAIError):
        parse_request(ChatCompletionRequest, _body(CHAT, n=3))
    assert parse_request(ChatCompletionRequest, _body(CHAT, n=2)).n == 2


# --------------------------------------------------------------------------- good requests


def test_chat_request_to_sampling_params():
    body = _body(
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
            parse_request(ChatCompletionRequest, _body(CHAT, **patch)), default_max_tokens=None
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


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_spec_stats_are_opt_in(model):
    base = CHAT if model is ChatCompletionRequest else COMPLETION
    opted_in = parse_request(model, _body(base, speculation={"return_stats": True}))
    assert opted_in.speculation is not None and opted_in.speculation.enabled is True
    assert wants_spec_stats(opted_in, server_default=False)
    for speculation in (DROP, None, {}, {"enabled": True, "return_stats": False}):
        req = parse_request(model, _body(base, speculation=speculation))
        assert not wants_spec_stats(req, server_default=False)
        assert wants_spec_stats(req, server_default=True)
    params = to_sampling_params(
        parse_request(model, _body(base, speculation={"enabled": False, "max_draft_tokens": 3})),
        default_max_tokens=None,
    )
    assert (params.speculate, params.max_draft_tokens) == (False, 3)


@pytest.mark.parametrize(
    ("seed", "engine_seed"),
    [(0, 0), (2**63 - 1, 2**63 - 1), (-1, 2**64 - 1), (-(2**63), 2**63)],
)
def test_seed_maps_int64_into_unsigned_64_bits(seed, engine_seed):
    req = parse_request(ChatCompletionRequest, _body(CHAT, seed=seed))
    assert to_sampling_params(req, default_max_tokens=None).seed == engine_seed


def test_completion_request_to_sampling_params():
    req = parse_request(CompletionRequest, _body(COMPLETION, logprobs=3, n=2, best_of=2))
    params = to_sampling_params(req, default_max_tokens=99)
    assert (params.logprobs, params.n, params.max_tokens) == (3, 2, 16)  # spec default: 16
    req = parse_request(CompletionRequest, _body(COMPLETION, max_tokens=None))
    assert to_sampling_params(req, default_max_tokens=99).max_tokens == 99


def test_invalid_combination_raises_value_error_with_param():
    req = parse_request(ChatCompletionRequest, _body(CHAT, min_tokens=5, max_tokens=2))
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
    body = _body(
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
            prompt_of(parse_request(CompletionRequest, _body(COMPLETION, prompt=prompt)))
            == expected
        )


def test_unknown_fields_are_tolerated_and_listed():
    body = _body(
        CHAT,
        messages=[USER, {"role": "assistant", "content": "x", "refusal": None}],
        store=True,
        reasoning_effort="low",
        stream=True,
        stream_options={"include_usage": True, "mystery": 1},
    )
    req = parse_request(ChatCompletionRequest, body)
    assert sorted(protocol.unknown_fields(req)) == [
        "messages.1.refusal",
        "reasoning_effort",
        "store",
        "stream_options.mystery",
    ]
    assert protocol.unknown_fields(parse_request(ChatCompletionRequest, CHAT)) == []


# --------------------------------------------------------------------------- token text


def test_token_bytes_rebuild_the_text(any_tokenizer):
    tokens = TokenDecoder(any_tokenizer)
    ids = any_tokenizer.encode(TEXT, add_special_tokens=False)
    rebuilt = b"".join(tokens.token_bytes(t) for t in ids)
    # The Llama-style normalizer writes a leading "▁" that the full decode strips.
    assert rebuilt.decode() in (TEXT, " " + TEXT)
    assert any(len(tokens.token_bytes(t)) == 1 and tokens.token_bytes(t)[0] >= 0x80 for t in ids)


def test_token_text_of_partial_and_whole_tokens(byte_level):
    tokens = TokenDecoder(byte_level)
    assert tokens.is_byte_level
    for token_id in byte_level.encode(TEXT, add_special_tokens=False):
        raw = tokens.token_bytes(token_id)
        try:
            whole = raw.decode("utf-8")
        except UnicodeDecodeError:
            assert "\ufffd" in tokens.token_text(token_id)
        else:
            assert tokens.token_text(token_id) == whole == byte_level.decode([token_id])
    eos = byte_level.eos_token_id
    assert (tokens.token_text(eos), tokens.token_bytes(eos)) == ("<|endoftext|>", b"<|endoftext|>")


def test_text_offsets_point_at_each_token(byte_level):
    tokens = TokenDecoder(byte_level)
    ids = byte_level.encode(TEXT, add_special_tokens=False)
    offsets = TextOffsets(tokens)
    split = len(ids) // 2
    streamed = offsets.advance(ids[:split]) + offsets.advance(ids[split:])
    assert streamed == TextOffsets(tokens).advance(ids)
    assert offsets.position == len(TEXT)
    assert streamed == sorted(streamed) and streamed[0] == 0
    for token_id, offset in zip(ids, streamed, strict=True):
        text = tokens.token_text(token_id)
        if "\ufffd" not in text:
            assert TEXT[offset : offset + len(text)] == text


# --------------------------------------------------------------------------- responses


META = ResponseMeta("chatcmpl-test", "tiny", 1_700_000_000)
CMPL_META = ResponseMeta("cmpl-test", "tiny", 1_700_000_000)


def _entries(ids: list[int], num_top: int) -> list[TokenLogprob]:
    # The top list deliberately holds a -inf logprob: JSON has no -inf.
    top_ids = tuple(range(num_top))
    top_logprobs = (-0.1, *([-math.inf] * num_top))[:num_top]
    return [TokenLogprob(t, -0.25 * (i + 1), top_ids, top_logprobs) for i, t in enumerate(ids)]


def _output(
    tokenizer,
    text: str,
    num_tokens: int | None = None,
    *,
    logprobs: int | None = None,
    finish: str | None = "stop",
    n: int = 1,
) -> RequestOutput:
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids if num_tokens is None else ids[:num_tokens]
    completions = []
    for i in range(n):
        stats = SpecStats(num_prediction_accepted=3, num_prediction_rejected=2)
        completions.append(
            CompletionOutput(
                index=i,
                text=text if num_tokens is None else tokenizer.decode(ids).rstrip("\ufffd"),
                token_ids=list(ids),
                logprobs=None if logprobs is None else _entries(ids, logprobs),
                finish_reason=finish,
                num_cached_tokens=4,
                spec_stats=stats,
            )
        )
    return RequestOutput(
        "r", "prompt", [1, 2, 3, 4, 5, 6], completions, finished=finish is not None
    )


def test_chat_response_matches_spec(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    output = _output(byte_level, TEXT, logprobs=2, n=2)
    body = _check(
        validators["CreateChatCompletionResponse"], build_chat_response(META, output, tokens)
    )
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-test"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": TEXT, "refusal": None}
    assert choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == TEXT
    assert content[1]["logprob"] == -0.5
    assert [top["logprob"] for top in content[0]["top_logprobs"]] == [-0.1, -9999.0]
    assert body["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 2 * len(content),
        "total_tokens": 6 + 2 * len(content),
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 6,
            "rejected_prediction_tokens": 4,
        },
    }
    plain = build_chat_response(META, _output(byte_level, "hi", finish="length"), tokens)
    body = _check(validators["CreateChatCompletionResponse"], plain)
    assert (
        body["choices"][0]["logprobs"] is None and body["choices"][0]["finish_reason"] == "length"
    )


def test_aborted_output_has_no_response(byte_level):
    with pytest.raises(ValueError, match="abort"):
        build_chat_response(
            META, _output(byte_level, "hi", finish="abort"), TokenDecoder(byte_level)
        )


def _steps(tokenizer, text: str, sizes: list[int], **kw: Any) -> list[RequestOutput]:
    """Cumulative engine outputs emitting `text`'s tokens in steps of the given sizes."""
    num_ids = len(tokenizer.encode(text, add_special_tokens=False))
    cuts, total = [], 0
    for size in sizes * num_ids:
        total = min(total + size, num_ids)
        cuts.append(total)
        if total == num_ids:
            break
    outputs = [_output(tokenizer, text, cut, finish=None, **kw) for cut in cuts[:-1]]
    return outputs + [_output(tokenizer, text, **kw)]


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_matches_spec_and_adds_up(validators, byte_level, include_usage):
    tokens = TokenDecoder(byte_level)
    stream = ChatStream(META, tokens, include_usage=include_usage)
    steps = _steps(byte_level, TEXT, [1, 3, 2], logprobs=1, n=2)
    chunks = [chunk for step in steps for chunk in stream.chunks(step)]
    usage_chunk = stream.usage_chunk()
    assert (usage_chunk is None) != include_usage
    bodies = [_check(validators["CreateChatCompletionStreamResponse"], c) for c in chunks]
    for index in (0, 1):
        mine = [b["choices"][0] for b in bodies if b["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "stop"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert "".join(c["delta"].get("content", "") for c in mine) == TEXT
        entries = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert bytes(b for e in entries for b in e["bytes"]).decode() == TEXT
    assert all(b["usage"] is None and b["object"] == "chat.completion.chunk" for b in bodies)
    if include_usage:
        body = _check(validators["CreateChatCompletionStreamResponse"], usage_chunk)
        assert body["choices"] == [] and body["usage"] == usage_of([steps[-1]]).model_dump()


def test_chat_stream_survives_skipped_outputs(byte_level):
    # The bridge may merge engine outputs: the builder works from cumulative fields.
    stream = ChatStream(META, TokenDecoder(byte_level))
    steps = _steps(byte_level, TEXT, [2], logprobs=0)
    chunks = stream.chunks(steps[1]) + stream.chunks(steps[-1]) + stream.chunks(steps[-1])
    deltas = [c.choices[0].delta for c in chunks]
    assert [d.role for d in deltas] == ["assistant", None, None, None]
    assert "".join(d.content or "" for d in deltas) == TEXT
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == len(steps[-1].outputs[0].token_ids)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_completion_response_matches_spec(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    outputs = [
        _output(byte_level, TEXT, logprobs=2, n=2),
        _output(byte_level, "hi", n=2, finish="length"),
    ]
    response = build_completion_response(CMPL_META, outputs, tokens)
    body = _check(validators["CreateCompletionResponse"], response)
    assert body["object"] == "text_completion"
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, TEXT),
        (1, TEXT),
        (2, "hi"),
        (3, "hi"),
    ]
    logprobs = body["choices"][0]["logprobs"]
    num_tokens = len(byte_level.encode(TEXT, add_special_tokens=False))
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == num_tokens
    assert logprobs["text_offset"] == TextOffsets(tokens).advance(
        byte_level.encode(TEXT, add_special_tokens=False)
    )
    # Each position's map: the 2 alternatives (distinct texts) plus the sampled token.
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"])
    assert all(math.isfinite(v) for top in logprobs["top_logprobs"] for v in top.values())
    assert body["usage"]["prompt_tokens"] == 12 and body["choices"][2]["logprobs"] is None


def test_completion_stream_matches_spec_and_adds_up(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    stream = CompletionStream(CMPL_META, tokens, n=1, include_usage=True)
    chunks = []
    for step in _steps(byte_level, TEXT, [2, 1], logprobs=0):
        chunks += stream.chunks(step, prompt_index=1)
    bodies = [_check(validators["CompletionChunk"], c) for c in chunks]
    assert {b["choices"][0]["index"] for b in bodies} == {1}
    assert "".join(b["choices"][0]["text"] for b in bodies) == TEXT
    assert [b["choices"][0]["finish_reason"] for b in bodies][-2:] == [None, "stop"]
    offsets = [o for b in bodies for o in b["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == TextOffsets(tokens).advance(byte_level.encode(TEXT, add_special_tokens=False))
    final = _check(validators["CompletionChunk"], stream.usage_chunk())
    assert final["choices"] == [] and final["usage"]["total_tokens"] == 6 + len(offsets)


def _spec(records: list[tuple[int, int]]) -> SpecStats:
    """Counters after verify steps of (draft tokens, accepted drafts)."""
    stats = SpecStats()
    for num_draft_tokens, num_accepted in records:
        stats.record(num_draft_tokens, num_accepted, "ngram")
    return stats


def _with_spec(outputs: list[RequestOutput], by_index: list[SpecStats | None]) -> None:
    for output in outputs:
        for c in output.outputs:
            c.spec_stats = by_index[c.index]


# Choice 0: 4 verify steps accepting 4, 1, 0, 1 of 4, 4, 3, 4 drafts; choice 1 never drafted.
SPEC_RECORDS = [(4, 4), (4, 1), (3, 0), (4, 1)]
SPEC_0 = {
    "mean_acceptance_length": 2.5,  # 1 + 6 / 4
    "draft_acceptance_rate": 0.4,  # 6 / 15
    "num_spec_steps": 4,
    "num_draft_tokens": 15,
    "num_accepted_draft_tokens": 6,
    "acceptance_histogram": [1, 2, 0, 0, 1],
}
SPEC_NONE = {
    "mean_acceptance_length": 0.0,
    "draft_acceptance_rate": 0.0,
    "num_spec_steps": 0,
    "num_draft_tokens": 0,
    "num_accepted_draft_tokens": 0,
    "acceptance_histogram": [],
}


def test_spec_stats_on_each_choice_only_when_asked(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    output = _output(byte_level, TEXT, n=2)
    _with_spec([output], [_spec(SPEC_RECORDS), None])
    name = "CreateChatCompletionResponse"
    body = _check(validators[name], build_chat_response(META, output, tokens, True))
    assert [c["speculative_decoding_stats"] for c in body["choices"]] == [SPEC_0, SPEC_NONE]
    body = _check(validators[name], build_chat_response(META, output, tokens))
    assert all("speculative_decoding_stats" not in c for c in body["choices"])

    outputs = [_output(byte_level, TEXT, n=2), _output(byte_level, "hi", n=2)]
    _with_spec(outputs, [SpecStats(), _spec(SPEC_RECORDS)])
    name = "CreateCompletionResponse"
    body = _check(validators[name], build_completion_response(CMPL_META, outputs, tokens, True))
    found = [c["speculative_decoding_stats"] for c in body["choices"]]
    assert found == [SPEC_NONE, SPEC_0, SPEC_NONE, SPEC_0]
    body = _check(validators[name], build_completion_response(CMPL_META, outputs, tokens))
    assert all("speculative_decoding_stats" not in c for c in body["choices"])


@pytest.mark.parametrize("include_spec_stats", [False, True])
def test_streams_send_spec_stats_with_the_finish_reason(validators, byte_level, include_spec_stats):
    tokens = TokenDecoder(byte_level)
    steps = _steps(byte_level, TEXT, [1, 3, 2], n=2)
    _with_spec(steps, [_spec(SPEC_RECORDS), SpecStats()])
    expected = [SPEC_0, SPEC_NONE]
    chat = ChatStream(META, tokens, include_spec_stats=include_spec_stats)
    bodies = [
        _check(validators["CreateChatCompletionStreamResponse"], chunk)
        for step in steps
        for chunk in chat.chunks(step)
    ]
    completion = CompletionStream(CMPL_META, tokens, n=2, include_spec_stats=include_spec_stats)
    bodies += [
        _check(validators["CompletionChunk"], chunk)
        for step in steps
        for chunk in completion.chunks(step, prompt_index=1)
    ]
    choices = [b["choices"][0] for b in bodies]
    with_stats = [c for c in choices if "speculative_decoding_stats" in c]
    if not include_spec_stats:
        assert with_stats == []
        return
    # One per choice per stream, on the chunk with the finish reason; completions index 2 + i.
    assert [(c["index"], c["finish_reason"]) for c in with_stats] == [
        (0, "stop"),
        (1, "stop"),
        (2, "stop"),
        (3, "stop"),
    ]
    assert [c["speculative_decoding_stats"] for c in with_stats] == expected * 2
    assert sum(c["finish_reason"] is not None for c in choices) == 4


def test_models_and_errors_match_spec(validators):
    card = ModelCard(id="tiny", created=1, quantization="gguf (Q4_K + Q6_K)")
    body = _check(validators["ListModelsResponse"], ModelList(data=[card]))
    assert body == {
        "object": "list",
        "data": [
            {
                "id": "tiny",
                "object": "model",
                "created": 1,
                "owned_by": "specserve",
                "quantization": "gguf (Q4_K + Q6_K)",  # ours, beside the spec's fields
            }
        ],
    }
    for err in (
        errors.invalid_request("bad", "n"),
        errors.authentication_error(),
        errors.model_not_found("gpt-9"),
        errors.not_found(),
        errors.request_too_large(1024),
        errors.rate_limited(2.5),
        errors.server_overloaded(1.0, status=503),
        errors.internal_error("req-1"),
    ):
        found = list(validators["ErrorResponse"].iter_errors(err.body()))
        assert not found, found


def test_error_helpers():
    assert (
        errors.model_not_found("x").status == 404 and errors.model_not_found("x").param == "model"
    )
    assert (errors.authentication_error().status, errors.authentication_error().type) == (
        401,
        "authentication_error",
    )
    assert errors.request_too_large(10).status == 413
    limited = errors.rate_limited(2.5)
    assert (limited.status, limited.code, limited.headers) == (
        429,
        "rate_limit_exceeded",
        {"Retry-After": "3"},
    )
    assert errors.server_overloaded(0.1).headers == {"Retry-After": "1"}
    with pytest.raises(ValueError):
        errors.server_overloaded(1.0, status=500)
    internal = errors.internal_error()
    assert internal.status == 500 and internal.type == "server_error"
    assert errors.error_body("m", param="p") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": None}
    }
