"""Chat templates with tools: tools reach the template, an assistant turn's calls are rendered
with their arguments as a JSON object (not the JSON string the API carries), tool results keep
their place; bad calls are refused. On a byte-level BPE trained in the test with the tests' own
ChatML tools template, and on Qwen2.5's template where that model is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import apply_chat_template
from tests.tiny_tokenizers import CHATML_SPECIALS, SAMPLE_CORPUS, byte_level_bpe

TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "chatml_tools.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]
CALL_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def tools_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = byte_level_bpe(SAMPLE_CORPUS, 330, CHATML_SPECIALS)
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


def test_tools_and_calls_are_rendered(tools_tokenizer):
    text = _text(
        tools_tokenizer, apply_chat_template(tools_tokenizer, CONVERSATION, tools=[WEATHER])
    )
    expected = (
        "<|im_start|>system\nFunctions you may call, one JSON signature per line:\n"
        f"{json.dumps(WEATHER, ensure_ascii=False)}\n"
        "To call functions, answer with one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <JSON object>}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL_BLOCK}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected


def test_without_tools_the_template_shows_none(tools_tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    text = _text(tools_tokenizer, apply_chat_template(tools_tokenizer, messages))
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "call, match",
    [
        ({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}, "JSON"),
        ({"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}, "object"),
        ({"id": "c", "type": "function", "function": {"arguments": "{}"}}, "function"),
    ],
)
def test_bad_calls_are_refused(tools_tokenizer, call, match):
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(ValueError, match=match):
        apply_chat_template(tools_tokenizer, messages)


def test_only_assistant_turns_call(tools_tokenizer):
    messages = [{"role": "user", "content": "x", "tool_calls": CONVERSATION[1]["tool_calls"]}]
    with pytest.raises(ValueError, match="only assistant"):
        apply_chat_template(tools_tokenizer, messages)


def test_qwen25_template_renders_calls_as_objects():
    from engine.models.bundled import resolve_model
    from engine.text.tokenizer import load_tokenizer

    try:
        path = resolve_model("qwen2.5-coder-0.5b-instruct")
    except Exception as e:
        pytest.skip(f"Qwen2.5 is not installed: {e}")
    tokenizer = load_tokenizer(path)
    text = _text(tokenizer, apply_chat_template(tokenizer, CONVERSATION, tools=[WEATHER]))
    assert f"<tools>\n{json.dumps(WEATHER, ensure_ascii=False)}\n</tools>" in text
    assert f"<|im_start|>assistant\n{CALL_BLOCK}<|im_end|>" in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
