"""The policy's decisions, offline: one workload at one concurrency through the engine itself (no
HTTP, no mode switches), each mode in turn on a fresh engine of the config.

Where the sliced HTTP bench (bench/policy/run.py) reads a host's drift as much as the policy, this
shows what auto decided and why: per mode, tokens/s over the whole run, engine steps, the
policy's decisions by reason, the catch-up tokens it granted, drafts and accepted drafts per
source, the seconds of drafting and of verify steps, and what the policy ended up pricing a draft
model's forward and a token of its catch-up at. Requests are greedy, --max-tokens long,
drawn round-robin from the workload (bench/policy/workload.py), c held in flight; every prompt is
in the prefix cache first (a 1-token request each).

    python -m bench.policy.offline [--config configs/default.yaml] [--workload open_chat]
        [--concurrency 1] [--requests 8] [--modes off,auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common.processes import cpu_isa, host
from bench.policy.workload import code_edit_prompts, code_gen_prompts, open_chat_prompts
from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.text.tokenizer import apply_chat_template

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.policy.offline")
WORKLOADS = {
    "open_chat": open_chat_prompts,
    "code_gen": code_gen_prompts,
    "code_edit": code_edit_prompts,
}


def run(
    config: dict[str, Any], mode: str, texts: list[str], concurrency: int, num: int, max_tokens: int
) -> dict[str, Any]:
    engine_args = dict(config)
    spec = dict(engine_args.pop("speculative_config"))
    spec["mode"] = mode
    llm = LLM(**engine_args, speculative_config=spec)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": t}]) for t in texts]
    for prompt in prompts:  # the prefix cache holds every prompt, as in the HTTP bench
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    catch_up: collections.Counter[str] = collections.Counter()
    propose = engine.speculator.propose

    def counting(schedule):  # type: ignore[no-untyped-def]
        for d in schedule.decisions:
            if d.num_catch_up:
                catch_up[d.reason] += d.num_catch_up
        return propose(schedule)

    engine.speculator.propose = counting
    decisions_before = dict(engine.policy_stats.decisions)
    generated_before = engine.metrics.num_generation_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pending = [(i, prompts[i % len(prompts)]) for i in range(num)]
    steps, start = 0, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while (
            pending and len(engine.scheduler.running) + len(engine.scheduler.waiting) < concurrency
        ):
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    generated = engine.metrics.num_generation_tokens - generated_before
    decisions = decisions_since(engine, decisions_before)
    spec_stats = engine.spec_stats
    costs = engine.policy.costs
    return {
        "mode": mode,
        "tokens_per_s": generated / seconds,
        "tokens": generated,
        "seconds": seconds,
        "steps": steps,
        "decisions": decisions,
        "catch_up_tokens": dict(catch_up),
        "draft_tokens": spec_stats.num_draft_tokens,
        "accepted_tokens": spec_stats.num_accepted_tokens,
        "by_source": {
            k: {"draft_tokens": v[0], "accepted": v[1]} for k, v in spec_stats.by_source.items()
        },
        "draft_seconds": spec_stats.draft_time,
        "verify_seconds": spec_stats.verify_time,
        # what the policy prices a draft model's forward and a token of its catch-up at, at the end
        "draft_forward_seconds": costs.draft_forward_seconds,
        "catch_up_seconds_per_token": costs.catch_up_seconds_per_token,
    }


def decisions_since(engine: LLMEngine, before: dict[tuple[str, str], int]) -> dict[str, int]:
    """The policy's decisions since `before` (a copy of engine.policy_stats.decisions), as
    "decision/reason": count, the reasons that did not occur left out."""
    counts = {
        f"{decision}/{reason}": count - before.get((decision, reason), 0)
        for (decision, reason), count in engine.policy_stats.decisions.items()
    }
    return {key: count for key, count in counts.items() if count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy.offline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="open_chat")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--modes", default="off,auto")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "policy-offline.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = yaml.safe_load(Path(args.config).read_text())["engine"]
    texts = WORKLOADS[args.workload]()
    results = []
    for mode in args.modes.split(","):
        result = run(config, mode, texts, args.concurrency, args.requests, args.max_tokens)
        logger.info("%s", json.dumps(result))
        results.append(result)
    by_mode = {r["mode"]: r["tokens_per_s"] for r in results}
    if "off" in by_mode and "auto" in by_mode:
        logger.info("auto / off: %.3f", by_mode["auto"] / by_mode["off"])
    report = {
        "host": host(),
        "cpu_isa": cpu_isa(),
        "config": args.config,
        "workload": args.workload,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
