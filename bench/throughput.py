"""Offline throughput at 1, 4 and 16 concurrent requests, side by side in one run.

Each level submits that many distinct chat prompts at once and generates a fixed number of
tokens for each (greedy, EOS ignored so every request does the same work); throughput is
generated tokens over wall time, prefill included. The ratio to the single-request level shows
how well continuous batching turns the memory-bound decode into shared weight reads.

    python -m bench.throughput [--model NAME] [--tokens 64] [--levels 1 4 16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine import LLM, SamplingParams
from engine.text.tokenizer import apply_chat_template

TOPICS = [
    "binary search",
    "a linked list",
    "quicksort",
    "a LRU cache",
    "matrix multiplication",
    "parsing CSV",
    "a trie",
    "Dijkstra's algorithm",
    "a thread pool",
    "rate limiting",
    "JSON validation",
    "merging intervals",
    "a min-heap",
    "topological sort",
    "run-length encoding",
    "a bloom filter",
    "word frequency counting",
    "a ring buffer",
    "Levenshtein distance",
    "reservoir sampling",
]


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [
        apply_chat_template(
            tokenizer,
            [{"role": "user", "content": f"Write Python code for {TOPICS[i % len(TOPICS)]}."}],
        )
        for i in range(count)
    ]


def run_level(llm: LLM, batch: list[list[int]], num_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == num_tokens * len(batch)
    return generated / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=max(args.levels),
        max_model_len=2048,
        enable_prefix_caching=False,  # every level computes its prompts in full
    )
    tokenizer = llm.get_tokenizer()
    run_level(llm, prompts(tokenizer, 1), 4)  # warm-up
    results = {}
    for level in args.levels:
        results[level] = run_level(llm, prompts(tokenizer, level), args.tokens)
    base = results[args.levels[0]]
    print(f"model {args.model} ({args.dtype}), {args.tokens} generated tokens per request, greedy")
    for level, tps in results.items():
        print(f"  {level:3d} concurrent: {tps:7.2f} tokens/s  ({tps / base:5.2f}x)")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"tokens_per_s": results, "ratio": {k: v / base for k, v in results.items()}}
            )
        )


if __name__ == "__main__":
    main()
