"""Tokenizer loading, end-of-sequence ids and chat-template rendering.

Everything goes through transformers: `AutoTokenizer` loads the tokenizer from a local model
directory (or the tokenizer embedded in a GGUF file), and chat templates are rendered by
transformers' sandboxed Jinja environment. Nothing here touches the Hugging Face hub.

Chat messages follow the OpenAI shape. Roles: `system`, `user`, `assistant`, `tool`; `developer`
(OpenAI's newer name for the system role) is rendered as `system`, since no open chat template
knows it. Content is a string or a list of `{"type": "text", "text": ...}` parts; the parts are
joined with a newline. An assistant message may carry `tool_calls` (OpenAI's shape) instead of
content; their `arguments`, a JSON string in the API, reach the template as a dict, which is what
chat templates (Qwen2.5's, Hermes') write out with `tojson`. A tool message keeps its
`tool_call_id`. Tools (OpenAI's `{"type": "function", "function": {...}}`) go to the template as
given. Every rejected input raises `ValueError` with a message fit for a 400 response.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "developer": "system",
    "tool": "tool",
}
_CONFIG_FILES = ("generation_config.json", "config.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local model directory, or the one inside a `.gguf` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist.")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass the model directory.")
        return AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase, generation_config_path_or_dir: str | Path | None
) -> tuple[int, ...]:
    """The ids that end a generation: the tokenizer's eos plus the model configs' `eos_token_id`.

    Given a directory, both `generation_config.json` and `config.json` in it are read (chat models
    often list their end-of-turn token only in the generation config). Given a file, only that
    file. Missing files are skipped. Order: tokenizer first, then configs, without duplicates.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if generation_config_path_or_dir is not None:
        ids.extend(config_eos_token_ids(generation_config_path_or_dir))
    return tuple(dict.fromkeys(ids))


def config_eos_token_ids(path_or_dir: str | Path) -> tuple[int, ...]:
    """`eos_token_id` (int or list) of a model directory's generation_config.json and
    config.json, or of the one file given; missing files are skipped, duplicates dropped."""
    source = Path(path_or_dir)
    files = [source / name for name in _CONFIG_FILES] if source.is_dir() else [source]
    ids = [i for file in files if file.is_file() for i in _config_eos_ids(file)]
    return tuple(dict.fromkeys(ids))


def _config_eos_ids(file: Path) -> list[int]:
    with file.open(encoding="utf-8") as f:
        config = json.load(f)
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ValueError(f"{file}: eos_token_id must be an int or a list of ints, got {value!r}.")


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A text prompt's token ids, as the engine encodes one (the tokenizer's own special tokens
    added, as `encode` does by default)."""
    return list(tokenizer.encode(text))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Render `messages` (and the `tools` the model may call, if any) with the tokenizer's chat
    template and return the prompt token ids.

    Control tokens (e.g. `<|im_end|>`) written inside message text are encoded as plain text where
    the installed transformers supports it, so a client cannot forge turn boundaries.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions.")
    conversation = normalize_messages(messages)
    kwargs: dict[str, Any] = {"tokenize": True, "return_dict": False}
    if tools:
        kwargs["tools"] = [dict(tool) for tool in tools]
    if "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters:
        kwargs["sanitize_control_tokens"] = True
    try:
        rendered = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except TemplateError as e:
        # Templates reject conversations they cannot express (e.g. roles that do not alternate).
        raise ValueError(f"the chat template rejected the messages: {e}") from e
    return _as_id_list(rendered)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages into `[{"role": ..., "content": str, ...}]` for a
    template (plus `tool_calls` on assistant turns, `tool_call_id` on tool results)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list.")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be an object with 'role' and 'content'.")
    role = message.get("role")
    if role not in _ROLE_ALIASES:
        allowed = ", ".join(sorted(_ROLE_ALIASES))
        raise ValueError(f"{where}.role must be one of {allowed}; got {role!r}.")
    calls = message.get("tool_calls")
    if calls and role != "assistant":
        raise ValueError(f"{where}.tool_calls: only assistant messages have tool calls.")
    content = message.get("content")
    normalized: dict[str, Any] = {
        "role": _ROLE_ALIASES[role],
        # A turn of calls only has no text; "" renders where templates concatenate content.
        "content": "" if calls and content is None else _content_text(where, content),
    }
    if calls:
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list.")
        normalized["tool_calls"] = [
            _tool_call(f"{where}.tool_calls[{j}]", call) for j, call in enumerate(calls)
        ]
    if role == "tool" and message.get("tool_call_id") is not None:
        normalized["tool_call_id"] = str(message["tool_call_id"])
    return normalized


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    """An OpenAI tool call with its arguments parsed: a dict, as templates expect."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', ...}}}}.")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"{where}.function.arguments is not valid JSON: {e}.") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where}.function.arguments must be a JSON object.")
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": dict(arguments)},
    }


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where}.content must be a string or a non-empty list of text parts.")
    texts = []
    for j, part in enumerate(content):
        is_text_part = (
            isinstance(part, Mapping)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
        if not is_text_part:
            raise ValueError(
                f"{where}.content[{j}] must be {{'type': 'text', 'text': <string>}}; "
                "only text content is supported."
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _as_id_list(rendered: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding unless return_dict=False; older versions a list.
    if isinstance(rendered, Mapping) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    if hasattr(rendered, "tolist"):
        rendered = rendered.tolist()
    ids = list(rendered)
    if ids and isinstance(ids[0], list):
        # A batch of one conversation.
        (ids,) = ids
    return [int(t) for t in ids]


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def maybe_load_tokenizer(path: Any) -> Any:
    """The model's tokenizer, or None for a checkpoint without one (prompts are then token ids)."""
    path = Path(path)
    if path.is_dir() and not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.info("no tokenizer in %s: prompts must be token ids", path)
        return None
    return load_tokenizer(path)
