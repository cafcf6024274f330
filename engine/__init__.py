"""specserve's engine: paged KV cache, token-budget continuous batching, exact sampling."""

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "TokenLogprob",
]
