"""Non-streamed response shapes, validated against the official OpenAPI spec: chat and completion
responses, speculation stats per choice, the model list and the error envelopes."""

from __future__ import annotations

import math

import pytest

from engine.core.counters import SpecStats
from server import errors
from server.response_bodies import ModelCard, ModelList
from server.response_builders import build_chat_response, build_completion_response
from server.token_bytes import TextOffsets, TokenDecoder
from tests.unit.protocol.helpers import (
    CMPL_META,
    META,
    SPEC_0,
    SPEC_NONE,
    SPEC_RECORDS,
    TEXT,
    check_body,
    make_output,
    spec_stats_of,
    with_spec_stats,
)


def test_chat_response_matches_spec(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    output = make_output(byte_level, TEXT, logprobs=2, n=2)
    body = check_body(
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
    plain = build_chat_response(META, make_output(byte_level, "hi", finish="length"), tokens)
    body = check_body(validators["CreateChatCompletionResponse"], plain)
    assert (
        body["choices"][0]["logprobs"] is None and body["choices"][0]["finish_reason"] == "length"
    )


def test_aborted_output_has_no_response(byte_level):
    with pytest.raises(ValueError, match="abort"):
        build_chat_response(
            META, make_output(byte_level, "hi", finish="abort"), TokenDecoder(byte_level)
        )


def test_completion_response_matches_spec(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    outputs = [
        make_output(byte_level, TEXT, logprobs=2, n=2),
        make_output(byte_level, "hi", n=2, finish="length"),
    ]
    response = build_completion_response(CMPL_META, outputs, tokens)
    body = check_body(validators["CreateCompletionResponse"], response)
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


def test_spec_stats_on_each_choice_only_when_asked(validators, byte_level):
    tokens = TokenDecoder(byte_level)
    (output,) = with_spec_stats(
        [make_output(byte_level, TEXT, n=2)], [spec_stats_of(SPEC_RECORDS), None]
    )
    name = "CreateChatCompletionResponse"
    body = check_body(validators[name], build_chat_response(META, output, tokens, True))
    assert [c["speculative_decoding_stats"] for c in body["choices"]] == [SPEC_0, SPEC_NONE]
    body = check_body(validators[name], build_chat_response(META, output, tokens))
    assert all("speculative_decoding_stats" not in c for c in body["choices"])

    outputs = [make_output(byte_level, TEXT, n=2), make_output(byte_level, "hi", n=2)]
    outputs = with_spec_stats(outputs, [SpecStats(), spec_stats_of(SPEC_RECORDS)])
    name = "CreateCompletionResponse"
    body = check_body(validators[name], build_completion_response(CMPL_META, outputs, tokens, True))
    found = [c["speculative_decoding_stats"] for c in body["choices"]]
    assert found == [SPEC_NONE, SPEC_0, SPEC_NONE, SPEC_0]
    body = check_body(validators[name], build_completion_response(CMPL_META, outputs, tokens))
    assert all("speculative_decoding_stats" not in c for c in body["choices"])


def test_models_and_errors_match_spec(validators):
    card = ModelCard(id="tiny", created=1, quantization="gguf (Q4_K + Q6_K)")
    body = check_body(validators["ListModelsResponse"], ModelList(data=[card]))
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
