"""Speculative decoding speed, side by side in one run: specserve with each method against its
own speculation-off and against transformers' prompt lookup and assisted generation.

Target Qwen2.5-Coder-1.5B-Instruct in bfloat16, batch 1, greedy, on three workloads:
copy-then-summarise (restate a given passage), code edit (rewrite a given function with one
change) and open-ended chat. Greedy output is the same for every method (speculation is
lossless), so tokens/s compare the same work. Decode speed is isolated from the prompt by timing
a 1-token and an N-token generation of each prompt: (N - 1) / (t_N - t_1), prefix caching off.
Reports decode tokens/s, the speedup over specserve's speculation-off, and the mean acceptance
length (tokens emitted per verify step).

    python -m bench.spec [--tokens 128] [--k 5] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.models.bundled import resolve_model
from engine.text.tokenizer import apply_chat_template, load_tokenizer

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"

PASSAGE = (
    "The lighthouse at the end of the harbour was built in 1871 from granite quarried on the "
    "island itself. For more than a century its keepers climbed the one hundred and twelve steps "
    "each evening to light the lamp, which burned whale oil at first, then kerosene, and finally "
    "electricity after the cable from the mainland arrived in 1954. The last keeper, Margaret "
    "Hale, left in 1987 when the light was automated; she had lived in the cottage at its foot "
    "for thirty-one years and kept a logbook of every ship that passed in fog. Today the "
    "cottage is a small museum, and her logbooks, bound in blue cloth, fill two shelves by the "
    "window that faces the sea."
)

FUNCTION = """def parse_config(path):
    settings = {}
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected key = value")
            key, value = line.split("=", 1)
            key = key.strip()
            value = value.strip()
            if key in settings:
                raise ValueError(f"line {number}: duplicate key {key}")
            settings[key] = value
    return settings
"""

WORKLOADS = {
    "copy_summarise": "Repeat the following passage word for word, then summarise it in one "
    "sentence.\n\n" + PASSAGE,
    "code_edit": "Rewrite this function so that keys are lower-cased before they are stored. "
    "Reply with the complete function only.\n\n" + FUNCTION,
    "open_chat": "Why do cities build roundabouts instead of traffic lights? Explain the "
    "trade-offs in a few paragraphs.",
}

METHODS = {
    "off": None,
    "ngram": {"method": "ngram"},
    "draft_model": {"method": "draft_model", "model": DRAFT},
    "ngram+draft_model": {"method": "ngram+draft_model", "model": DRAFT},
}
# Draft tokens per step by method: lookups are free to propose and cost only verify rows; a draft
# model pays ~40% of a target step per token on this CPU, so its window is cut short wherever it
# is unsure of its own token (draft_min_confidence, 0.6 by default).
DEFAULT_K = {"ngram": 8, "draft_model": 5, "ngram+draft_model": 5}


def run_specserve(prompts: dict[str, list[int]], tokens: int, ks: dict[str, int]) -> dict:
    results: dict = {}
    for method, spec in METHODS.items():
        config = None if spec is None else {**spec, "num_speculative_tokens": ks[method]}
        llm = LLM(
            TARGET,
            dtype="bfloat16",
            max_model_len=4096,
            enable_prefix_caching=False,
            speculative_config=config,
        )
        llm.generate([prompts["open_chat"]], SamplingParams(temperature=0, max_tokens=8))  # warm-up

        def timed(prompt: list[int], n: int, llm: LLM = llm):
            start = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n))[0]
            return time.perf_counter() - start, out.outputs[0]

        for workload, prompt in prompts.items():
            t_one, _ = timed(prompt, 1)
            t_all, out = timed(prompt, tokens)
            stats = out.spec_stats
            results[(workload, method)] = {
                "tokens": len(out.token_ids),
                "seconds": t_all - t_one,
                "tokens_per_s": (len(out.token_ids) - 1) / (t_all - t_one),
                "mean_acceptance_length": stats.mean_acceptance_length if stats else 0.0,
                "token_ids": out.token_ids,
            }
        del llm
        gc.collect()
    return results


def run_transformers(prompts: dict[str, list[int]], tokens: dict[str, int], k: int) -> dict:
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = resolve_model(TARGET, dense=True), resolve_model(DRAFT, dense=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.bfloat16)
    variants = {
        "hf_greedy": {},
        "hf_prompt_lookup": {"prompt_lookup_num_tokens": k},
        "hf_assisted": {"assistant_model": draft},
    }

    def timed(ids: torch.Tensor, n: int, extra: dict) -> tuple[float, int]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
        return time.perf_counter() - start, out.shape[1] - ids.shape[1]

    results: dict = {}
    for workload, prompt in prompts.items():
        ids = torch.tensor([prompt])
        for name, extra in variants.items():
            t_one, _ = timed(ids, 1, extra)
            t_all, n = timed(ids, tokens[workload], extra)
            results[(workload, name)] = {
                "tokens": n,
                "seconds": t_all - t_one,
                "tokens_per_s": (n - 1) / (t_all - t_one),
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spec", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tokens", type=int, default=128)
    for method, k in DEFAULT_K.items():
        parser.add_argument(
            f"--k-{method.replace('+', '-').replace('_', '-')}", type=int, default=k
        )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    tokenizer = load_tokenizer(resolve_model(TARGET))
    prompts = {
        name: apply_chat_template(tokenizer, [{"role": "user", "content": text}])
        for name, text in WORKLOADS.items()
    }
    ks = {m: getattr(args, f"k_{m.replace('+', '_')}") for m in DEFAULT_K}
    ours = run_specserve(prompts, args.tokens, ks)
    # In bfloat16 a verify forward over k + 1 tokens rounds differently from a 1-token forward,
    # so near-ties may break differently (float32 output is identical: see the tests); report
    # how far each method agrees with speculation-off.
    for workload in prompts:
        reference = ours[(workload, "off")]["token_ids"]
        for method in METHODS:
            ids = ours[(workload, method)]["token_ids"]
            same = next(
                (i for i, (a, b) in enumerate(zip(ids, reference, strict=False)) if a != b),
                len(ids),
            )
            ours[(workload, method)]["same_prefix"] = same
    theirs = {}
    if not args.skip_transformers:
        lengths = {w: ours[(w, "off")]["tokens"] for w in prompts}
        theirs = run_transformers(prompts, lengths, ks["ngram"])

    print(f"target {TARGET} bf16, draft {DRAFT}, batch 1, greedy, K per method {ks}")
    header = (
        f"{'workload':<15} {'method':<18} {'tokens':>6} {'tok/s':>7} {'vs off':>7} "
        f"{'accept len':>10} {'= off':>6}"
    )
    print(header)
    rows = []
    for workload in prompts:
        base = ours[(workload, "off")]["tokens_per_s"]
        entries = [(m, ours[(workload, m)]) for m in METHODS]
        entries += [(name, r) for (w, name), r in theirs.items() if w == workload]
        for method, r in entries:
            ratio = r["tokens_per_s"] / base
            accept = r.get("mean_acceptance_length", 0.0)
            print(
                f"{workload:<15} {method:<18} {r['tokens']:>6} {r['tokens_per_s']:>7.2f} "
                f"{ratio:>6.2f}x {accept:>10.2f} {r.get('same_prefix', ''):>6}"
            )
            rows.append(
                {
                    "workload": workload,
                    "method": method,
                    "vs_off": ratio,
                    **{k: v for k, v in r.items() if k != "token_ids"},
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
