"""Batch-1 greedy decode speed: specserve vs transformers `generate`, side by side in one run.

Both run the same model (default: the bundled Qwen2.5-Coder-1.5B, activations in bfloat16) on
the same chat-templated prompt, alternating, and the medians are compared; specserve runs once
per weight format asked for (dense bfloat16 weights, and the GGUF file's own quantised blocks).
Decode cost per token is isolated from the prompt by timing a 1-token and an N-token generation
of the same prompt: (t_N - t_1) / (N - 1). Each bandwidth bound is the weight bytes that format
reads per token divided by the memory read bandwidth measured here.

    python -m bench.decode [--model NAME] [--tokens 64] [--rounds 3] [--quantization none,gguf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.text.tokenizer import apply_chat_template

PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


def read_bandwidth(num_bytes: int = 1 << 30, rounds: int = 5) -> float:
    """Bytes per second a reduction over a large float32 tensor reads (float32: a bfloat16 sum is
    bound by its conversions on some CPUs, and would understate what memory delivers)."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    data.sum()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return num_bytes / min(times)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: everything but the embedding table (only one row of
    it is read), unless the embedding is also the LM head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    is_tied = output is not None and output.weight.data_ptr() == embed.data_ptr()
    return total if is_tied else total - embed.numel() * embed.element_size()


def engine_bytes_per_token(llm: LLM) -> int:
    """Bytes of weights one of our decode steps reads: all but the embedding table, unless the
    embedding is also the LM head."""
    model = llm.engine.runner.model
    embed = sum(t.numel() * t.element_size() for t in model.embed_tokens.state_dict().values())
    total = llm.engine.runner.weight_bytes
    return total if model.lm_head is None else total - embed


def time_specserve(llm: LLM, prompt_ids: list[int], num_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0]
    elapsed = time.perf_counter() - start
    assert len(out.outputs[0].token_ids) == num_tokens
    return elapsed


def time_transformers(model, prompt_ids: list[int], num_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == num_tokens
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.decode", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quantization",
        default="none,gguf",
        help="specserve weight formats to time, comma-separated (none: dense in --dtype; gguf: "
        "the model's GGUF blocks)",
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    llms = {
        q: LLM(args.model, dtype=args.dtype, max_model_len=4096, quantization=q)
        for q in args.quantization.split(",")
    }
    first = next(iter(llms.values()))
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(first.engine.model_config.path, dtype=dtype).eval()
    prompt_ids = apply_chat_template(first.get_tokenizer(), [{"role": "user", "content": PROMPT}])

    runners = {
        **{
            f"specserve {q}": lambda n, llm=llm: time_specserve(llm, prompt_ids, n)
            for q, llm in llms.items()
        },
        "transformers": lambda n: time_transformers(hf, prompt_ids, n),
    }
    for run in runners.values():  # warm-up: first-call kernel selection, allocator growth
        run(2)
    per_token: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():  # alternating, so drift hits both alike
            t_one, t_all = run(1), run(args.tokens)
            per_token[name].append((t_all - t_one) / (args.tokens - 1))

    ms = {name: 1e3 * statistics.median(v) for name, v in per_token.items()}
    bandwidth = read_bandwidth()
    bytes_per_token = {"transformers": weight_bytes_per_token(hf)}
    bytes_per_token.update(
        {f"specserve {q}": engine_bytes_per_token(llm) for q, llm in llms.items()}
    )
    bound_ms = {name: 1e3 * b / bandwidth for name, b in bytes_per_token.items()}
    results = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": {f"specserve {q}": llm.engine.quantization for q, llm in llms.items()},
        "prompt_tokens": len(prompt_ids),
        "decode_tokens": args.tokens,
        "ms_per_token": ms,
        "tokens_per_s": {name: 1e3 / v for name, v in ms.items()},
        "speedup_vs_transformers": {
            name: ms["transformers"] / v for name, v in ms.items() if name != "transformers"
        },
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "weight_gb_per_token": {name: b / 1e9 for name, b in bytes_per_token.items()},
        "bandwidth_bound_ms_per_token": bound_ms,
        "vs_bound": {name: ms[name] / bound_ms[name] for name in ms},
    }
    print(f"model {args.model} ({args.dtype}), prompt {len(prompt_ids)} tokens, batch 1, greedy")
    print(f"  read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for name, value in ms.items():
        speedup = results["speedup_vs_transformers"].get(name)
        print(
            f"  {name:<16} {value:7.1f} ms/token  {1e3 / value:6.2f} tokens/s"
            + (f"  {speedup:.2f}x transformers" if speedup else "")
            + f"  (reads {bytes_per_token[name] / 1e9:.2f} GB/token: bound {bound_ms[name]:.1f}"
            f" ms, {results['vs_bound'][name]:.2f}x it)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
