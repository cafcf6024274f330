"""Greedy output with every proposer equals speculation off, token for token, on the real model.

The promise behind every speedup figure: speculation never changes a greedy answer, whatever
drafts, whatever shares the step. For each proposer chain of the default deployment (n-gram,
the draft model, n-gram then the draft model), one engine on the config's model and settings
(the served GGUF blocks with int8 activations by default), in modes `always` (every grant the
budget allows: the most verify chunks) and `auto` (the policy's own decisions); each runs the
prompts staggered (request i joins at step i * --stagger, so prompt chunks share steps with
other requests' decode and verify rows) and compares every output with the same prompt's
output in mode `off` run alone. Mismatches are listed with the first differing position.

    python -m bench.lossless [--config configs/default.yaml] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bench.policy.workload import code_edit_prompts, code_gen_prompts, open_chat_prompts
from engine import LLM, SamplingParams
from engine.outputs import OutputAccumulator
from engine.text.tokenizer import apply_chat_template

ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger("bench.lossless")

CHAINS = ("ngram", "draft_model", "ngram+draft_model")
MODES = ("always", "auto")


def prompts() -> list[str]:
    """Two code edits, a function to write and an open question: drafts that are accepted
    often, sometimes and rarely."""
    edits, gen, chat = code_edit_prompts(), code_gen_prompts(), open_chat_prompts()
    return [edits[0], gen[0], chat[0], edits[len(edits) // 2]]


def engine_kwargs(config: dict[str, Any], chain: str | None, mode: str) -> dict[str, Any]:
    """The config's engine section with its speculative config set to `chain` in `mode`."""
    engine = dict(config["engine"])
    model = engine.pop("model")
    spec = dict(engine.pop("speculative_config", None) or {})
    if chain is not None:
        spec.update(method=chain, mode=mode)
        if "draft_model" not in chain:
            spec.pop("model", None)
        engine["speculative_config"] = spec
    return {"model": model, **engine}


def run_staggered(
    llm: LLM, token_prompts: Sequence[list[int]], params: SamplingParams, stagger: int
) -> list[list[int]]:
    """Every prompt through one engine, prompt i added at step i * stagger; outputs in order."""
    engine = llm.engine
    accumulator = OutputAccumulator()  # a step's outputs are deltas; this adds them up
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(token_prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and step >= pending[0][0] * stagger:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, params)
        for output in accumulator.add_step(engine.step()):
            outputs[output.request_id] = list(output.outputs[0].token_ids)
        step += 1
    assert engine.block_manager.num_used_blocks == 0, "blocks leaked"
    return [outputs[str(i)] for i in range(len(token_prompts))]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lossless", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stagger", type=int, default=8, help="steps between arrivals")
    parser.add_argument("--chains", default=",".join(CHAINS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="bench/results/lossless.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = yaml.safe_load((ROOT / args.config).read_text())
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    texts = prompts()

    started = time.perf_counter()
    reference_llm = LLM(**engine_kwargs(config, None, "off"))
    tokenizer = reference_llm.get_tokenizer()
    token_prompts = [
        apply_chat_template(tokenizer, [{"role": "user", "content": t}]) for t in texts
    ]
    # Off, one request at a time: nothing shares its steps.
    reference = [run_staggered(reference_llm, [p], params, 0)[0] for p in token_prompts]
    del reference_llm
    gc.collect()
    runs = []
    for chain in args.chains.split(","):
        for mode in args.modes.split(","):
            llm = LLM(**engine_kwargs(config, chain, mode))
            t0 = time.perf_counter()
            outputs = run_staggered(llm, token_prompts, params, args.stagger)
            seconds = time.perf_counter() - t0
            stats = llm.engine.spec_stats
            diffs = [first_difference(o, r) for o, r in zip(outputs, reference, strict=True)]
            runs.append(
                {
                    "chain": chain,
                    "mode": mode,
                    "seconds": round(seconds, 1),
                    "tokens": sum(len(o) for o in outputs),
                    "draft_tokens": stats.num_draft_tokens,
                    "accepted_tokens": stats.num_accepted_tokens,
                    "equal": sum(d is None for d in diffs),
                    "first_difference": diffs,
                }
            )
            logger.info(
                "%s %s: %d of %d equal to off, %d drafts, %d accepted",
                chain,
                mode,
                runs[-1]["equal"],
                len(outputs),
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
            )
            del llm
            gc.collect()
    result = {
        "settings": {**vars(args), "engine": config["engine"]},
        "reference_tokens": [len(r) for r in reference],
        "runs": runs,
        "all_equal": all(r["equal"] == len(reference) for r in runs),
        "seconds": round(time.perf_counter() - started, 1),
    }
    out = ROOT / args.out
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| chain | mode | equal to off | draft tokens | accepted |")
    print("|---|---|---:|---:|---:|")
    for r in runs:
        print(
            f"| {r['chain']} | {r['mode']} | {r['equal']}/{len(reference)} | "
            f"{r['draft_tokens']} | {r['accepted_tokens']} |"
        )
    logger.info("wrote %s", out)
    sys.exit(0 if result["all_equal"] else 1)


if __name__ == "__main__":
    main()
