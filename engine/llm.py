"""`LLM`: the offline API, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.models.generation_defaults import load_generation_defaults
from engine.outputs import OutputAccumulator, RequestOutput
from engine.sampling_params import SamplingParams
from engine.speculative_config import SpeculativeConfig
from engine.text.tokenizer import apply_chat_template

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


class LLM:
    """Generate offline: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    Keyword arguments are the fields of `EngineConfig` (dtype, max_num_seqs, block_size,
    num_kv_blocks, kv_cache_memory, enable_prefix_caching, speculative_config, ...);
    speculative_config may be a mapping, as vLLM's LLM takes it.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        if "speculative_config" in kwargs:
            kwargs["speculative_config"] = SpeculativeConfig.parse(kwargs["speculative_config"])
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        # Read once: a file that no request could use stops the LLM here, as it stops a server.
        self._defaults = load_generation_defaults(self.engine.model_config.path)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling defaults of the model's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty: what the server applies to a
        request that gives none), the rest SamplingParams' own; as vLLM's LLM does."""
        return SamplingParams(**self._defaults.given())  # type: ignore[arg-type]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, batched continuously; outputs in prompt order.

        A single prompt may be a string or a list of token ids; a list of those is a batch.
        Without sampling_params, the model's own defaults (`get_default_sampling_params`).
        """
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        batch = _as_batch(prompts)
        params = _broadcast(sampling_params, len(batch))
        ids = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
            return self._run(ids)
        finally:
            for request_id in ids:
                self.engine.abort(request_id)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        `tools`: function definitions in OpenAI's shape ({"type": "function", "function":
        {"name", "description", "parameters"}}), rendered by the model's template as the
        server renders them; the output is the model's text, calls in its own markup (the
        server's tool parsers read them into `tool_calls`)."""
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template.")
        is_single = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if is_single else list(messages)
        prompts = [
            apply_chat_template(self.engine.tokenizer, conv, tools=tools)  # type: ignore[arg-type]
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        """Step until every request finished; their whole outputs (the steps' deltas added up)."""
        accumulator = OutputAccumulator()
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for output in accumulator.add_step(self.engine.step()):
                finished[output.request_id] = output
        return [finished[i] for i in ids]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]  # one prompt as token ids
    return items  # type: ignore[return-value]


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts.")
    return list(params)
