"""The host's time per engine step, modes off and auto, as the batch grows, where nothing drafts.

    python -m bench.policy.host_time [--sizes 8,64,256] [--steps 150] [--rounds 3]
        [--against PATH] [--out FILE]

On a GPU the host's work between forwards (scheduling, the policy, the lookups, building inputs,
sampling and bookkeeping) is time the device waits unless it overlaps, so a policy that drafts
nothing must cost what mode off costs. This runs the real `LLMEngine` step, every part of it, over
a small random-weight Qwen2-shaped model (tests/gpu/smoke/models.py's TINY: 320 tokens) whose
forward is replaced by a scripted device: it builds the step's inputs as a real forward does (the
flattened step and the attention metadata: host work), then sleeps for the GPU-shaped forward time
bench/policy/cost.py prices with (t(1) = 3.5 ms, 4.8 ms at 64), and returns logits whose greedy
token is a hash of the row's last token, its position and its sequence, so outputs do not repeat
and n-gram lookups find only chance matches that verify rejects.

Each size runs `n` requests of 32 prompt tokens decoding together (ignore_eos), n-gram drafting
(prompt_lookup_min 1, 3 tokens), a step-time model of the same figures, and times `steps` steady
decode steps after a warm-up in which auto learns the lookups' acceptance. The host time of a step
is its wall time less the scripted forward's (StepStats' overhead: what the H200 run reported as
the step's "rest"). Reported: the median per step over rounds, by mode and size, the share of
steps auto drafted in, and auto / off.

`--against PATH` times the same steps with the engine package of another checkout (a worktree of
an earlier commit), round by round alternating with this one: the two versions side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.processes import commit_of, side_by_side, write_result
from engine.policy.calibration_cache import cpu_name

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = 32
# The GPU-shaped step times bench/policy/cost.py prices with (an H200's 1.5B shape, graphs).
GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
MS = [3.46, 3.47, 3.5, 3.9, 4.0, 4.3, 4.77, 6.0, 8.5, 13.0, 22.0]


def _scripted_forward(runner: Any, model: Any, vocab: int) -> Any:
    """A forward that does a real forward's host work, sleeps for the step model's time (or
    queues it on a device whose timeline runs beside the host, bench/policy/overlap.py), and
    returns one-hot logits of a hash of each sampling row's input token (a token an overlapped
    step carries included, as the device has it), position and sequence."""
    import torch

    def forward(chunks: Any, carry: Any = None) -> Any:
        # The flattened step, its attention metadata and its input ids.
        step, _, ids = runner.step_inputs(chunks, carry)
        seconds = model.predict(len(step.token_ids), 0, len(step.logit_rows))
        enqueue = getattr(runner.device, "enqueue", None)  # a device with a timeline of its own
        if enqueue is not None:
            enqueue(seconds)
        else:
            time.sleep(seconds)
        if not step.logit_rows:
            return None
        rows, positions = [], []
        first = 0
        for c in chunks:
            for j in range(len(c.token_ids) - c.num_logits, len(c.token_ids)):
                rows.append(first + j)
                positions.append(c.start + j + 7919 * c.block_table[0])
            first += len(c.token_ids)
        key = ids[torch.tensor(rows)] * 1_000_003 + torch.tensor(positions) * 7_368_787
        tokens = (key ^ (key >> 13)) % (vocab - 3) + 3  # never bos (1) or eos (2)
        logits = torch.zeros(len(rows), vocab)
        logits[torch.arange(len(rows)), tokens] = 10.0
        return logits

    return forward


def step_model() -> Any:
    """The scripted device's step-time model, held at its figures (rate 0): the fake's measured
    forward holds the CPU's verify as well, which a model learning from it would read as a
    flatter curve. Its observe still runs, as every step's does."""
    from engine.policy.step_time import StepTimeModel

    ms = [m / 1e3 for m in MS]
    return StepTimeModel(GRID, ms, context_coef=2.0e-7, row_coef=2.0e-6, rate=0.0)


def scripted_engine(
    num_requests: int, mode: str, steps: int, model_dir: str, overlap: bool = False
) -> Any:
    """An engine of `num_requests` decoding requests (32-token prompts, ignore_eos) over the
    scripted device, drafting by n-gram lookup in `mode`, its policy pricing with
    `step_model`."""
    import random

    import torch

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.speculative_config import SpeculativeConfig

    torch.set_num_threads(1)
    spec = SpeculativeConfig(
        method="ngram", mode="off", num_speculative_tokens=3, prompt_lookup_min=1
    )
    max_tokens = 64 + steps + 8
    config = EngineConfig(
        model=model_dir,
        dtype="float32",
        block_size=16,
        max_num_seqs=num_requests,
        max_num_batched_tokens=max(2048, 8 * num_requests),
        max_model_len=PROMPT_TOKENS + max_tokens + 16,
        num_kv_blocks=num_requests * ((PROMPT_TOKENS + max_tokens) // 16 + 3),
        speculative_config=spec,
        seed=0,
        overlap_scheduling=overlap,
    )
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    engine.runner.forward = _scripted_forward(engine.runner, step_model(), vocab)
    policy = engine.policy
    policy.step_model = step_model()  # each decision prices with it (SpeculationPolicy.decide)
    policy.is_calibrated = True
    policy.set_mode(mode)
    rng = random.Random(num_requests)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]
        engine.add_request(f"r{i}", prompt, params)
    return engine


def time_steps(num_requests: int, mode: str, steps: int, model_dir: str) -> dict[str, float]:
    """Mean host seconds of an engine step of `num_requests` decoding requests in `mode`, and
    the share of timed steps that drafted."""
    engine = scripted_engine(num_requests, mode, steps, model_dir)
    seconds: list[float] = []
    drafted = 0

    def record(stats: Any) -> None:
        nonlocal drafted
        seconds.append(stats.overhead_seconds)
        drafted += any(d.num_draft_tokens for d in stats.decisions)

    observe = engine._observe
    for _ in range(64):  # prompts, then decodes while auto learns the lookups' acceptance
        engine.step()
    engine._observe = lambda stats, requests: (record(stats), observe(stats, requests))
    for _ in range(steps):
        engine.step()
    return {
        "host_seconds": statistics.mean(seconds),
        "median_host_seconds": statistics.median(seconds),
        "drafted_share": drafted / steps,
    }


def time_modes(sizes: list[int], steps: int, model_dir: str) -> dict[str, dict[str, Any]]:
    """time_steps for each mode and size: {mode: {size: result}}."""
    return {
        mode: {str(n): time_steps(n, mode, steps, model_dir) for n in sizes}
        for mode in ("off", "auto")
    }


def build_model(root: Path) -> str:
    """The TINY random-weight target under root (float32), its directory."""
    import torch

    from tests.gpu.smoke.models import TINY, build_pair

    pair = build_pair(root, TINY, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    return str(pair.target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy.host_time", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", default="8,64,256", help="decoding requests a step")
    parser.add_argument("--steps", type=int, default=150, help="steps timed per point")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout to time side by side")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/host-time.json")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        roots, rounds = side_by_side(
            args.against,
            args.rounds,
            "bench.policy.host_time",
            "time_modes",
            (sizes, args.steps, build_model(Path(tmp))),
            lambda got: ", ".join(
                f"{mode} {n}: {got[mode][str(n)]['host_seconds'] * 1e3:.3f} ms"
                for mode in got
                for n in sizes
            ),
        )

    def median(name: str, mode: str, n: int, field: str) -> float:
        return statistics.median(run[mode][str(n)][field] for run in rounds[name])

    result: dict[str, Any] = {
        "host": cpu_name(),
        "model": "tests/gpu/smoke/models.py TINY (Qwen2 shape, 320 tokens), float32, CPU",
        "forward_ms": dict(zip(map(str, GRID), MS, strict=True)),
        "steps": args.steps,
        "rounds": args.rounds,
        "commits": {name: commit_of(root) for name, root in roots.items()},
        "host_ms": {
            name: {
                mode: {str(n): median(name, mode, n, "host_seconds") * 1e3 for n in sizes}
                for mode in ("off", "auto")
            }
            for name in roots
        },
        "auto_drafted_share": {
            name: {str(n): median(name, "auto", n, "drafted_share") for n in sizes}
            for name in roots
        },
    }
    result["auto_over_off"] = {
        name: {
            str(n): result["host_ms"][name]["auto"][str(n)] / result["host_ms"][name]["off"][str(n)]
            for n in sizes
        }  # fmt: skip
        for name in roots
    }
    if args.against:
        result["this_over_against"] = {
            mode: {
                str(n): result["host_ms"]["this"][mode][str(n)]
                / result["host_ms"]["against"][mode][str(n)]
                for n in sizes
            }  # fmt: skip
            for mode in ("off", "auto")
        }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
