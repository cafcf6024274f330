"""Explicit wiring: `build_engine` makes every part an `LLMEngine` runs, once, in order, each from
typed arguments (no component is handed a half-built engine).

1. The model files, their config and tokenizer (the stop ids of both).
2. Every model's weights: the target's runner, then the model drafter's (a draft model or an
   EAGLE-3 head) when the speculative config names one.
3. One KV budget measured after all the weights, for the KV of every model (engine/execution/
   kv_plan.py); the longest context it holds; the KV tensors (and the CUDA graphs on a GPU).
4. The block manager over those blocks, shared by every model's KV.
5. The drafters (engine/drafters), the policy (engine/policy, calibrated in mode auto), the
   scheduler that asks the policy, the grammar compiler and the verifier.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from engine.config import EngineConfig
from engine.drafters.registry import DrafterContext
from engine.drafters.speculator import Speculator
from engine.execution.draft_runners import load_draft_runner
from engine.execution.graph_buckets import draft_max_query_len
from engine.execution.kv_plan import log_memory, plan_for, release_freed_heap
from engine.execution.runner import ModelRunner
from engine.kernels import cpu_kernels
from engine.models.bundled import resolve_model
from engine.models.config import ModelConfig
from engine.policy.policy import SpeculationPolicy
from engine.policy.setup import make_policy
from engine.runtime.startup import startup_phase
from engine.sampling.sampler import Sampler
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.scheduler import Scheduler
from engine.speculative_config import DEFAULT_PREDICTION_TOKENS
from engine.structured.compiler import GrammarCompiler
from engine.text.tokenizer import eos_token_ids, maybe_load_tokenizer
from engine.verification.verifier import Verifier


@dataclass(frozen=True)
class EngineParts:
    """What an engine runs, built by `build_engine`. `model_config.eos_token_ids` holds the stop
    ids of the checkpoint's config and of its tokenizer."""

    model_config: ModelConfig
    tokenizer: Any  # a transformers tokenizer, or None: prompts are then token ids
    runner: ModelRunner
    draft_runner: ModelRunner | None
    max_model_len: int
    block_manager: BlockManager
    speculator: Speculator
    policy: SpeculationPolicy
    scheduler: Scheduler
    grammars: GrammarCompiler | None
    verifier: Verifier


def build_engine(config: EngineConfig) -> EngineParts:
    """Every part of an engine serving `config` (each start-up phase logs its time)."""
    model_config, tokenizer = _load_model_files(config)
    spec = config.speculative_config
    if config.torch_device().type == "cpu":
        cpu_kernels()  # now, if not yet: "load weights" then times the weights alone
    # Every model's weights first, then one KV budget measured after them for the KV of all.
    max_positions = config.max_model_len or model_config.max_position_embeddings
    with startup_phase(f"load weights {model_config.path.name}"):
        runner = ModelRunner(config, model_config, max_positions)
    draft_runner = load_draft_runner(config, spec, runner, max_positions, tokenizer)
    num_drafts = spec.num_speculative_tokens if spec else DEFAULT_PREDICTION_TOKENS
    num_blocks, max_model_len = _allocate_kv(
        config, runner, draft_runner, max_positions, num_drafts
    )
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    eos = model_config.eos_token_ids
    speculator = Speculator.from_context(
        DrafterContext(
            spec, model_config.vocab_size, eos, tokenizer, runner, draft_runner, block_manager
        )
    )
    policy = make_policy(
        spec, runner, draft_runner, block_manager, config.max_num_batched_tokens, max_model_len
    )
    scheduler = Scheduler(
        block_manager,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        max_model_len,
        policy=policy,
    )
    # Structured outputs compile against the tokenizer (none without one); the server compiles
    # off the engine thread through this same cache.
    grammars = (
        GrammarCompiler(
            copy.deepcopy(tokenizer),  # its own: it runs on the server's threads
            model_config.vocab_size,
            eos,
        )
        if tokenizer is not None
        else None
    )
    verifier = Verifier(Sampler(model_config.vocab_size, eos))
    return EngineParts(
        model_config,
        tokenizer,
        runner,
        draft_runner,
        max_model_len,
        block_manager,
        speculator,
        policy,
        scheduler,
        grammars,
        verifier,
    )


def _load_model_files(config: EngineConfig) -> tuple[ModelConfig, Any]:
    """The target's config and tokenizer; the stop ids of both in the config."""
    with startup_phase(f"model files {config.model}"):
        model_path = resolve_model(config.model)
    with startup_phase("config and tokenizer"):
        model_config = ModelConfig.from_path(model_path)
        tokenizer = maybe_load_tokenizer(config.tokenizer or model_path)
    if tokenizer is not None:
        eos = model_config.eos_token_ids + eos_token_ids(tokenizer, model_path)
        model_config = replace(model_config, eos_token_ids=tuple(dict.fromkeys(eos)))
    return model_config, tokenizer


def _allocate_kv(
    config: EngineConfig,
    runner: ModelRunner,
    draft_runner: ModelRunner | None,
    max_positions: int,
    num_drafts: int,
) -> tuple[int, int]:
    """Size one KV budget for every model's KV, allocate it (capturing CUDA graphs on a GPU),
    and return the number of blocks and the longest context (max_model_len) they hold, at most
    `max_positions` (the one the runners' RoPE tables were sized for)."""
    runners = [r for r in (runner, draft_runner) if r is not None]
    plan = plan_for(config, runners, max_positions, num_drafts)
    num_blocks = plan.num_blocks
    max_len = max_positions
    if config.max_model_len is None:
        max_len = min(max_len, num_blocks * config.block_size)
    elif max_len > num_blocks * config.block_size:
        raise ValueError(
            f"max_model_len {max_len} does not fit in the KV cache "
            f"({num_blocks} blocks of {config.block_size} tokens; budget from {plan.source})."
        )
    with startup_phase("KV cache"):  # with the CUDA graphs' capture on a GPU
        runner.allocate_kv_cache(num_blocks)
        if draft_runner is not None:
            # Its first forward of a step (1 + catch-up tokens per drafting request) replays a
            # graph too, up to draft_max_query_len tokens each; longer catch-up is eager. An
            # EAGLE-3 head's extend over decoding requests (1 + accepted tokens each) and its
            # chained draft steps fit the same buckets.
            draft_runner.allocate_kv_cache(
                num_blocks, max_query_len=draft_max_query_len(num_drafts)
            )
    log_memory(plan, runners, config.block_size)
    release_freed_heap()  # what loading freed, out of the resident set
    return num_blocks, max_len
