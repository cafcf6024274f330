"""The data an EAGLE-3 head trains on: sequences (prompt + the target's response), the draft
vocabulary counted over their responses, and the target's features for every position, made by
our own engine so that the head learns from exactly what it will see when served.

Sequences: each line of the prompts file gives a prompt (text, a chat, or token ids) and
optionally its response; the target generates the missing responses through `LLM` (greedy or at
a given temperature), as SpecForge's recipe advises ("regenerated" data: the head learns the
target's own continuations). They are kept in `sequences.jsonl` as they are made, so an
interrupted run generates only the rest.

Features: recorded while the target generates a sequence (`FeatureRecorder`: on a
batch-invariant forward they are the bits a forward over the finished sequence gives), else one
forward of the target's runner per sequence, in chunks of at most the engine's
`max_num_batched_tokens`, with `model.aux_layers` set to the head's taps, exactly as the engine
taps the target while serving (a GGUF-quantised target gives its quantised hidden states). Kept
per position: the taps [n, n_aux * H], the target's final (normed) hidden state [n, H] and the
argmax of its full-vocabulary logits [n]. The loss needs the target's logits over the draft
vocabulary; they are recomputed while training from the final hidden state and the dense rows of
the target's LM head for the draft vocabulary (`target_lm_rows`): 2·H bytes a position instead of
2·draft_vocab_size (3 KB rather than 64 KB for the 1.5B and a 32k draft vocabulary). The argmax,
from the runner's own logits, decides which positions count (those whose token the draft
vocabulary holds). Shards of `shard_size` sequences are saved with torch.save (float16; bfloat16
where a tap exceeds float16's range) under `features/`, so a resumed run computes none again.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.linears import QuantEmbedding, QuantLinear
from engine.models.llama import LlamaForCausalLM
from engine.runtime.device import to_device
from engine.text.tokenizer import apply_chat_template, encode_text


@dataclass(frozen=True)
class Example:
    """One line of the prompts file: the prompt's token ids and the response's, if given."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TrainSequence:
    """Prompt + response as the target reads it; the loss counts response tokens only."""

    token_ids: tuple[int, ...]
    num_prompt_tokens: int

    def __post_init__(self) -> None:
        assert 1 <= self.num_prompt_tokens < len(self.token_ids)


@dataclass(frozen=True)
class SequenceFeatures:
    """What training reads of one sequence (n tokens)."""

    token_ids: torch.Tensor  # [n] int64
    loss_mask: torch.Tensor  # [n] bool: the token is part of the response
    aux: torch.Tensor  # [n, n_aux * H] the residual stream entering each tapped layer
    hidden: torch.Tensor  # [n, H] the target's final normed hidden state
    target_ids: torch.Tensor  # [n] int64 the target's argmax after each position


# ------------------------------------------------------------------------------ the prompts file


def read_prompts(path: Path, tokenizer: Any, vocab_size: int) -> list[Example]:
    """Every example of a JSONL prompts file. A line is `{"prompt": str}`, `{"messages": [...]}`
    (a chat, rendered with the tokenizer's chat template and its generation prompt) or
    `{"prompt_ids": [int, ...]}`, optionally with `"response"` (text) or `"response_ids"`; any
    other line (not a JSON object) is a plain-text prompt. Blank lines are skipped."""
    examples = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            examples.append(_parse_line(line, tokenizer, vocab_size))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{number}: {e}") from None
    if not examples:
        raise ValueError(f"{path}: no prompts.")
    return examples


def _parse_line(line: str, tokenizer: Any, vocab_size: int) -> Example:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        row = line
    if isinstance(row, str):
        row = {"prompt": row}
    elif not isinstance(row, dict):
        row = {"prompt": line}

    needs_text = "prompt_ids" not in row or ("response" in row and "response_ids" not in row)
    if tokenizer is None and needs_text:
        raise ValueError("the target has no tokenizer: give prompt_ids (and response_ids).")
    if "prompt_ids" in row:
        prompt = [int(t) for t in row["prompt_ids"]]
    elif "messages" in row:
        prompt = apply_chat_template(tokenizer, row["messages"])
    elif isinstance(row.get("prompt"), str):
        prompt = encode_text(tokenizer, row["prompt"])
    else:
        raise ValueError(f"no prompt text, messages or prompt_ids in keys {sorted(row)}")
    response = None
    if "response_ids" in row:
        response = [int(t) for t in row["response_ids"]]
    elif "response" in row:
        response = list(tokenizer.encode(str(row["response"]), add_special_tokens=False))
    for ids in (prompt, response or []):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (size {vocab_size})")
    if not prompt:
        raise ValueError("the prompt is empty")
    return Example(tuple(prompt), tuple(response) if response is not None else None)


# ------------------------------------------------------------------------------ the sequences


# ------------------------------------------------------------------ features while generating


# ------------------------------------------------------------------------------ the vocabulary


def draft_vocabulary(
    sequences: Sequence[TrainSequence], draft_vocab_size: int, vocab_size: int
) -> list[int]:
    """The draft vocabulary as SpecForge makes it: the `draft_vocab_size` target ids most frequent
    among the response tokens (ties: the smaller id), sorted ascending. Too few distinct response
    tokens: filled with the prompts' most frequent other ids, then the smallest remaining ids."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} is not in [1, {vocab_size}].")
    responses: Counter[int] = Counter()
    prompts: Counter[int] = Counter()
    for seq in sequences:
        responses.update(seq.token_ids[seq.num_prompt_tokens :])
        prompts.update(seq.token_ids[: seq.num_prompt_tokens])
    order = sorted(responses, key=lambda t: (-responses[t], t))
    order += sorted((t for t in prompts if t not in responses), key=lambda t: (-prompts[t], t))
    chosen = set(order[:draft_vocab_size])
    for token in range(vocab_size):
        if len(chosen) >= draft_vocab_size:
            break
        chosen.add(token)
    return sorted(chosen)


def vocab_maps(draft_ids: Sequence[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) as published: d2t int64 [draft_vocab] offsets (target id = draft id +
    d2t[draft id]) and t2d bool [vocab] (the target ids the draft vocabulary holds)."""
    used = torch.tensor(list(draft_ids), dtype=torch.int64, device="cpu")  # [draft_vocab]
    d2t = used - torch.arange(len(used), dtype=torch.int64, device="cpu")
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")
    t2d[used] = True
    return d2t, t2d


# ------------------------------------------------------------------------------ the features


def target_embedding(model: LlamaForCausalLM) -> torch.Tensor:
    """The target's embedding table [vocab, H] in float32 (dequantised from GGUF blocks)."""
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding):
        return embed.quant_weight.dequantize().float()
    return embed.weight.detach().float().clone()


def target_lm_rows(model: LlamaForCausalLM, draft_ids: Sequence[int]) -> torch.Tensor:
    """The rows of the target's LM head for the draft vocabulary [draft_vocab, H] in float32
    (the embedding's, for a tied head; dequantised from GGUF blocks)."""
    head = model.lm_head
    if isinstance(head, QuantLinear):
        weight = head.dequantized_weight()
    elif head is None:
        weight = target_embedding(model)
    else:
        weight = head.weight.detach()
    rows = to_device(torch.tensor(list(draft_ids), dtype=torch.int64, device="cpu"), weight.device)
    return weight[rows].float()
