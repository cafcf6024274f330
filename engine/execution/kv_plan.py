"""One memory budget for the KV cache of every model the engine runs: the target and its draft.

The draft model indexes its KV with the target's block ids, so both pools have the same number
of blocks and a block costs the sum of both models' bytes per block. The budget is measured
after every weight is loaded:

- CUDA: `gpu_memory_utilization * total - (total - free) - activation reserve`, where free and
  total come from `Device.memory_info()` once the weights (and the RoPE tables) sit on the
  device, so the weights of both models, the CUDA context and other processes are already out
  of it. `kv_cache_memory`, when given, is an upper bound.
- CPU (the device reports no memory): `kv_cache_memory` bytes, else `DEFAULT_CPU_KV_MEMORY`
  capped at what `max_num_seqs` full-length sequences need.
- `num_kv_blocks` skips the budget: both models get that many blocks.

The reserve counts one eager step's activations per model, the attention backend's per-layer
scratch (`attention_workspace_bytes`: torch's gather of context K/V, Triton's split partials)
and, where CUDA graphs will be
captured, the graph pool's activations for the largest captured step. Each model's KV has one
extra pad block outside the budget (a few MiB at most).

The arithmetic here is pure (no torch), so tests drive it with any memory figures; `plan_for`
gathers the figures from the loaded runners.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from engine.attention.torch_attn import TorchAttentionBackend
from engine.config import EngineConfig
from engine.execution.graph_buckets import GRAPHABLE_BACKENDS, MAX_CAPTURE_TOKENS
from engine.execution.runner import ModelRunner
from engine.models.config import ModelConfig

logger = logging.getLogger(__name__)

GiB = 2**30
DEFAULT_CPU_KV_MEMORY = 2 * GiB
# float32 [rows, vocab] tensors the sampler and verifier hold at once at their peak: the
# processed copy of the logits, the softmax probabilities, and one working tensor (noise for
# the exponential race, or log_softmax for logprobs).
_FLOAT32_LOGIT_COPIES = 3


def activation_bytes(
    model_config: ModelConfig, itemsize: int, num_tokens: int, num_logit_rows: int
) -> int:
    """Peak bytes one forward of `num_tokens` tokens takes beyond weights and KV (an estimate
    that errs high), with `num_logit_rows` rows of logits sampled or verified after it:

        num_tokens * itemsize * (3 * hidden + 2 * q + 2 * kv + 3 * intermediate)
      + num_logit_rows * vocab * (itemsize + 4 * 3)

    Layer term: the residual stream, the normed input and a projection's output ([T, hidden]
    each); the fused qkv output and the attention output ([T, q + 2 kv] and [T, q]); the fused
    gate_up output and its activation ([T, 2 intermediate] and [T, intermediate]). Layers run
    one after another, so one layer's worth is live. Logits term: the logits in the model's
    dtype plus three float32 copies of them in sampling (_FLOAT32_LOGIT_COPIES). The attention
    backend's scratch is counted apart (`attention_workspace_bytes`);
    gpu_memory_utilization's headroom covers the rest."""
    q_size = model_config.num_heads * model_config.head_dim
    kv_size = model_config.num_kv_heads * model_config.head_dim
    per_token = (
        3 * model_config.hidden_size + 2 * q_size + 2 * kv_size + 3 * model_config.intermediate_size
    )
    per_row = model_config.vocab_size * (itemsize + 4 * _FLOAT32_LOGIT_COPIES)
    return num_tokens * itemsize * per_token + num_logit_rows * per_row


def attention_workspace_bytes(runner: ModelRunner, max_len: int) -> int:
    """Peak bytes of scratch one layer of `runner`'s attention holds at once, over contexts of
    up to max_len keys (0 for backends that need none): the torch backend's gather of context K
    and V, bounded to `max_gathered_tokens(max_len)` tokens of each (engine/attention/
    torch_attn.py), and the Triton backend's split partials (engine/attention/triton_attn.py
    `workspace_bytes`), however many sequences and tokens the step has."""
    backend = runner.backend
    cfg = runner.model_config
    workspace = getattr(backend, "workspace_bytes", None)
    if workspace is not None:
        return int(workspace(cfg, runner.dtype.itemsize, max_len))
    # The cpu backend subclasses torch's but reads the cache in place (and runs only on CPU).
    if not isinstance(backend, TorchAttentionBackend) or backend.name != "torch":
        return 0
    token_bytes = cfg.num_kv_heads * cfg.head_dim * runner.dtype.itemsize  # one token's K
    return 2 * backend.max_gathered_tokens(max_len) * token_bytes


@dataclass(frozen=True)
class KVPlan:
    """How many KV blocks every model gets, and the budget that decided it (for the log)."""

    num_blocks: int
    budget: int  # bytes the KV of all models may take; num_blocks * bytes per block <= budget
    source: str  # where the budget came from, in words

    def __post_init__(self) -> None:
        assert self.num_blocks >= 1 and self.budget >= 0


def plan_kv_cache(
    bytes_per_block: int,
    memory_info: tuple[int, int] | None,
    *,
    num_kv_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    activation_reserve: int = 0,
    full_length_bytes: int | None = None,
) -> KVPlan:
    """The number of KV blocks for one pool of `bytes_per_block` (the sum over all models).

    memory_info: (free, total) device bytes measured after every weight is loaded, or None on
    CPU. activation_reserve: bytes kept for activations (CUDA only; see `activation_bytes`).
    full_length_bytes: what max_num_seqs full-length sequences need (CPU default cap).
    Raises ValueError when the budget cannot hold a single block."""
    assert bytes_per_block > 0
    if num_kv_blocks is not None:
        return KVPlan(num_kv_blocks, num_kv_blocks * bytes_per_block, "num_kv_blocks")
    if memory_info is None:
        budget, source = _cpu_budget(kv_cache_memory, full_length_bytes)
    else:
        budget, source = _gpu_budget(
            memory_info, gpu_memory_utilization, activation_reserve, kv_cache_memory
        )
    num_blocks = max(0, budget) // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget, {budget} bytes ({source}), cannot hold one block "
            f"({bytes_per_block} bytes for every model together). "
            + (
                "Raise gpu_memory_utilization or kv_cache_memory, lower max_num_batched_tokens, "
                "or serve smaller models."
                if memory_info is not None
                else "Raise kv_cache_memory."
            )
        )
    return KVPlan(num_blocks, budget, source)


def _cpu_budget(kv_cache_memory: int | None, full_length_bytes: int | None) -> tuple[int, str]:
    if kv_cache_memory is not None:
        return kv_cache_memory, f"kv_cache_memory {_gib(kv_cache_memory)}"
    if full_length_bytes is not None and full_length_bytes < DEFAULT_CPU_KV_MEMORY:
        return full_length_bytes, f"max_num_seqs full-length sequences, {_gib(full_length_bytes)}"
    return DEFAULT_CPU_KV_MEMORY, f"the CPU default {_gib(DEFAULT_CPU_KV_MEMORY)}"


def _gpu_budget(
    memory_info: tuple[int, int],
    utilization: float,
    activation_reserve: int,
    kv_cache_memory: int | None,
) -> tuple[int, str]:
    free, total = memory_info
    in_use = total - free
    budget = int(utilization * total) - in_use - activation_reserve
    source = (
        f"gpu_memory_utilization {utilization:g} x {_gib(total)} total - {_gib(in_use)} in use "
        f"after loading weights - {_gib(activation_reserve)} activation reserve"
    )
    if kv_cache_memory is not None and kv_cache_memory < budget:
        return kv_cache_memory, f"kv_cache_memory {_gib(kv_cache_memory)} (the GPU allows more)"
    return budget, source


def plan_for(
    config: EngineConfig, runners: Sequence[ModelRunner], max_len: int, max_num_drafts: int
) -> KVPlan:
    """The plan for these loaded runners (target first): memory figures from the target's
    device, bytes per block and activations from each model. A step has at most
    max_num_batched_tokens tokens and samples or verifies at most max_num_seqs * (1 +
    max_num_drafts) rows of them; each model's activations are reserved in full (the draft's
    probabilities outlive its forward, into verification)."""
    bytes_per_block = sum(r.kv_bytes_per_block for r in runners)
    num_logit_rows = min(config.max_num_batched_tokens, config.max_num_seqs * (1 + max_num_drafts))
    blocks_per_seq = -(-max_len // config.block_size)
    reserve = sum(
        activation_bytes(
            r.model_config, r.dtype.itemsize, config.max_num_batched_tokens, num_logit_rows
        )
        for r in runners
    )
    # A target an EAGLE-3 head taps keeps its tapped layers' inputs for a whole step's tokens
    # until the head's extend has read them.
    target = runners[0]
    num_taps = len(getattr(getattr(target, "model", None), "aux_layers", ()))
    reserve += (
        num_taps
        * target.model_config.hidden_size
        * target.dtype.itemsize
        * config.max_num_batched_tokens
    )
    # The workspace lives inside one layer's attention and models run their forwards one after
    # another, so the largest model's is the most that is ever alive.
    reserve += max(attention_workspace_bytes(r, max_len) for r in runners)
    # Captured CUDA graphs keep their own pool of activations for the largest captured step,
    # alive beside the eager steps' (engine.execution.cuda_graphs; flash_attn and triton are the backends
    # they capture).
    device = runners[0].device
    if (
        device.is_cuda
        and not config.enforce_eager
        and config.attention_backend in GRAPHABLE_BACKENDS
    ):
        graph_tokens = min(
            config.max_num_batched_tokens,
            config.max_num_seqs * (1 + max_num_drafts),
            MAX_CAPTURE_TOKENS,
        )
        reserve += sum(
            activation_bytes(r.model_config, r.dtype.itemsize, graph_tokens, 0) for r in runners
        )
        # The pool keeps the attention's scratch of its captured steps too (Triton's partials).
        reserve += max(attention_workspace_bytes(r, max_len) for r in runners)
        # A tapped target's graphs keep its taps as a second output; an EAGLE-3 head's graphs
        # read their hidden input from a fixed tensor.
        reserve += num_taps * target.model_config.hidden_size * target.dtype.itemsize * graph_tokens
        reserve += sum(
            getattr(r.model, "input_hidden_size", 0) * r.dtype.itemsize * graph_tokens
            for r in runners
        )
    return plan_kv_cache(
        bytes_per_block,
        runners[0].device.memory_info(),
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
        activation_reserve=reserve,
        full_length_bytes=config.max_num_seqs * blocks_per_seq * bytes_per_block,
    )


def log_memory(plan: KVPlan, runners: Sequence[ModelRunner], block_size: int) -> None:
    """One start-up line: each model's weights and KV, the blocks, and the budget's source."""
    weights = " + ".join(f"{r.name} {_gib(r.weight_bytes)} ({r.weight_format})" for r in runners)
    kv = " + ".join(f"{r.name} {_gib(r.kv_bytes_per_block * plan.num_blocks)}" for r in runners)
    logger.info(
        "memory: weights %s; KV %s in %d blocks of %d tokens (attention %s); budget %s from %s",
        weights,
        kv,
        plan.num_blocks,
        block_size,
        runners[0].backend.name,
        _gib(plan.budget),
        plan.source,
    )


def release_freed_heap() -> bool:
    """Give the pages the C heap has freed back to the OS (glibc's malloc_trim). Loading frees
    much more than it keeps (the GGUF file's reads and conversions, the route timings' scratch),
    and glibc keeps freed memory in its arenas, where it stays resident: about 0.5 GiB at the
    start of the bundled 1.5B. Returns whether it ran (False where the C library is not glibc)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
