"""The engine thread's detokenization per step: streams x tokens through the incremental
detokenizer, decoding through the Rust tokenizer directly and through transformers' decode, side
by side in one run.

    python -m bench.detokenize [--model smollm2-135m-instruct] [--streams 64] [--tokens 128]
                               [--rounds 3] [--out FILE]

Each stream starts at a random point of a source file (a prompt of 20 tokens, then `tokens`
output tokens appended one a step, as a decode step appends them), all streams in turn every
step, as `append_tokens` walks a step's requests. Reported per path: microseconds a token and
milliseconds a step of `streams` tokens (the lowest of `rounds` rounds), and their ratio. Both
paths must emit the same text, which the bench checks.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from bench.common.processes import commit_of, write_result
from engine.models.bundled import resolve_model
from engine.policy.calibration_cache import cpu_name
from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer, backend_decoder

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 20


def run_path(
    tokenizer: Any, ids: list[int], starts: list[int], tokens: int, direct: bool
) -> tuple[float, str]:
    """(seconds for every stream's every token, the streams' text joined)."""
    params = SamplingParams(max_tokens=tokens)
    streams = []
    for s in starts:
        detok = IncrementalDetokenizer(tokenizer, ids[s : s + PROMPT_TOKENS], params)
        if not direct:
            detok._backend_decode = None  # through transformers' decode
        streams.append(detok)
    began = time.perf_counter()
    for j in range(tokens):
        for detok, s in zip(streams, starts, strict=True):
            detok.append([ids[s + PROMPT_TOKENS + j]])
    seconds = time.perf_counter() - began
    return seconds, "\x00".join(d.output_text + d.flush() for d in streams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/detokenize.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    assert backend_decoder(tokenizer) is not None, "this tokenizer decodes through its wrapper"
    ids = tokenizer((ROOT / "engine/engine.py").read_text())["input_ids"]
    rng = random.Random(0)
    span = PROMPT_TOKENS + args.tokens
    starts = [rng.randrange(0, len(ids) - span) for _ in range(args.streams)]
    best: dict[str, float] = {}
    texts: dict[str, str] = {}
    for _ in range(args.rounds):
        for name, direct in (("direct", True), ("wrapper", False)):
            seconds, text = run_path(tokenizer, ids, starts, args.tokens, direct)
            best[name] = min(best.get(name, seconds), seconds)
            texts[name] = text
    assert texts["direct"] == texts["wrapper"], "the two paths emitted different text"
    num = args.streams * args.tokens
    result = {
        "bench": "detokenize",
        "commit": commit_of(ROOT),
        "cpu": cpu_name(),
        "model": args.model,
        "streams": args.streams,
        "tokens": args.tokens,
        "paths": {
            name: {
                "us_per_token": round(seconds / num * 1e6, 2),
                "ms_per_step": round(seconds / args.tokens * 1e3, 3),
            }
            for name, seconds in best.items()
        },
        "wrapper_over_direct": round(best["wrapper"] / best["direct"], 2),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
