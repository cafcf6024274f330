"""Per-request bounds are server settings: the prompt list, stop strings, logit_bias entries,
the sequences a request fans out into and the tokens it may ask for. Each violation is a 400
naming the field as `param` and the setting in its message; the defaults let a normal client
through."""

from __future__ import annotations

import pytest

from server import errors
from server.cli import build_parser
from server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from server.request_limits import DEFAULT_LIMITS, RequestLimits, check_requested_tokens
from server.settings import Settings, load_settings
from tests.unit.protocol.helpers import CHAT, COMPLETION, patched_body

CONTEXT_32K = 32768


def _rejected(model, body, limits=None) -> errors.OpenAIError:
    with pytest.raises(errors.OpenAIError) as info:
        parse_request(model, body, limits)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def test_fan_out_over_the_sequence_limit_is_400_naming_n_and_the_setting():
    error = _rejected(CompletionRequest, patched_body(COMPLETION, prompt=["a"] * 64, n=16))
    assert error.param == "n"
    assert "1024 sequences" in error.message and "max_sequences_per_request" in error.message
    # The defaults take a full prompt list once, and every chat n.
    assert parse_request(CompletionRequest, patched_body(COMPLETION, prompt=["a"] * 64)).n is None
    assert parse_request(CompletionRequest, patched_body(COMPLETION, prompt=["a"] * 4, n=16))
    assert parse_request(ChatCompletionRequest, patched_body(CHAT, n=16)).n == 16
    limits = RequestLimits(max_sequences_per_request=3)
    assert _rejected(ChatCompletionRequest, patched_body(CHAT, n=4), limits).param == "n"
    many_prompts = patched_body(COMPLETION, prompt=["a", "b", "c", "d"])
    assert _rejected(CompletionRequest, many_prompts, limits).param == "prompt"
    assert parse_request(CompletionRequest, patched_body(COMPLETION, n=3), limits).n == 3


@pytest.mark.parametrize(
    ("setting", "model", "patch", "param"),
    [
        ("max_prompts_per_request", CompletionRequest, {"prompt": ["a"] * 3}, "prompt"),
        ("max_stop_sequences", ChatCompletionRequest, {"stop": ["a", "b", "c"]}, "stop"),
        (
            "max_logit_bias",
            CompletionRequest,
            {"logit_bias": {"1": 1, "2": 1, "3": 1}},
            "logit_bias",
        ),
        ("max_sequences_per_request", ChatCompletionRequest, {"n": 3}, "n"),
    ],
)
def test_each_bound_comes_from_its_setting(setting, model, patch, param):
    base = CHAT if model is ChatCompletionRequest else COMPLETION
    body = patched_body(base, **patch)
    assert parse_request(model, body)  # the defaults allow it
    settings = Settings(model="m", **{setting: 2})
    error = _rejected(model, body, settings.request_limits())
    assert error.param == param and setting in error.message and "at most 2" in error.message
    assert parse_request(model, body, Settings(model="m", **{setting: 3}).request_limits())


def test_settings_defaults_are_the_limits_defaults_and_flags_exist():
    assert Settings(model="m").request_limits() == DEFAULT_LIMITS
    flags = [
        "--max-prompts-per-request", "5", "--max-sequences-per-request", "6",
        "--max-tokens-per-request", "7", "--max-stop-sequences", "2", "--max-logit-bias", "9",
    ]  # fmt: skip
    args = build_parser().parse_args(["serve", "--model", "m", *flags])
    limits = load_settings(None, args, environ={}).request_limits()
    assert limits == RequestLimits(5, 2, 9, 6, 7)
    with pytest.raises(ValueError, match="max_stop_sequences"):
        load_settings(None, {"model": "m", "max_stop_sequences": 0}, environ={})


def _check(limits, **kw) -> None:
    check_requested_tokens(limits, CONTEXT_32K, **kw)


def test_requested_tokens_count_the_context_left_when_chat_sets_no_max_tokens():
    # A chat request with n up to 8 and no max_tokens passes the default on a 32k model.
    for n in range(1, 9):
        _check(DEFAULT_LIMITS, n=n, max_tokens=None, prompt_lens=[20], param="max_tokens")
    with pytest.raises(errors.OpenAIError) as info:
        _check(DEFAULT_LIMITS, n=9, max_tokens=None, prompt_lens=[20], param="max_tokens")
    error = info.value
    assert (error.status, error.param) == (400, "max_tokens")
    assert f"{9 * (CONTEXT_32K - 20)} tokens" in error.message
    assert "max_tokens_per_request" in error.message and str(8 * CONTEXT_32K) in error.message
    # An explicit max_tokens counts as itself, per prompt and copy.
    limits = RequestLimits(max_tokens_per_request=1000)
    _check(limits, n=2, max_tokens=250, prompt_lens=[0, 0], param="max_tokens")
    with pytest.raises(errors.OpenAIError, match="1002 tokens") as info:
        _check(limits, n=2, max_tokens=167, prompt_lens=[0, 0, 0], param="max_completion_tokens")
    assert info.value.param == "max_completion_tokens"
    # A prompt that fills the context leaves nothing to count (the engine rejects it).
    _check(limits, n=16, max_tokens=None, prompt_lens=[CONTEXT_32K], param="max_tokens")


def test_limits_are_checked_when_built():
    with pytest.raises(ValueError, match="max_logit_bias"):
        RequestLimits(max_logit_bias=0)
