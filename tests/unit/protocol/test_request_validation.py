"""Request validation: every malformed or unsupported body becomes a 400 envelope naming the
offending param, the same whether the body arrives raw or decoded; unknown fields are tolerated
and listed."""

from __future__ import annotations

import json
import math

import pytest

from server import errors, protocol
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from tests.unit.protocol.helpers import CHAT, COMPLETION, DROP, patched_body

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
    ("json-schema-without-schema", {"response_format": {"type": "json_schema"}}, "response_format"),
    (
        "json-schema-bad-name",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
        "response_format.json_schema.name",
    ),
    ("format-unknown", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("format-null", {"response_format": None}, "response_format"),
    ("user-null", {"user": None}, "user"),
    (
        "name-null",
        {"messages": [{"role": "user", "content": "hi", "name": None}]},
        "messages.0.name",
    ),
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
        (name, ChatCompletionRequest, patched_body(CHAT, **patch), param)
        for name, patch, param in CHAT_CASES
    ]
    + [
        (name, CompletionRequest, patched_body(COMPLETION, **patch), param)
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
        (
            ChatCompletionRequest,
            patched_body(CHAT, tools=[{"type": "function"}]),
            "unsupported_parameter",
        ),
        (CompletionRequest, patched_body(COMPLETION, suffix="x"), "unsupported_parameter"),
        (CompletionRequest, patched_body(COMPLETION, echo=True), "unsupported_value"),
        (ChatCompletionRequest, patched_body(CHAT, n="1"), None),
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
        parse_request(ChatCompletionRequest, patched_body(CHAT, n=3))
    assert parse_request(ChatCompletionRequest, patched_body(CHAT, n=2)).n == 2


def test_unknown_fields_are_tolerated_and_listed():
    body = patched_body(
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
