"""What the protocol tests share: the sample texts, the request metadata, engine outputs built by
hand, and the check of a serialized body against the OpenAPI spec's schema."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerFast

from engine.core.counters import SpecStats
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from server.response_builders import ResponseMeta
from tests.tiny_tokenizers import byte_level_bpe

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Un café naïve, déjà vu — résumé!",
    "中文 文本 测试 你好 🙂 smile 🙂🙂",
] * 10


TEXT = "Hello café 中文 🙂 world"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
DROP = object()  # a patch value that removes the key


def check_body(validator: Any, model: Any) -> dict[str, Any]:
    body = json.loads(model.model_dump_json())
    errors_found = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    assert not errors_found, [f"{list(e.path)}: {e.message}" for e in errors_found]
    return body


def train_byte_level() -> PreTrainedTokenizerFast:
    return byte_level_bpe(CORPUS, 300, ["<|endoftext|>"])


def patched_body(base: dict[str, Any], **patch: Any) -> dict[str, Any]:
    body = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


META = ResponseMeta("chatcmpl-test", "tiny", 1_700_000_000)
CMPL_META = ResponseMeta("cmpl-test", "tiny", 1_700_000_000)


def logprob_entries(ids: list[int], num_top: int) -> list[TokenLogprob]:
    # The top list deliberately holds a -inf logprob: JSON has no -inf.
    top_ids = tuple(range(num_top))
    top_logprobs = (-0.1, *([-math.inf] * num_top))[:num_top]
    return [TokenLogprob(t, -0.25 * (i + 1), top_ids, top_logprobs) for i, t in enumerate(ids)]


def make_output(
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
                logprobs=None if logprobs is None else logprob_entries(ids, logprobs),
                finish_reason=finish,
                num_output_tokens=len(ids),
                num_cached_tokens=4,
                spec_stats=stats,
            )
        )
    return RequestOutput(
        "r", "prompt", [1, 2, 3, 4, 5, 6], completions, finished=finish is not None
    )


def delta_between(before: RequestOutput | None, after: RequestOutput) -> RequestOutput:
    """What the whole output `after` adds to the earlier whole output `before`."""
    outputs = []
    for c in after.outputs:
        old = None if before is None else before.outputs[c.index]
        num_ids, num_chars = (0, 0) if old is None else (len(old.token_ids), len(old.text))
        logprobs = None if c.logprobs is None else c.logprobs[num_ids:]
        outputs.append(
            replace(c, text=c.text[num_chars:], token_ids=c.token_ids[num_ids:], logprobs=logprobs)
        )
    return replace(after, outputs=outputs)


def spec_stats_of(records: list[tuple[int, int]]) -> SpecStats:
    """Counters after verify steps of (draft tokens, accepted drafts)."""
    stats = SpecStats()
    for num_draft_tokens, num_accepted in records:
        stats.record(num_draft_tokens, num_accepted, "ngram")
    return stats


def with_spec_stats(
    outputs: list[RequestOutput], by_index: list[SpecStats | None]
) -> list[RequestOutput]:
    return [
        replace(o, outputs=[replace(c, spec_stats=by_index[c.index]) for c in o.outputs])
        for o in outputs
    ]


# Choice 0: 4 verify steps accepting 4, 1, 0, 1 of 4, 4, 3, 4 drafts; choice 1 never drafted.
SPEC_RECORDS = [(4, 4), (4, 1), (3, 0), (4, 1)]
SPEC_0 = {
    "mean_acceptance_length": 2.5,  # 1 + 6 / 4
    "draft_acceptance_rate": 0.4,  # 6 / 15
    "num_spec_steps": 4,
    "num_draft_tokens": 15,
    "num_accepted_draft_tokens": 6,
    "acceptance_histogram": [1, 2, 0, 0, 1],
    "by_method": {"ngram": {"num_draft_tokens": 15, "num_accepted_draft_tokens": 6}},
}


SPEC_NONE = {
    "mean_acceptance_length": 0.0,
    "draft_acceptance_rate": 0.0,
    "num_spec_steps": 0,
    "num_draft_tokens": 0,
    "num_accepted_draft_tokens": 0,
    "acceptance_histogram": [],
    "by_method": {},
}
