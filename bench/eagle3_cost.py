"""What one draft token costs: an EAGLE-3 head against the draft model, on the real target.

The cost of a head's step does not depend on its weights' values, so without a trained head
(--head) one is made here, random, in the published format with the target's shapes (its width,
heads and intermediate size, --draft-vocab ids of the target's). For each drafter one engine on
the config's model and settings (the served GGUF blocks with int8 activations by default) drafts
K tokens at batch 1 in mode `always` with no early exit, over --tokens generated tokens, and the
drafters' own device timings are summed: the chained single-token forwards (one draft token
each, the figure compared), the first forward (one draft token each too; the draft model's
carries its catch-up, the head's is one token at the last kept position) and, for the head, the
extend after each target step (its K/V only). All of it over all draft tokens is the second
figure: what a draft token costs in all.

    python -m bench.eagle3_cost [--config configs/default.yaml] [--tokens 128]
        [--draft-vocab 32000] [--head-dtype bfloat16 | --head-quantization q8_0|q6_k] [--head DIR]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.common.processes import cpu_isa, host
from engine import LLM, SamplingParams
from engine.models.bundled import resolve_model
from engine.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]

logger = logging.getLogger("bench.eagle3_cost")

PROMPT = (
    "Explain, step by step and with an example in Python, how a hash map handles collisions, "
    "and when a balanced tree would be the better choice."
)


def random_head(target: ModelConfig, path: Path, draft_vocab: int, seed: int = 0) -> Path:
    """A random head for `target` in the published format (config.json + model.safetensors,
    bfloat16): the tests' builder of such heads; its cost does not depend on its values."""
    from tests.eagle3_heads import build_tiny_eagle3_head

    return build_tiny_eagle3_head(
        path, target.path, seed=seed, draft_vocab_size=draft_vocab, scale=0.02
    )


def measure(engine_args: dict[str, Any], spec: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Generate `tokens` tokens at batch 1 and sum the drafter's own timings."""
    llm = LLM(**engine_args, speculative_config=spec)
    engine = llm.engine
    proposer = next(p for p in engine.speculator.chain if p.name == spec["method"])
    timings = []
    take = proposer.take_timing

    def record():  # type: ignore[no-untyped-def]
        timing = take()
        if timing is not None:
            timings.append(timing)
        return timing

    proposer.take_timing = record
    extend_seconds, num_extends = 0.0, 0
    if hasattr(proposer, "extend"):
        extend = proposer.extend

        def timed_extend(spans):  # type: ignore[no-untyped-def]
            nonlocal extend_seconds, num_extends
            extend(spans)
            if proposer.extend_marks is not None:
                start, end, _ = proposer.extend_marks
                engine.runner.device.synchronize()
                extend_seconds += engine.runner.device.elapsed(start, end)
                num_extends += 1

        proposer.extend = timed_extend
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up: caches, the kernels' first calls
    timings.clear()
    extend_seconds, num_extends = 0.0, 0
    llm.generate([prompt + " "], params)
    num_more = sum(t.num_more for t in timings)
    more = sum(t.more_seconds for t in timings)
    first = sum(t.first_seconds for t in timings)
    num_drafted = num_more + sum(t.num_drafting for t in timings)  # one more per first forward
    result = {
        "method": spec["method"],
        "num_proposes": len(timings),
        "draft_tokens_chained": num_more,
        "seconds_per_chained_draft_token": more / num_more if num_more else None,
        "first_forward_seconds_per_propose": first / len(timings) if timings else None,
        "extend_seconds_per_step": extend_seconds / num_extends if num_extends else None,
        # Every second the drafter spent (first forwards, chained ones, extends) per draft token.
        "seconds_per_draft_token_in_all": (
            (first + more + extend_seconds) / num_drafted if num_drafted else None
        ),
        "acceptance_rate": engine.spec_stats.acceptance_rate,
    }
    proposer.take_timing = take  # the engine holds the closures until it goes
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.eagle3_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--head-dtype", default="bfloat16")
    parser.add_argument(
        "--head-quantization", choices=["q8_0", "q6_k"], help="Q8_0 or Q6_K blocks (CPU)"
    )
    parser.add_argument("--head", help="a trained head's directory (default: a random one)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "eagle3-cost.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = yaml.safe_load(Path(args.config).read_text())["engine"]
    draft_model = config.pop("speculative_config")["model"]
    engine_args = {**config, "max_num_seqs": 1}
    target = ModelConfig.from_path(resolve_model(config["model"]))
    common = {"mode": "always", "num_speculative_tokens": args.k, "draft_min_confidence": 0.0}
    head_options: dict[str, Any] = {"draft_dtype": args.head_dtype}
    if args.head_quantization:
        head_options = {"draft_quantization": args.head_quantization}
    with tempfile.TemporaryDirectory() as tmp:
        head = args.head or str(random_head(target, Path(tmp) / "head", args.draft_vocab))
        results = [
            measure(
                engine_args, {"method": "draft_model", "model": draft_model, **common}, args.tokens
            ),
            measure(
                engine_args,
                {"method": "eagle3", "model": head, **head_options, **common},
                args.tokens,
            ),
        ]
    draft, eagle = results
    ratio = eagle["seconds_per_chained_draft_token"] / draft["seconds_per_chained_draft_token"]
    in_all = eagle["seconds_per_draft_token_in_all"] / draft["seconds_per_draft_token_in_all"]
    report = {
        "host": host(),
        "cpu_isa": cpu_isa(),
        "config": args.config,
        "target": config["model"],
        "draft_model": draft_model,
        "head": args.head or f"random, draft vocabulary {args.draft_vocab}",
        "head_weights": args.head_quantization or args.head_dtype,
        "k": args.k,
        "tokens": args.tokens,
        "results": results,
        "head_over_draft_model_per_draft_token": ratio,
        "head_over_draft_model_per_draft_token_in_all": in_all,
    }
    for r in results:
        logger.info("%s", r)
    logger.info("head / draft model, seconds per chained draft token: %.3f", ratio)
    logger.info("head / draft model, seconds per draft token in all: %.3f", in_all)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
