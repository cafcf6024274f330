"""The drafters side by side on one deployment: tokens/s and mean acceptance length of each
drafter, at each concurrency, on each workload, through the engine (no HTTP), in one run.

Drafters (--drafters): off; ngram; draft_model (the config's draft model: the bundled 0.5B for
the default 1.5B); eagle3 (the head directory --head, in Q8_0 blocks on the CPU, or Q6_K with
--head-quantization q6_k, or dense in --head-dtype); ngram+draft_model and ngram+eagle3 (lookup first). Each drafter gets an engine of
the config of its own, all held at once, in the policy mode --mode (auto: what a deployment
runs; always: the drafter's acceptance with the policy out of the way). A cell (a workload at a
concurrency) runs on every engine in turn, --rounds times with the order rotated, so that a
host whose speed drifts over minutes (single runs on a shared 2-core host differ by 10%) moves
every drafter alike: --requests greedy requests (at least c), --max-tokens long, drawn
round-robin from the workload (bench/policy/workload.py: code_edit, copy, open_chat, code_gen),
c held in flight, every prompt in each engine's prefix cache first.

Reported per cell: generated tokens/s over the cell, mean acceptance length (tokens a verify step
emits: accepted drafts + 1, over the steps that verified drafts), the acceptance rate, draft
seconds per draft token, the policy's decisions by reason, and how many answers equal
speculation-off's token for token (off must run first for that).

    python -m bench.drafters --head DIR [--head-quantization q8_0|q6_k] [--config FILE]
        [--drafters off,ngram,draft_model,eagle3] [--workloads code_edit,copy,open_chat]
        [--concurrency 1,4,16] [--requests 4] [--max-tokens 64] [--rounds 2] [--mode auto]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common.processes import cpu_isa, host
from bench.policy import workload as policy_workload
from bench.policy.offline import decisions_since
from engine import LLM, SamplingParams
from engine.outputs import OutputAccumulator
from engine.text.tokenizer import apply_chat_template

ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger("bench.drafters")
WORKLOADS = {**policy_workload.WORKLOADS, "copy": policy_workload.copy_prompts}
DRAFTERS = ("off", "ngram", "draft_model", "eagle3", "ngram+draft_model", "ngram+eagle3")


def speculative_config(
    drafter: str,
    base: dict[str, Any],
    head: str | None,
    head_dtype: str | None,
    mode: str,
    head_quantization: str = "q8_0",
) -> dict[str, Any] | None:
    """The config's speculative_config turned to one drafter (None: speculation off). The head
    runs in head_dtype's dense weights where given, else in head_quantization's blocks."""
    if drafter == "off":
        return None
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; one of {', '.join(DRAFTERS)}")
    spec = {k: v for k, v in base.items() if k not in ("method", "model")}
    spec.update(method=drafter, mode=mode)
    if drafter.endswith("draft_model"):
        spec["model"] = base["model"]
    elif drafter.endswith("eagle3"):
        if head is None:
            raise ValueError(f"{drafter} needs --head")
        spec["model"] = head
        if head_dtype:
            spec["draft_dtype"] = head_dtype
        else:
            spec["draft_quantization"] = head_quantization
    return spec


def run_cell(
    llm: LLM, prompts: list[list[int]], concurrency: int, num: int, max_tokens: int
) -> dict[str, Any]:
    """`num` greedy requests over `prompts`, `concurrency` in flight; counters as deltas (the
    rates come from `combine`)."""
    engine = llm.engine
    stats = engine.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.draft_time)
    generated_before = engine.metrics.num_generation_tokens
    decisions_before = dict(engine.policy_stats.decisions)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pending = list(range(num))
    answers: dict[int, list[int]] = {}
    accumulator = OutputAccumulator()
    steps, start = 0, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_unfinished_requests < concurrency:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i % len(prompts)], params)
        for out in accumulator.add_step(engine.step()):
            answers[int(out.request_id)] = list(out.outputs[0].token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    drafts, draft_tokens, accepted, draft_seconds = (
        now - then
        for now, then in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.draft_time),
            before,
            strict=True,
        )
    )
    return {
        "tokens": engine.metrics.num_generation_tokens - generated_before,
        "seconds": seconds,
        "steps": steps,
        "verify_steps_with_drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "draft_seconds": draft_seconds,
        "decisions": decisions_since(engine, decisions_before),  # per request and step
        "answers": [answers[i] for i in range(num)],
    }


def run_interleaved(
    engines: dict[str, LLM],
    workloads: dict[str, list[str]],
    levels: list[int],
    requests: int,
    max_tokens: int,
    rounds: int,
) -> dict[str, dict[tuple[str, int], dict[str, Any]]]:
    """Every cell on every drafter's engine in turn, `rounds` times, the order rotated each
    round, so a host whose speed drifts over minutes moves every drafter alike; a cell's figures
    add its rounds up."""
    names = list(engines)
    results: dict[str, dict[tuple[str, int], dict[str, Any]]] = {d: {} for d in names}
    for workload, texts in workloads.items():
        tokenizer = engines[names[0]].get_tokenizer()
        prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": t}]) for t in texts]
        for llm in engines.values():  # every prompt in the prefix cache, as a server's would be
            for prompt in prompts:
                llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        for c in levels:
            runs: dict[str, list[dict[str, Any]]] = {d: [] for d in names}
            for r in range(rounds):
                for drafter in names[r % len(names) :] + names[: r % len(names)]:
                    runs[drafter].append(
                        run_cell(engines[drafter], prompts, c, max(requests, c), max_tokens)
                    )
            for drafter, cells in runs.items():
                results[drafter][(workload, c)] = combine(cells)
                logger.info(
                    "%s c=%d %s: %.2f tok/s, acceptance length %s",
                    workload,
                    c,
                    drafter,
                    results[drafter][(workload, c)]["tokens_per_s"],
                    results[drafter][(workload, c)]["mean_acceptance_length"],
                )
    return results


def combine(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's rounds as one: counters and seconds added, the rates from the sums; the answers
    are the first round's (greedy: every round gives the same ones, which is checked)."""
    counters = ("tokens", "seconds", "steps", "verify_steps_with_drafts", "draft_tokens")
    total = {key: sum(cell[key] for cell in cells) for key in (*counters, "accepted_tokens")}
    decisions: dict[str, int] = {}
    for cell in cells:
        for key, count in cell["decisions"].items():
            decisions[key] = decisions.get(key, 0) + count
    drafts, draft_tokens = total["verify_steps_with_drafts"], total["draft_tokens"]
    accepted, draft_seconds = total["accepted_tokens"], sum(c["draft_seconds"] for c in cells)
    return {
        **total,
        "rounds": len(cells),
        "tokens_per_s": total["tokens"] / total["seconds"],
        "tokens_per_s_by_round": [cell["tokens"] / cell["seconds"] for cell in cells],
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "draft_seconds_per_draft_token": draft_seconds / draft_tokens if draft_tokens else None,
        "decisions": decisions,
        "rounds_agree": all(cell["answers"] == cells[0]["answers"] for cell in cells),
        "answers": cells[0]["answers"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.drafters", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--head", help="an EAGLE-3 head directory (for the eagle3 drafters)")
    parser.add_argument("--head-dtype", help="the head's dense dtype (default: blocks)")
    parser.add_argument(
        "--head-quantization",
        default="q8_0",
        choices=["q8_0", "q6_k"],
        help="the head's blocks without --head-dtype (q6_k: int8 activations where the config's)",
    )
    parser.add_argument("--drafters", default="off,ngram,draft_model,eagle3")
    parser.add_argument("--workloads", default="code_edit,copy,open_chat")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=4, help="per cell (at least c)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="of each cell, drafters in turn")
    parser.add_argument("--mode", default="auto", choices=["auto", "always"])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "drafters.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = yaml.safe_load(Path(args.config).read_text())["engine"]
    base = config.pop("speculative_config")
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; one of {', '.join(WORKLOADS)}")
    levels = [int(c) for c in args.concurrency.split(",")]
    if max(levels) > config.get("max_num_seqs", 256):
        parser.error("a concurrency above the config's max_num_seqs would queue, not run")
    specs = {
        d: speculative_config(
            d, base, args.head, args.head_dtype, args.mode, args.head_quantization
        )
        for d in drafters
    }
    workloads = {w: WORKLOADS[w]() for w in names}
    engines = {}
    for drafter in drafters:  # all at once: each KV budget is the config's, each its own
        logger.info("drafter %s: %s", drafter, specs[drafter])
        engines[drafter] = LLM(**config, speculative_config=specs[drafter])
    results = run_interleaved(
        engines, workloads, levels, args.requests, args.max_tokens, args.rounds
    )
    rows = []
    for drafter, cells in results.items():
        for (workload, c), cell in cells.items():
            off = results.get("off", {}).get((workload, c))
            row = {"drafter": drafter, "workload": workload, "concurrency": c}
            row.update({k: v for k, v in cell.items() if k != "answers"})
            if off is not None:
                row["vs_off"] = cell["tokens_per_s"] / off["tokens_per_s"]
                row["answers_equal_to_off"] = sum(
                    a == b for a, b in zip(cell["answers"], off["answers"], strict=True)
                )
                row["answers"] = len(cell["answers"])
            rows.append(row)
    print_table(rows)
    report = {
        "host": host(),
        "cpu_isa": cpu_isa(),
        "config": args.config,
        "head": args.head,
        "head_weights": args.head_dtype or args.head_quantization,
        "mode": args.mode,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "speculative_configs": specs,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", args.out)
    return 0


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'workload':<10} {'c':>3} {'drafter':<18} {'tok/s':>7} {'vs off':>7} "
        f"{'accept len':>10} {'= off':>6}"
    )
    for r in sorted(rows, key=lambda r: (r["workload"], r["concurrency"])):
        length = r["mean_acceptance_length"]
        same = f"{r['answers_equal_to_off']}/{r['answers']}" if "answers" in r else ""
        print(
            f"{r['workload']:<10} {r['concurrency']:>3} {r['drafter']:<18} "
            f"{r['tokens_per_s']:>7.2f} {r.get('vs_off', float('nan')):>6.2f}x "
            f"{'-' if length is None else f'{length:.2f}':>10} {same:>6}"
        )


if __name__ == "__main__":
    sys.exit(main())
