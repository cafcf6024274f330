"""Structured outputs, side by side in one run: json_schema tokens/s, speculation on and off.

Decode tokens/s of json_schema output and the grammar's cost per token. The schema-heavy extraction cases of bench/structured/workload.py (a paragraph, a schema with
many keys, nested objects, arrays of objects and enums), chat-templated, batch 1, greedy, three
modes on the same prompts:

- free: no grammar, speculation off — the reference for the grammar's cost (its outputs differ,
  so that cost is compared per token: ms/token of `grammar` minus ms/token of `free`);
- grammar: `SamplingParams(structured=StructuredOutput.json_schema(...))`, speculation off;
- grammar_spec: the same with speculation on: the grammar's forced text (keys, punctuation,
  closing brackets, the rest of an enum value) drafted first, then --method (n-gram; or a
  chain with the draft model, e.g. ngram+draft_model).

Two engines are loaded at once (speculation mode "off", and --spec-mode), and the modes alternate
per case and round, so drift hits them alike; each grammar is compiled in a warm-up first.
Decode speed leaves the prompt out: each generation is timed at its first token (the prefill) and
at its end, (n - 1) / (t_end - t_first) in the same run, medians over rounds, prefix caching
off. Reports tokens/s per mode,
grammar_spec / grammar, the grammar's ms per token, that grammar and grammar_spec outputs are
token-identical (speculation is lossless: a row's product does not depend on its batch, with
float32 activations and with int8 ones, the default deployment's --gguf-activations) and that every finished grammar output is JSON valid against its schema (jsonschema). Exits 1
after writing the results if either check fails.

    python -m bench.structured [--rounds 2] [--max-tokens 512] [--k 8] [--spec-mode auto]
    python -m bench.structured --smoke    # SmolLM2-135M, two cases, 192 tokens: a few minutes

Speculation mode "auto" calibrates the policy's step-time model on its first run on a machine
(cached under ~/.cache/specserve/calibration, per thread count): run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from bench.structured.grammar_mask import cpu_model
from bench.structured.report import (
    MODES,
    check_output,
    first_divergence,
    report,
    run_rows,
    summarize,
)
from bench.structured.workload import CASES, Case
from engine import LLM, SamplingParams
from engine.outputs import OutputAccumulator
from engine.structured import StructuredOutput
from engine.text.tokenizer import apply_chat_template

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.structured")
SMOKE = {"model": "smollm2-135m-instruct", "cases": 2, "max_tokens": 192, "rounds": 1}


def build_llm(args: argparse.Namespace, spec_mode: str) -> LLM:
    config = {"method": args.method, "num_speculative_tokens": args.k, "mode": spec_mode}
    if "draft_model" in args.method.split("+"):
        config["model"] = args.draft_model
    return LLM(
        args.model,
        dtype=args.dtype,
        gguf_activations=args.gguf_activations,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_cache_memory=int(args.kv_cache_gib * (1 << 30)),
        speculative_config=config,
    )


def params(case: Case, mode: str, max_tokens: int) -> SamplingParams:
    structured = None if mode == "free" else StructuredOutput.json_schema(case.schema)
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured)


def measure(llm: LLM, prompt: list[int], case: Case, mode: str, max_tokens: int) -> dict:
    """One generation of `prompt`, timed at its first token and at its end: decode seconds are
    the time between them, in the same run (a separate 1-token run would bring its own prefill
    time, which varies by seconds between runs on a small CPU)."""
    engine = llm.engine
    request_id = f"bench-{case.name}-{mode}-{time.monotonic_ns()}"
    accumulator = OutputAccumulator()
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params(case, mode, max_tokens))
    first, whole = None, None
    while whole is None:
        for delta in engine.step():
            if first is None and delta.outputs[0].token_ids:
                first = time.perf_counter()
            whole = accumulator.add(delta) or whole
    end = time.perf_counter()
    out = whole.outputs[0]
    stats = out.spec_stats
    return {
        "t_one": (first or end) - start,  # to the first token: the prompt's prefill
        "t_all": end - start,
        "token_ids": list(out.token_ids),
        "text": out.text,
        "finish_reason": out.finish_reason,
        "mean_acceptance_length": stats.mean_acceptance_length if stats else 0.0,
        "num_drafts": stats.num_drafts if stats else 0,
    }


def run(args: argparse.Namespace, cases: list[Case]) -> dict[tuple[str, str], dict]:
    """Every case in every mode, --rounds times, alternating; per (case, mode) the output and the
    median seconds of the two generations."""
    llms = {"off": build_llm(args, "off"), "on": build_llm(args, args.spec_mode)}
    logger.info("engines loaded")
    engine_of = {"free": "off", "grammar": "off", "grammar_spec": "on"}
    tokenizer = llms["off"].get_tokenizer()
    prompts = {case.name: apply_chat_template(tokenizer, case.messages()) for case in cases}
    for case in cases:  # warm-up: kernels, allocator, and every grammar compiled into its cache
        for mode in MODES:
            llms[engine_of[mode]].generate([prompts[case.name]], params(case, mode, 4))
    samples: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(args.rounds):
        for case_index, case in enumerate(cases):
            shift = (round_index + case_index) % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                llm = llms[engine_of[mode]]
                result = measure(llm, prompts[case.name], case, mode, args.max_tokens)
                logger.info(
                    "round %d %s %s: %d tokens in %.2f s (1 token: %.2f s)",
                    round_index,
                    case.name,
                    mode,
                    len(result["token_ids"]),
                    result["t_all"],
                    result["t_one"],
                )
                samples.setdefault((case.name, mode), []).append(result)
        gc.collect()
    results = {}
    for key, runs in samples.items():
        if any(r["token_ids"] != runs[0]["token_ids"] for r in runs):
            raise SystemExit(f"greedy output of {key} changed between rounds")
        results[key] = {
            **{k: v for k, v in runs[0].items() if k not in ("t_one", "t_all")},
            "t_one": statistics.median(r["t_one"] for r in runs),
            "t_all": statistics.median(r["t_all"] for r in runs),
            "num_prompt_tokens": len(prompts[key[0]]),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.structured", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--gguf-activations",
        default="int8",
        choices=("float32", "int8"),
        help="what the GGUF blocks multiply (default: int8, the default deployment's)",
    )
    parser.add_argument("--method", default="ngram", help="the proposer chain after the grammar")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--spec-mode", default="auto", choices=("always", "auto"))
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", type=int, default=len(CASES), help="the first N cases")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="per engine")
    parser.add_argument("--smoke", action="store_true", help=f"overrides: {SMOKE}")
    parser.add_argument("--out", default=None, help="default: bench/results/structured.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    out = Path(args.out or ROOT / f"bench/results/structured{'-smoke' if args.smoke else ''}.json")
    cases = list(CASES[: args.cases])

    results = run(args, cases)
    for case in cases:
        for mode in MODES:
            r = results[(case.name, mode)]
            r.update(check_output(r["text"], case.schema, r["finish_reason"]))
        spec, plain = results[(case.name, "grammar_spec")], results[(case.name, "grammar")]
        spec["first_divergence"] = first_divergence(spec["token_ids"], plain["token_ids"])
    summary = summarize(results, [c.name for c in cases])
    settings = {
        k: getattr(args, k)
        for k in (
            "model",
            "dtype",
            "gguf_activations",
            "method",
            "k",
            "spec_mode",
            "max_tokens",
            "rounds",
        )
    }
    settings.update(cases=[c.name for c in cases], smoke=args.smoke, cpu=cpu_model())
    document = {"settings": settings, "summary": summary, "runs": run_rows(results)}
    print(report(document))
    out.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    if not (summary["is_lossless"] and summary["all_grammar_outputs_valid"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
