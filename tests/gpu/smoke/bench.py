"""The smoke bench: the GPU preset's engine over a random-weight model of a real shape, at a few
concurrencies, speculation off and auto, CUDA graphs on and off; then the price of the
batch-invariant mode (`batch_invariant: true`: Triton products, norms and attention; no
speculation; graphs on) at the first two concurrencies, to read against the first engine's "off"
rows;
and a random EAGLE-3 head in mode always with graphs, at the same two.

One engine per graphs setting (`enforce_eager`), built as the preset builds it: KV sized by
`gpu_memory_utilization`, mode auto calibrated at start. Each point keeps `concurrency` greedy
requests in flight for `duration_s` (a finished request is replaced at once; EOS ignored so each
does the same work) and measures generated tokens/s, TTFT, the share of target forwards that
replayed a CUDA graph and the peak of torch's allocator against the engine's budget. Speculation
is switched between off and auto on the same engine through the operator API, so the two modes
share weights, KV pool and graphs.
"""

from __future__ import annotations

import gc
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.speculative_config import SpeculativeConfig
from tests.gpu.smoke.counters import ReplayCounter, StepBreakdown
from tests.gpu.smoke.models import ModelPair

logger = logging.getLogger(__name__)

PRESET = Path(__file__).resolve().parents[3] / "configs" / "gpu-qwen2.5-coder-1.5b.yaml"
CONCURRENCIES = (1, 8, 64)
MODES = ("off", "auto")
INVARIANT_CONCURRENCIES = CONCURRENCIES[:2]


@dataclass(frozen=True)
class Workload:
    """What every request of a point asks for: a random prompt, then greedy tokens."""

    prompt_len: int
    max_tokens: int
    duration_s: float
    seed: int = 0


@dataclass(frozen=True)
class PointResult:
    """One (graphs, mode, concurrency) point: JSON as it is."""

    graphs: bool
    batch_invariant: bool
    mode: str
    concurrency: int
    seconds: float
    num_requests: int
    num_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    num_steps: int
    graph_share: float | None  # target forwards that replayed a graph, over all of them
    draft_graph_share: float | None  # the same for the draft model's forwards
    acceptance: float | None  # accepted draft tokens over drafted ones
    peak_memory_bytes: int | None  # torch.cuda.max_memory_allocated during the point
    drafts_per_step: float | None = None  # draft tokens verified per target step: how much the
    # policy chose to speculate
    steps: dict[str, Any] | None = None  # StepBreakdown.summary(): where the steps' time went


def engine_config(
    pair: ModelPair, device: torch.device, graphs: bool, **overrides: Any
) -> EngineConfig:
    """The GPU preset's engine over `pair`: its target and draft replace the bundled models;
    where flash-attn cannot run (a bare node, the CPU dry run) the backend is auto's choice."""
    from engine.attention import flash_attn_available

    settings = yaml.safe_load(PRESET.read_text())["engine"]
    settings["speculative_config"] = dict(settings["speculative_config"], model=str(pair.draft))
    settings.update(model=str(pair.target), device=str(device), enforce_eager=not graphs)
    if settings["attention_backend"] == "flash_attn" and not flash_attn_available():
        settings.update(attention_backend="auto", block_size=None)
    settings.update(overrides)
    if settings.get("batch_invariant"):  # the mode takes its own attention backend
        settings.update(attention_backend="auto", block_size=None, speculative_config=None)
    # The preset's mapping, parsed as the server's settings parse it.
    settings["speculative_config"] = SpeculativeConfig.parse(settings["speculative_config"])
    return EngineConfig(**settings)


def run_engine(
    config: EngineConfig, workload: Workload, concurrencies=CONCURRENCIES, modes=MODES
) -> dict:
    """Every (mode, concurrency) point on one engine -> {"engine": facts, "points": [...]}. An
    engine without speculation runs mode "off" alone."""
    device = config.torch_device()
    is_cuda = device.type == "cuda"
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    built = time.perf_counter()
    engine = LLMEngine(config)
    facts = _engine_facts(engine, config, time.perf_counter() - built)
    target = ReplayCounter(engine.runner)
    draft = ReplayCounter(engine.draft_runner) if engine.draft_runner is not None else None
    breakdown = StepBreakdown(engine)
    warm_up = Workload(workload.prompt_len, 4, 0.0, workload.seed)
    _run_point(engine, 2, warm_up, stream="warm-up")
    points = []
    if config.speculative_config is None:
        modes = ("off",)
    for mode in modes:
        if config.speculative_config is not None:
            engine.set_speculation_mode(mode)
        for concurrency in concurrencies:
            for counter in (target, draft):
                if counter is not None:
                    counter.reset()
            breakdown.reset()
            if is_cuda:
                torch.cuda.reset_peak_memory_stats(device)
            spec_before = (
                engine.spec_stats.num_draft_tokens,
                engine.spec_stats.num_accepted_tokens,
            )
            result = _run_point(engine, concurrency, workload, stream=mode)
            drafted = engine.spec_stats.num_draft_tokens - spec_before[0]
            accepted = engine.spec_stats.num_accepted_tokens - spec_before[1]
            point = PointResult(
                graphs=not config.enforce_eager,
                batch_invariant=config.batch_invariant,
                mode=mode,
                concurrency=concurrency,
                graph_share=target.share,
                draft_graph_share=draft.share if draft is not None else None,
                acceptance=accepted / drafted if drafted else None,
                drafts_per_step=drafted / result["num_steps"] if result["num_steps"] else None,
                steps=breakdown.summary(),
                peak_memory_bytes=torch.cuda.max_memory_allocated(device) if is_cuda else None,
                **result,
            )
            logger.info("smoke bench point: %s", point)
            points.append(asdict(point))
    facts["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if is_cuda else None
    facts["step_model_after"] = _step_model(engine)
    del engine, target, draft, breakdown
    gc.collect()
    if is_cuda:
        torch.cuda.empty_cache()  # the next engine measures its budget from what is free
    return {"engine": facts, "points": points}


def _engine_facts(engine: LLMEngine, config: EngineConfig, build_s: float) -> dict[str, Any]:
    device = config.torch_device()
    budget = None
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        budget = int(config.gpu_memory_utilization * total)
    return {
        "graphs": not config.enforce_eager,
        "batch_invariant": config.batch_invariant,
        "speculation": config.speculative_config.method if config.speculative_config else None,
        "attention_backend": config.attention_backend,
        "block_size": config.block_size,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "num_kv_blocks": engine.runner.num_blocks,
        "max_model_len": engine.max_model_len,
        "num_graph_buckets": len(engine.runner.graphs.buckets) if engine.runner.graphs else 0,
        "memory_budget_bytes": budget,  # gpu_memory_utilization x the device's memory
        "build_s": round(build_s, 2),
        "step_model": _step_model(engine),
        "fused_layers": config.fused_layers,
        "overlap_scheduling": engine.overlap,
        "kernels_per_decode_step": _kernels_per_decode_step(engine),
    }


def _kernels_per_decode_step(engine: LLMEngine) -> dict[str, Any] | None:
    """The kernels one eager decode step of the target launches on the device (torch's
    profiler, CUDA activity; copies and fills left out), in all and per layer: the count that
    tests/unit/test_triton_layer.py holds on the CPU, read on the card. One token at position 0
    of block 0, which no request holds yet (a request writes every position before reading
    it). None on the CPU; the error where the profiler fails (recorded, never fatal)."""
    runner = engine.runner
    if not runner.device.is_cuda:
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        from engine.core.chunks import SeqChunk

        with torch.inference_mode():
            _, ctx, ids = runner.step_inputs([SeqChunk([1], 0, [0], 1)])
            runner.model(ids, ctx)  # compiled and warm before it is counted
            torch.cuda.synchronize(runner.device.torch)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.model(ids, ctx)
                torch.cuda.synchronize(runner.device.torch)
        names = [
            e.name
            for e in prof.events()
            if e.device_type.name == "CUDA" and not e.name.lower().startswith(("memcpy", "memset"))
        ]
        layers = runner.model_config.num_layers
        return {"total": len(names), "per_layer": round(len(names) / layers, 2)}
    except Exception as e:  # noqa: BLE001 - a figure the report may lack, not a failed node
        return {"error": repr(e)}


def _step_model(engine: LLMEngine) -> dict[str, Any] | None:
    """What mode auto prices steps with: its predictions (ms) of decode steps and of a verify
    batch, at no context and at 1,000 cached positions a sequence."""
    policy = getattr(engine, "policy", None)
    model = getattr(policy, "step_model", None)
    if model is None or not getattr(policy, "is_calibrated", True):
        return None
    from engine.core.chunks import attention_reads

    def ms(seconds: float) -> float:
        return round(seconds * 1e3, 3)

    facts: dict[str, Any] = {"knee": getattr(model, "knee", None)}
    for n in (1, 8, 64):
        facts[f"t{n}_ms"] = ms(model.predict(n, n * attention_reads(0, 1)))
        facts[f"t{n}_ctx1000_ms"] = ms(model.predict(n, n * attention_reads(1000, 1)))
        facts[f"verify{n}x4_ctx1000_ms"] = ms(
            model.predict(4 * n, n * attention_reads(1000, 4), 4 * n)
        )
    for name in ("context_coef", "row_coef"):
        facts[name] = getattr(model, name, None)
    return facts


def _run_point(
    engine: LLMEngine, concurrency: int, workload: Workload, stream: str = ""
) -> dict[str, Any]:
    """Keep `concurrency` requests in flight for the workload's duration (at least until the
    first batch finished when the duration is 0); abort what is left. The prompts are drawn
    from the seed, the concurrency and `stream`: points that name different streams (each mode
    of an engine) get different prompts, so none finds the other's in the prefix cache."""
    rng = random.Random(f"{workload.seed}/{concurrency}/{stream}")
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=workload.max_tokens, ignore_eos=True)
    arrivals: dict[str, float] = {}
    ttfts: list[float] = []
    ids = (f"smoke-{concurrency}-{i}" for i in range(10**9))

    def add() -> None:
        request_id = next(ids)
        prompt = [rng.randrange(3, vocab) for _ in range(workload.prompt_len)]
        arrivals[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt, params)

    for _ in range(concurrency):
        add()
    start = time.perf_counter()
    num_tokens = num_steps = num_finished = 0
    while arrivals:
        outputs = engine.step()
        now = time.perf_counter()  # step() returns tokens on the host: the device is done
        num_steps += 1
        is_over = now - start >= workload.duration_s
        for out in outputs:
            new = sum(len(c.token_ids) for c in out.outputs)
            num_tokens += new
            arrival = arrivals.get(out.request_id)
            if new and arrival is not None and out.outputs[0].num_output_tokens == new:
                ttfts.append(now - arrival)  # this step gave the request its first tokens
            if out.finished:
                arrivals.pop(out.request_id, None)
                num_finished += 1
                if not is_over:
                    add()
        if is_over and num_finished:
            break
    for request_id in list(arrivals):
        engine.abort(request_id)
    seconds = time.perf_counter() - start
    return {
        "seconds": round(seconds, 3),
        "num_requests": num_finished,
        "num_tokens": num_tokens,
        "tokens_per_s": round(num_tokens / seconds, 1),
        "ttft_p50_ms": _percentile_ms(ttfts, 50),
        "ttft_p95_ms": _percentile_ms(ttfts, 95),
        "num_steps": num_steps,
    }


def _percentile_ms(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1e3, 2)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3, 2)
