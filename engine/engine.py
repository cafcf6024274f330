"""`LLMEngine`: add requests, abort them, and step. One step is schedule, run, update.

A user request with n > 1 fans out into n sequences that share the prompt (and, through the
prefix cache, its KV blocks); its `RequestOutput` gathers their completions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.models.bundled import resolve_model
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, StepInput, kv_cache_blocks
from engine.sampler import SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

_SEED_MODULUS = 2**64


class _Group:
    """The n sequences of one user request and the output object they fill."""

    def __init__(self, output: RequestOutput, requests: list[Request]) -> None:
        self.output = output
        self.requests = requests


class LLMEngine:
    """The continuous-batching engine over one target model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = resolve_model(config.model)
        self.model_config = ModelConfig.from_path(model_path)
        self.tokenizer = _maybe_load_tokenizer(config.tokenizer or model_path)
        self.eos_token_ids = self.model_config.eos_token_ids
        if self.tokenizer is not None:
            self.eos_token_ids = tuple(
                dict.fromkeys(self.eos_token_ids + eos_token_ids(self.tokenizer, model_path))
            )
            self.model_config = replace(self.model_config, eos_token_ids=self.eos_token_ids)
        dtype = config.torch_dtype(self.model_config)
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        num_blocks = kv_cache_blocks(config, self.model_config, dtype, max_len)
        if config.max_model_len is None:
            max_len = min(max_len, num_blocks * config.block_size)
        elif max_len > num_blocks * config.block_size:
            raise ValueError(
                f"max_model_len {max_len} does not fit in the KV cache "
                f"({num_blocks} blocks of {config.block_size} tokens)."
            )
        self.max_model_len = max_len
        self.runner = ModelRunner(config, self.model_config, max_len, num_blocks)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self._groups: dict[str, _Group] = {}

    # ----------------------------------------------------------------------------- requests

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids for a prompt given as text or as ids; validates ids against the vocab."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids.")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("the prompt is empty.")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (size {vocab}).")
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError for input the engine cannot serve."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use.")
        token_ids = self.encode_prompt(prompt)
        params.validate_for_vocab(self.model_config.vocab_size)
        max_tokens = self._max_tokens(len(token_ids), params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        requests = []
        for i in range(params.n):
            seq_params = params
            if params.seed is not None and i > 0:
                seq_params = replace(params, seed=(params.seed + i) % _SEED_MODULUS)
            request = Request(f"{request_id}#{i}", token_ids, seq_params, max_tokens, arrival)
            if self.tokenizer is not None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, seq_params)
            requests.append(request)
        output = RequestOutput(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            outputs=[
                CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)
            ],
        )
        self._groups[request_id] = _Group(output, requests)
        for request in requests:
            self.scheduler.add(request)

    def _max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"the prompt is {num_prompt_tokens} tokens; this model's context is "
                f"{self.max_model_len} tokens, which leaves no room to generate."
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds this model's context of {self.max_model_len} tokens."
            )
        return params.max_tokens

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. Returns False if it is unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for request, completion in zip(group.requests, group.output.outputs, strict=True):
            if not request.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                completion.finish_reason = "abort"
        group.output.finished = True
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ----------------------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and update. Returns the outputs that changed."""
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            return []
        inputs = [
            StepInput.build(r, n, self.block_manager.get_block_table(r.request_id))
            for r, n in schedule.scheduled
        ]
        sampled = self.runner.execute(inputs)
        return self._update(schedule, inputs, sampled)

    def _update(
        self, schedule: SchedulerOutput, inputs: list[StepInput], sampled: SamplerOutput | None
    ) -> list[RequestOutput]:
        self.scheduler.update(schedule)
        sampling = [s.request for s in inputs if s.samples]
        if sampled is None or not sampling:
            return []
        token_ids = sampled.token_ids.tolist()
        logprobs = _logprob_lists(sampled)
        touched: dict[str, _Group] = {}
        for row, request in enumerate(sampling):
            request.append_token(token_ids[row])
            if request.logprobs is not None and logprobs is not None:
                request.logprobs.append(_token_logprob(request, token_ids[row], logprobs, row))
            self._check_stop(request)
            group_id = request.request_id.rpartition("#")[0]
            touched[group_id] = self._groups[group_id]
        return [self._refresh(group_id, group) for group_id, group in touched.items()]

    def _check_stop(self, request: Request) -> None:
        token_id = request.output_token_ids[-1]
        params = request.params
        status: RequestStatus | None = None
        is_stop_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )
        if is_stop_token and request.num_output_tokens >= params.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
        elif request.detokenizer is not None:
            update = request.detokenizer.append([token_id])
            request.output_text += update.text
            if update.stop_string is not None:
                request.truncate_output(request.num_output_tokens - 1 + update.num_tokens_kept)
                request.stop_reason = update.stop_string
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if request.detokenizer is not None and request.stop_reason is None:
                request.output_text += request.detokenizer.flush()
            self.scheduler.finish(request, status)

    def _refresh(self, group_id: str, group: _Group) -> RequestOutput:
        """Bring the group's output up to date with its sequences; drop finished groups."""
        for request, completion in zip(group.requests, group.output.outputs, strict=True):
            num_old = len(completion.token_ids)
            completion.new_token_ids = request.output_token_ids[num_old:]
            completion.new_text = request.output_text[len(completion.text) :]
            completion.token_ids = list(request.output_token_ids)
            completion.text = request.output_text
            if completion.logprobs is not None and request.logprobs is not None:
                completion.logprobs = list(request.logprobs)
            completion.num_cached_tokens = request.num_cached_tokens
            if request.is_finished:
                completion.finish_reason = request.status.value
                completion.stop_reason = request.stop_reason
        group.output.finished = all(r.is_finished for r in group.requests)
        if group.output.finished:
            del self._groups[group_id]
        return group.output


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _maybe_load_tokenizer(path: Any) -> Any:
    """The model's tokenizer, or None for a checkpoint without one (prompts are then token ids)."""
    path = Path(path)
    if path.is_dir() and not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.info("no tokenizer in %s: prompts must be token ids", path)
        return None
    return load_tokenizer(path)


def _logprob_lists(
    sampled: SamplerOutput,
) -> tuple[list[float], list[list[int]], list[list[float]]] | None:
    if sampled.logprobs is None or sampled.top_token_ids is None or sampled.top_logprobs is None:
        return None
    return sampled.logprobs.tolist(), sampled.top_token_ids.tolist(), sampled.top_logprobs.tolist()


def _token_logprob(
    request: Request,
    token_id: int,
    logprobs: tuple[list[float], list[list[int]], list[list[float]]],
    row: int,
) -> TokenLogprob:
    num_top = request.params.logprobs or 0
    chosen, top_ids, top_values = logprobs
    return TokenLogprob(
        token_id=token_id,
        logprob=chosen[row],
        top_token_ids=tuple(top_ids[row][:num_top]),
        top_logprobs=tuple(top_values[row][:num_top]),
    )
