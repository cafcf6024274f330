"""Grammar libraries for structured outputs, side by side in one run: xgrammar against llguidance
at the Qwen vocabulary (151,936 tokens) on this CPU.

For each library: (a) the one-time tokenizer preprocessing; (b) compiling each schema of
bench/structured/workload.py into a ready matcher; then, walking the matcher through each case's
reference object (its compact JSON, tokenized by the Qwen2.5-Coder tokenizer, then the stop
token), per token: (c) filling the next-token bitmask and advancing by the token — what the
engine pays per sampled or verified row — and the forced text the grammar proposer drafts from;
(d) rolling back --rollback-tokens tokens (rejected drafts) at every position. Both libraries get
the same JSON: separators ", " and ": ", no other whitespace, so they walk the same tokens. The
libraries alternate per schema and round, so drift hits both alike. Per-token figures are the
median, p99 and mean over every token of every round (the mean is what a sequence's total
follows); the first mask after compiling is reported apart (llguidance builds its lexer lazily,
there and at the first visits of later states). Each walk compiles its schema anew.

    python -m bench.structured.grammar_mask [--rounds 5] [--rollback-tokens 4] [--out PATH]
    python -m bench.structured.grammar_mask --smoke  # one round: seconds past the tokenizer scan
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.policy.measurements import percentile
from bench.structured.workload import CASES, SEPARATORS, canonical_json

ROOT = Path(__file__).resolve().parents[2]

MODEL = "qwen2.5-coder-1.5b-instruct"
VOCAB_SIZE = 151936  # the model's config vocab_size (the tokenizer has fewer entries)
STOP_TOKEN_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>
PARTS = ("fill", "advance", "step", "forced", "rollback")  # step = fill + advance


class Xgrammar:
    """xgrammar as engine/structured/ drives it."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=list(STOP_TOKEN_IDS)
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def matcher(self, schema: str) -> Any:
        compiled = self._compiler.compile_json_schema(
            schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )
        return self._xgr.GrammarMatcher(compiled)

    def bitmask(self) -> Any:
        return self._xgr.allocate_token_bitmask(1, VOCAB_SIZE)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def advance(self, matcher: Any, token_id: int) -> bool:
        return bool(matcher.accept_token(token_id))

    def forced(self, matcher: Any) -> object:
        return matcher.find_jump_forward_string()

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)


class Llguidance:
    """llguidance's LLMatcher with the same JSON options."""

    name = "llguidance"

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._lg = llguidance
        self._lgt = llguidance.torch
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=VOCAB_SIZE, eos_token=list(STOP_TOKEN_IDS)
        )
        self._options = {
            "whitespace_flexible": False,
            "item_separator": SEPARATORS[0],
            "key_separator": SEPARATORS[1],
        }

    def matcher(self, schema: str) -> Any:
        grammar = self._lg.LLMatcher.grammar_from_json_schema(schema, defaults=self._options)
        matcher = self._lg.LLMatcher(self._tokenizer, grammar, log_level=0)  # errors: below
        if matcher.is_error():
            raise SystemExit(f"llguidance rejected a schema: {matcher.get_error()}")
        return matcher

    def bitmask(self) -> Any:
        return self._lgt.allocate_token_bitmask(1, self._tokenizer.vocab_size)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        self._lgt.fill_next_token_bitmask(matcher, bitmask, 0)

    def advance(self, matcher: Any, token_id: int) -> bool:
        return bool(matcher.consume_token(token_id))

    def forced(self, matcher: Any) -> object:
        return matcher.compute_ff_bytes()

    def rollback(self, matcher: Any, num_tokens: int) -> None:
        matcher.rollback(num_tokens)


def walk(backend: Any, schema: str, token_ids: Sequence[int], rollback_tokens: int) -> dict:
    """Compile `schema`, then fill, advance and ask the forced text at every token of
    `token_ids`, then roll back `rollback_tokens` at every position that has that many tokens
    after it (before the stop token), then check the stop token can be rolled back and accepted
    again. Seconds: compile and first mask once, the rest one entry per token."""
    clock = time.perf_counter
    start = clock()
    matcher = backend.matcher(schema)
    compile_s = clock() - start
    bitmask = backend.bitmask()
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    for position, token_id in enumerate(token_ids):
        t0 = clock()
        backend.fill(matcher, bitmask)
        t1 = clock()
        is_accepted = backend.advance(matcher, token_id)
        t2 = clock()
        if not is_accepted:
            raise SystemExit(f"{backend.name} refused token {position} ({token_id}) of a case")
        if position + 1 < len(token_ids):  # nothing is forced after the stop token
            backend.forced(matcher)
            times["forced"].append(clock() - t2)
        times["fill"].append(t1 - t0)
        times["advance"].append(t2 - t1)
        times["step"].append(t2 - t0)
    first_mask_s = times["fill"][0]
    # Rejected drafts come back before the stop token: windows of content tokens only.
    matcher = backend.matcher(schema)
    for position, token_id in enumerate(token_ids[:-1]):
        ahead = token_ids[position : min(position + rollback_tokens, len(token_ids) - 1)]
        if len(ahead) == rollback_tokens:
            if not all(backend.advance(matcher, t) for t in ahead):
                raise SystemExit(f"{backend.name} refused a token after a rollback")
            t0 = clock()
            backend.rollback(matcher, rollback_tokens)
            times["rollback"].append(clock() - t0)
        backend.advance(matcher, token_id)
    # A draft that ends in the stop token and is rejected: the stop token rolled back, then
    # accepted again.
    backend.advance(matcher, token_ids[-1])
    backend.rollback(matcher, 1)
    can_reaccept_stop = backend.advance(matcher, token_ids[-1])
    return {
        "compile_s": compile_s,
        "first_mask_s": first_mask_s,
        "can_reaccept_stop": can_reaccept_stop,
        "times": times,
    }


def summarize(runs: Sequence[dict], prep_s: float) -> dict:
    """One library's figures over its walks: microseconds per token (median, p99, and the mean
    that a sequence's total time follows), compile milliseconds per case (median over rounds)."""
    per_token = {}
    for part in PARTS:
        values = [t for run in runs for t in run["times"][part]]
        per_token[part] = {
            "p50_us": 1e6 * percentile(values, 50),
            "p99_us": 1e6 * percentile(values, 99),
            "mean_us": 1e6 * sum(values) / len(values),
            "num": len(values),
        }
    cases = sorted({run["case"] for run in runs})
    compile_ms = {
        c: 1e3 * percentile([r["compile_s"] for r in runs if r["case"] == c], 50) for c in cases
    }
    first_mask = [1e6 * run["first_mask_s"] for run in runs]
    return {
        "tokenizer_prep_s": prep_s,
        "compile_ms": compile_ms,
        "compile_ms_median": percentile(list(compile_ms.values()), 50),
        "first_mask_us_median": percentile(first_mask, 50),
        "can_reaccept_stop_after_rollback": all(run["can_reaccept_stop"] for run in runs),
        "per_token": per_token,
    }


def report(results: dict) -> str:
    """The table: one row per figure, one column per library, then llguidance / xgrammar."""
    libs = results["libraries"]
    a, b = (libs[name] for name in ("xgrammar", "llguidance"))
    rows = [
        ("tokenizer prep (s)", a["tokenizer_prep_s"], b["tokenizer_prep_s"]),
        ("compile, median schema (ms)", a["compile_ms_median"], b["compile_ms_median"]),
        ("first mask after compile (us)", a["first_mask_us_median"], b["first_mask_us_median"]),
    ]
    for part in PARTS:
        for stat in ("p50", "p99", "mean"):
            key = f"{stat}_us"
            rows.append(
                (f"{part} {stat} (us/token)", a["per_token"][part][key], b["per_token"][part][key])
            )
    lines = [f"{'figure':<32} {'xgrammar':>10} {'llguidance':>11} {'llg / xgr':>10}"]
    for label, x, y in rows:
        lines.append(f"{label:<32} {x:>10.2f} {y:>11.2f} {y / x:>9.2f}x")
    stop = {n: "yes" if libs[n]["can_reaccept_stop_after_rollback"] else "no" for n in libs}
    lines.append(
        f"stop token accepted again after its rollback: xgrammar {stop['xgrammar']}, "
        f"llguidance {stop['llguidance']}"
    )
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.structured.grammar_mask", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rollback-tokens", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="one round")
    parser.add_argument("--out", default=str(ROOT / "bench/results/grammar_mask.json"))
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds

    from transformers import AutoTokenizer

    from engine.models.bundled import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    backends, prep_s = [], {}
    for cls in (Xgrammar, Llguidance):
        start = time.perf_counter()
        backends.append(cls(tokenizer))
        prep_s[cls.name] = time.perf_counter() - start
    docs = {}
    for case in CASES:
        ids = tokenizer.encode(canonical_json(case.reference), add_special_tokens=False)
        docs[case.name] = (json.dumps(case.schema), [*ids, STOP_TOKEN_IDS[0]])

    runs: dict[str, list[dict]] = {b.name: [] for b in backends}
    gc.disable()  # no collection pauses inside the timed calls
    try:
        for round_index in range(rounds):
            for case_index, (name, (schema, ids)) in enumerate(docs.items()):
                order = backends if (round_index + case_index) % 2 == 0 else backends[::-1]
                for backend in order:
                    run = walk(backend, schema, ids, args.rollback_tokens)
                    runs[backend.name].append({"case": name, **run})
            gc.collect()
    finally:
        gc.enable()

    results = {
        "settings": {
            "model": MODEL,
            "vocab_size": VOCAB_SIZE,
            "stop_token_ids": list(STOP_TOKEN_IDS),
            "separators": list(SEPARATORS),
            "rounds": rounds,
            "rollback_tokens": args.rollback_tokens,
            "cases": {name: len(ids) for name, (_, ids) in docs.items()},
            "versions": {p: metadata.version(p) for p in ("xgrammar", "llguidance")},
            "cpu": cpu_model(),
            "num_cores": os.cpu_count(),
            "smoke": args.smoke,
        },
        "libraries": {name: summarize(r, prep_s[name]) for name, r in runs.items()},
    }
    print(
        f"{MODEL} tokenizer, vocab {VOCAB_SIZE}, {len(docs)} schemas, "
        f"{sum(results['settings']['cases'].values())} tokens x {rounds} rounds"
    )
    print(report(results))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
