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

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.chunks import SeqChunk
from engine.execution.runner import ModelRunner
from engine.llm import LLM
from engine.models.llama import LlamaForCausalLM, QuantEmbedding, QuantLinear
from engine.runtime.device import to_device
from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.text.tokenizer import apply_chat_template, encode_text

logger = logging.getLogger(__name__)

_FLOAT16_MAX = 65000.0  # below float16's 65504, so a rounded value cannot overflow
_FEATURE_OWNER = "__eagle3_features__"  # the block manager's name for the features' blocks


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


def make_sequences(
    llm: LLM,
    examples: Sequence[Example],
    path: Path,
    max_tokens: int,
    max_seq_len: int,
    temperature: float,
    seed: int,
    taps: tuple[int, ...] | None = None,
    features: Path | None = None,
) -> list[TrainSequence]:
    """Prompt + response of every example, the responses not given generated by the target, in
    batches of the engine's max_num_seqs; appended to `path` (JSONL) as they are made, and read
    back from it on a later run. A prompt that leaves no room for two response tokens within
    max_seq_len is skipped, as is a sequence with no response token.

    With `taps` and `features` (a directory), each generated sequence's features are recorded
    while the target generates it (`FeatureRecorder`) and saved there, so `load_features` need
    not run the target over it again."""
    done = _read_sequences(path)
    todo = []
    with path.open("a") as file:
        for index, example in enumerate(examples):
            if index in done:
                continue
            room = max_seq_len - len(example.prompt_ids)
            if room < 2:
                logger.warning(
                    "prompt %d skipped: %d tokens leave no room for a response within %d",
                    index,
                    len(example.prompt_ids),
                    max_seq_len,
                )
                done[index] = None
            elif example.response_ids is not None:
                _append(file, index, done, example.prompt_ids, example.response_ids[:room])
            else:
                todo.append((index, example, min(max_tokens, room)))
        batch = llm.engine.config.max_num_seqs
        for first in range(0, len(todo), batch):
            part = todo[first : first + batch]
            params = [
                SamplingParams(temperature=temperature, max_tokens=n, seed=seed + index)
                for index, _, n in part
            ]
            prompts = [list(ex.prompt_ids) for _, ex, _ in part]
            if taps is None or features is None:
                outputs = llm.generate(prompts, params)
                recorded = {}
            else:
                with FeatureRecorder(llm.engine, taps) as recorder:
                    outputs = llm.generate(prompts, params)
                recorded = recorder.records
            for (index, example, _), output in zip(part, outputs, strict=True):
                response = tuple(output.outputs[0].token_ids)
                _append(file, index, done, example.prompt_ids, response)
                seq = done[index]
                if seq is not None and output.request_id in recorded:
                    assert features is not None
                    _save_recorded(features, seq, recorded[output.request_id].features(seq))
            logger.info("generated responses: %d of %d", first + len(part), len(todo))
    return [seq for _, seq in sorted(done.items()) if seq is not None]


def _append(
    file: Any,
    index: int,
    done: dict[int, TrainSequence | None],
    prompt: Sequence[int],
    response: Sequence[int],
) -> None:
    if not response:
        done[index] = None
        return
    seq = TrainSequence(tuple(prompt) + tuple(response), len(prompt))
    done[index] = seq
    row = {"index": index, "token_ids": list(seq.token_ids), "num_prompt_tokens": len(prompt)}
    file.write(json.dumps(row) + "\n")
    file.flush()


def _read_sequences(path: Path) -> dict[int, TrainSequence | None]:
    """Sequences already made, by example index; a line cut short by an interruption is
    dropped (its example is made again)."""
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    done: dict[int, TrainSequence | None] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[row["index"]] = TrainSequence(tuple(row["token_ids"]), row["num_prompt_tokens"])
    path.write_text("".join(line + "\n" for line in lines if _is_json(line)))
    return done


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


# ------------------------------------------------------------------ features while generating


class _Recorded:
    """What one request's forwards gave, by position: taps, final hidden state, argmax."""

    def __init__(self, length: int, aux_width: int, hidden_size: int) -> None:
        self.aux = torch.zeros(length, aux_width, device="cpu")
        self.hidden = torch.zeros(length, hidden_size, device="cpu")
        self.argmax = torch.full((length,), -1, dtype=torch.int64, device="cpu")

    def features(self, seq: TrainSequence) -> dict[str, torch.Tensor]:
        """The features dict `sequence_features` gives, at every position the training reads:
        the taps and hidden state of positions 0 .. n-2 (the last token is never fed while
        generating, and is never read), the argmax from the prompt's last position on; the
        argmax of earlier prompt positions (never read) is the next token."""
        n = len(seq.token_ids)
        ids = torch.tensor(seq.token_ids, dtype=torch.int64, device="cpu")
        argmax = self.argmax[:n].clone()
        missing = argmax < 0
        argmax[missing] = torch.cat((ids[1:], ids.new_zeros(1)))[missing]
        loss_mask = torch.zeros(n, dtype=torch.bool, device="cpu")
        loss_mask[seq.num_prompt_tokens :] = True
        return {
            "token_ids": ids,
            "loss_mask": loss_mask,
            "aux": _compact(self.aux[:n]),
            "hidden": _compact(self.hidden[:n]),
            "target_ids": argmax,
        }


class FeatureRecorder:
    """Records, while the target generates, every position each request computes: the inputs of
    the tapped layers, the final hidden state and (where the step asked for logits) the argmax.
    On a batch-invariant forward these are the bits `sequence_features` gets by running the
    target over the finished sequence (tests/unit/test_train_eagle3.py), so generating the
    responses makes their features too. A chunk's request is known by its first block (the
    trainer's engine caches no prefix, so no two requests share a block); the engine runs
    eagerly here (a replayed graph would not show its final hidden state to the hook)."""

    def __init__(self, engine: Any, taps: tuple[int, ...]) -> None:
        self.engine, self.taps = engine, taps
        self.runner = engine.runner
        self.model = self.runner.model
        assert isinstance(self.model, LlamaForCausalLM)
        self.records: dict[str, _Recorded] = {}
        self._final: list[torch.Tensor] = []

    def __enter__(self) -> FeatureRecorder:
        if self.engine.block_manager.enable_prefix_caching or self.runner.graphs is not None:
            raise ValueError("recording features needs an engine without prefix caching or graphs.")
        self._saved = self.model.aux_layers
        self.model.aux_layers = self.taps
        self._hook = self.model.register_forward_hook(lambda _m, _i, out: self._final.append(out))
        self._own_forward = vars(self.runner).get("forward")  # a wrapper already there, if any
        forward = self.runner.forward
        self.runner.forward = lambda chunks: self._record(chunks, forward(chunks))
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        if self._own_forward is None:
            del self.runner.forward  # the class's method again
        else:
            self.runner.forward = self._own_forward
        self.model.aux_layers, self.model.aux_hidden = self._saved, None

    def _owner(self, chunk: SeqChunk) -> Any:
        block = chunk.block_table[0]
        for request in self.engine.scheduler.running:
            table = self.engine.block_manager.get_block_table(request.request_id)
            if table and table[0] == block:
                return request
        raise AssertionError(f"no running request owns block {block}")

    def _record(self, chunks: Sequence[SeqChunk], logits: torch.Tensor | None) -> Any:
        (hidden,) = self._final  # [num_tokens, H] the step's final (normed) hidden states
        self._final.clear()
        aux = self.model.aux_hidden  # [num_tokens, n_aux * H]
        assert aux is not None
        row = logit_row = 0
        for chunk in chunks:
            n, start = len(chunk.token_ids), chunk.start
            request = self._owner(chunk)
            # The engine runs a request's choice i as "<request id>#i"; the trainer asks for one.
            request_id = request.request_id.rpartition("#")[0] or request.request_id
            record = self.records.get(request_id)
            if record is None:
                length = request.num_prompt_tokens + request.max_tokens
                record = _Recorded(length, aux.shape[1], hidden.shape[1])
                self.records[request_id] = record
            record.aux[start : start + n] = aux[row : row + n].float().to("cpu")
            record.hidden[start : start + n] = hidden[row : row + n].float().to("cpu")
            if chunk.num_logits:
                assert logits is not None
                rows = logits[logit_row : logit_row + chunk.num_logits]
                record.argmax[start + n - chunk.num_logits : start + n] = rows.argmax(-1).to("cpu")
            row += n
            logit_row += chunk.num_logits
        return logits


def _recorded_file(directory: Path, seq: TrainSequence) -> Path:
    """Where a sequence's recorded features wait for their shard: named by its tokens."""
    digest = hashlib.sha256(json.dumps(list(seq.token_ids)).encode()).hexdigest()[:20]
    return directory / "recorded" / f"{digest}.pt"


def _save_recorded(directory: Path, seq: TrainSequence, row: dict[str, torch.Tensor]) -> None:
    file = _recorded_file(directory, seq)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    torch.save(row, tmp)
    os.replace(tmp, file)


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


def sequence_features(
    runner: ModelRunner,
    block_manager: BlockManager,
    seq: TrainSequence,
    taps: tuple[int, ...],
    max_chunk: int,
) -> dict[str, torch.Tensor]:
    """One sequence's features from the target's runner: a forward over free blocks (nothing
    else may run: the engine is idle and caches no prefix, so no block holds KV another request
    needs), in chunks of at most max_chunk tokens, with every position's logits."""
    model = runner.model
    assert isinstance(model, LlamaForCausalLM)
    n = len(seq.token_ids)
    if not block_manager.allocate_slots(_FEATURE_OWNER, n):
        raise ValueError(
            f"a {n}-token sequence needs more KV blocks than the engine's {block_manager.num_blocks}"
            f" of {block_manager.block_size} tokens: lower max_seq_len or give num_kv_blocks."
        )
    finals: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: finals.append(out.float().to("cpu")))
    saved = model.aux_layers
    model.aux_layers = taps
    aux, argmax = [], []
    try:
        table = list(block_manager.get_block_table(_FEATURE_OWNER))
        with torch.inference_mode():
            for start in range(0, n, max_chunk):
                ids = seq.token_ids[start : start + max_chunk]
                logits = runner.forward([SeqChunk(ids, start, table, len(ids))])  # [len, vocab]
                assert logits is not None and model.aux_hidden is not None
                aux.append(model.aux_hidden.float().to("cpu"))  # [len, n_aux * H]
                argmax.append(logits.argmax(dim=-1).to("cpu"))  # [len]
    finally:
        hook.remove()
        model.aux_layers, model.aux_hidden = saved, None
        block_manager.free(_FEATURE_OWNER)
    loss_mask = torch.zeros(n, dtype=torch.bool, device="cpu")
    loss_mask[seq.num_prompt_tokens :] = True
    return {
        "token_ids": torch.tensor(seq.token_ids, dtype=torch.int64, device="cpu"),
        "loss_mask": loss_mask,
        "aux": _compact(torch.cat(aux)),
        "hidden": _compact(torch.cat(finals)),
        "target_ids": torch.cat(argmax).to(torch.int64),
    }


def _compact(x: torch.Tensor) -> torch.Tensor:
    """float16 on disk; bfloat16 where a value would overflow float16 (massive activations)."""
    return x.half() if float(x.abs().max()) < _FLOAT16_MAX else x.bfloat16()


def load_features(
    llm: LLM,
    sequences: Sequence[TrainSequence],
    taps: tuple[int, ...],
    directory: Path,
    shard_size: int,
) -> list[SequenceFeatures]:
    """Every sequence's features: shards already under `directory` are read, the others computed
    through the LLM's target runner and saved first (shard k holds sequences [k * shard_size,
    (k + 1) * shard_size))."""
    engine = llm.engine
    if engine.has_unfinished_requests() or engine.block_manager.enable_prefix_caching:
        raise ValueError("features need an idle engine that caches no prefix.")
    directory.mkdir(parents=True, exist_ok=True)
    num_shards = -(-len(sequences) // shard_size)
    features: list[SequenceFeatures] = []
    for k in range(num_shards):
        part = sequences[k * shard_size : (k + 1) * shard_size]
        file = directory / f"shard-{k:05d}.pt"
        if not file.exists():
            recorded = [_recorded_file(directory, seq) for seq in part]
            rows = [
                torch.load(r, map_location="cpu", weights_only=True)
                if r.exists()
                else sequence_features(
                    engine.runner,
                    engine.block_manager,
                    seq,
                    taps,
                    engine.config.max_num_batched_tokens,
                )
                for seq, r in zip(part, recorded, strict=True)
            ]
            tmp = file.with_suffix(".tmp")
            torch.save({"taps": list(taps), "sequences": rows}, tmp)
            os.replace(tmp, file)
            for r in recorded:
                r.unlink(missing_ok=True)
            logger.info("features: shard %d of %d (%d sequences)", k + 1, num_shards, len(part))
        shard = torch.load(file, map_location="cpu", weights_only=True)
        rows = shard["sequences"]
        if shard["taps"] != list(taps) or len(rows) != len(part):
            raise ValueError(f"{file} was made for other data: remove {directory}.")
        for row, seq in zip(rows, part, strict=True):
            if row["token_ids"].tolist() != list(seq.token_ids):
                raise ValueError(f"{file} was made for other data: remove {directory}.")
            features.append(SequenceFeatures(**row))
    return features
