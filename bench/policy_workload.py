"""The workload and the measurements of bench/policy.py, kept free of I/O so tests can check them.

Workloads (WORKLOADS, by name): code_edit, a function to rewrite with one small change, full code
back (the answer copies most of the prompt, where n-gram drafts shine); open_chat, free-text
questions (where drafts are often wrong); mixed, the two interleaved (the default); code_gen, a
signature and docstring to complete, as in HumanEval (new code: drafts have less to copy than in a
code edit, more than in chat); copy, a passage to repeat word for word and sum up (bench/drafters.py
uses it; the policy bench does not). Request i of a level gets prompt i mod len(workload), so every mode
sees the same requests in the same order.

Measurements: per request the arrival time of every streamed token (the server is started with
one SSE chunk per token). A level holds its concurrency for a fixed window: its throughput counts
the tokens that arrived inside the window, whether their request finished there or was cut off at
its end. Per level also the percentiles over requests (TTFT) and over tokens (inter-token
latency) inside the window, and the share of the policy's per-request decisions that speculated,
from Prometheus counter deltas.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# (function source, a local name in it, the name to rename it to)
FUNCTIONS = (
    (
        "def parse_config(path):\n"
        "    settings = {}\n"
        "    with open(path) as f:\n"
        "        for number, line in enumerate(f, start=1):\n"
        "            line = line.strip()\n"
        '            if not line or line.startswith("#"):\n'
        "                continue\n"
        '            if "=" not in line:\n'
        '                raise ValueError(f"line {number}: expected key = value")\n'
        '            key, value = line.split("=", 1)\n'
        "            settings[key.strip()] = value.strip()\n"
        "    return settings\n",
        "settings",
        "options",
    ),
    (
        "def moving_average(values, window):\n"
        "    if window <= 0:\n"
        '        raise ValueError("window must be positive")\n'
        "    result = []\n"
        "    total = 0.0\n"
        "    for index, value in enumerate(values):\n"
        "        total += value\n"
        "        if index >= window:\n"
        "            total -= values[index - window]\n"
        "        if index >= window - 1:\n"
        "            result.append(total / window)\n"
        "    return result\n",
        "total",
        "running_sum",
    ),
    (
        "def merge_intervals(intervals):\n"
        "    ordered = sorted(intervals, key=lambda pair: pair[0])\n"
        "    merged = []\n"
        "    for start, end in ordered:\n"
        "        if merged and start <= merged[-1][1]:\n"
        "            merged[-1][1] = max(merged[-1][1], end)\n"
        "        else:\n"
        "            merged.append([start, end])\n"
        "    return merged\n",
        "ordered",
        "by_start",
    ),
    (
        "def word_counts(text, stop_words):\n"
        "    counts = {}\n"
        "    for word in text.split():\n"
        '        word = word.strip(".,;:!?").lower()\n'
        "        if not word or word in stop_words:\n"
        "            continue\n"
        "        counts[word] = counts.get(word, 0) + 1\n"
        "    return sorted(counts.items(), key=lambda item: -item[1])\n",
        "counts",
        "frequencies",
    ),
)

EDITS = (
    "Rename the variable `{old}` to `{new}`.",
    "Add a docstring that explains what the function does.",
    "Add type hints to the parameters and the return value.",
)

OPEN_CHAT = (
    "Why do cities build roundabouts instead of traffic lights? Explain the trade-offs.",
    "What are the main differences between a process and a thread?",
    "Give me some advice for preparing a talk at a small conference.",
    "How does a bicycle stay upright while it is moving?",
    "What should I consider when choosing between renting and buying a home?",
    "Explain how vaccines train the immune system, for a curious teenager.",
    "What makes a good code review? List what you would look for.",
    "Describe a relaxing weekend trip to the mountains.",
    "Why is the sky blue during the day and red at sunset?",
    "Compare learning the piano and learning the guitar as an adult.",
    "What are the pros and cons of working from home?",
    "How do noise-cancelling headphones work?",
)

# Passages to repeat word for word and then sum up (the answer copies the prompt nearly whole:
# lookup's best case, and the test of whether a model drafter keeps up with it).
PASSAGES = (
    "The old mill by the river ground wheat for the village for almost two hundred years. Its "
    "wheel was turned by water channelled from a weir upstream, and in dry summers the miller "
    "worked at night, when the farms took less water from the stream. After a flood broke the "
    "weir in 1911 the mill ran on a steam engine, and later on electricity, until it closed in "
    "1968. Volunteers restored the wheel in the 1990s, and on the first Sunday of each month it "
    "turns again and grinds flour that is sold in the shop next door.",
    "Octopuses have three hearts and blue blood. Two of the hearts pump blood through the gills, "
    "and the third pumps it around the rest of the body; that one stops beating while the "
    "animal swims, which is one reason octopuses prefer crawling. Their blood carries oxygen "
    "with a copper-based protein called haemocyanin, which works better than iron-based "
    "haemoglobin in cold water with little oxygen, but less well in warm water.",
    "To reset the router, first unplug it from the wall and wait thirty seconds. Plug it back "
    "in and wait until the power light stops blinking, which takes about two minutes. If the "
    "internet light stays red, press and hold the reset button on the back with a paper clip "
    "for ten seconds; this restores the factory settings, so you will need to set the network "
    "name and password again from the label on the bottom of the router.",
    "The committee met on Tuesday and agreed three things. The library will open an hour "
    "earlier on weekdays from the first of March. The budget for new children's books rises by "
    "ten percent, paid for by closing the photocopying room, which few people use. And the "
    "reading group that meets in the back room will move to Thursday evenings, so that the room "
    "is free for homework clubs after school.",
)

# Functions to complete: a signature and a docstring with an example or two, as in HumanEval (the
# answer writes new code, so n-gram lookup finds less to copy than in a code edit).
CODE_GEN = (
    "def is_balanced(text: str) -> bool:\n"
    '    """Whether every bracket in `text` ((), [] and {}) is closed in the right order;\n'
    "    other characters are ignored.\n"
    '    >>> is_balanced("f(a[1], {b: 2})")\n'
    "    True\n"
    '    >>> is_balanced("(]")\n'
    "    False\n"
    '    """\n',
    "def run_length_encode(text: str) -> str:\n"
    '    """Each run of one repeated character as the character followed by the length of\n'
    "    the run.\n"
    '    >>> run_length_encode("aaabccdddd")\n'
    "    'a3b1c2d4'\n"
    '    """\n',
    "def second_largest(numbers: list[int]) -> int | None:\n"
    '    """The second largest distinct value in `numbers`, or None if there is none.\n'
    "    >>> second_largest([4, 1, 4, 3])\n"
    "    3\n"
    "    >>> second_largest([7, 7])\n"
    '    """\n',
    "def chunked(items: list, size: int) -> list[list]:\n"
    '    """Split `items` into consecutive lists of `size` items; the last may be shorter.\n'
    "    Raise ValueError if `size` is not positive.\n"
    "    >>> chunked([1, 2, 3, 4, 5], 2)\n"
    "    [[1, 2], [3, 4], [5]]\n"
    '    """\n',
    "def invert(mapping: dict[str, int]) -> dict[int, list[str]]:\n"
    '    """Map each value of `mapping` to the sorted list of the keys that have it.\n'
    '    >>> invert({"a": 1, "b": 2, "c": 1})\n'
    "    {1: ['a', 'c'], 2: ['b']}\n"
    '    """\n',
    "def digital_root(n: int) -> int:\n"
    '    """Add up the decimal digits of the non-negative `n`, then the digits of the sum,\n'
    "    until one digit is left.\n"
    "    >>> digital_root(9875)\n"
    "    2\n"
    '    """\n',
    "def primes_below(n: int) -> list[int]:\n"
    '    """Every prime number smaller than `n`, in increasing order.\n'
    "    >>> primes_below(20)\n"
    "    [2, 3, 5, 7, 11, 13, 17, 19]\n"
    "    >>> primes_below(2)\n"
    "    []\n"
    '    """\n',
    "def title_case(sentence: str, minor_words: set[str]) -> str:\n"
    '    """Capitalise every word of `sentence` except those in `minor_words`, which are\n'
    "    lower-cased; the first word is always capitalised.\n"
    '    >>> title_case("the lord OF the rings", {"of", "the"})\n'
    "    'The Lord of the Rings'\n"
    '    """\n',
    "def merge_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:\n"
    '    """The counts of `a` and `b` added key by key; keys whose total is zero are left\n'
    "    out.\n"
    '    >>> merge_counts({"x": 2, "y": 1}, {"y": -1, "z": 4})\n'
    "    {'x': 2, 'z': 4}\n"
    '    """\n',
    "def rotate_clockwise(matrix: list[list[int]]) -> list[list[int]]:\n"
    '    """The matrix turned a quarter turn clockwise; `matrix` is left unchanged.\n'
    "    >>> rotate_clockwise([[1, 2, 3], [4, 5, 6]])\n"
    "    [[4, 1], [5, 2], [6, 3]]\n"
    '    """\n',
    "def common_prefix(words: list[str]) -> str:\n"
    '    """The longest string that every word in `words` starts with ("" for no words).\n'
    '    >>> common_prefix(["interview", "internet", "interval"])\n'
    "    'inter'\n"
    '    """\n',
    'def flatten_keys(nested: dict, separator: str = ".") -> dict:\n'
    '    """A flat dict whose keys join the keys of nested dicts with `separator`.\n'
    '    >>> flatten_keys({"a": 1, "b": {"c": 2, "d": {"e": 3}}})\n'
    "    {'a': 1, 'b.c': 2, 'b.d.e': 3}\n"
    '    """\n',
)


def code_edit_prompts() -> list[str]:
    """Every (function, edit) pair: an instruction, the code, and a request for the full code."""
    prompts = []
    for edit in EDITS:
        for code, old, new in FUNCTIONS:
            instruction = edit.format(old=old, new=new)
            prompts.append(
                f"{instruction} Output the full code of the function and nothing else.\n\n"
                f"```python\n{code}```"
            )
    return prompts


def complete_function_prompt(code: str) -> str:
    """The request to complete one function, its signature and docstring given (bench/humaneval.py
    asks HumanEval's problems the same way)."""
    return (
        "Complete the following Python function. Reply with the complete function in one "
        f"```python code block.\n\n```python\n{code}```"
    )


def code_gen_prompts() -> list[str]:
    """Every function of CODE_GEN to complete."""
    return [complete_function_prompt(code) for code in CODE_GEN]


def open_chat_prompts() -> list[str]:
    """The open chat questions alone."""
    return list(OPEN_CHAT)


def copy_prompts() -> list[str]:
    """Every passage of PASSAGES to repeat word for word, then sum up in one sentence."""
    return [
        f"Repeat the following passage word for word, then summarise it in one sentence.\n\n{p}"
        for p in PASSAGES
    ]


def mixed_prompts() -> list[str]:
    """Code edits and open chat, alternating."""
    code, chat = code_edit_prompts(), list(OPEN_CHAT)
    mixed = []
    for i in range(max(len(code), len(chat))):
        mixed += [code[i % len(code)], chat[i % len(chat)]]
    return mixed


WORKLOADS = {
    "mixed": mixed_prompts,
    "code_edit": code_edit_prompts,
    "open_chat": open_chat_prompts,
    "code_gen": code_gen_prompts,
}


# --------------------------------------------------------------------------- measurements


@dataclass(frozen=True)
class RequestResult:
    """One streamed request: token times and latency are seconds after it was sent, at `sent_at`
    (the bench's clock). A request cut off at the end of its level's window is `cancelled`."""

    prompt_index: int
    token_times: tuple[float, ...]  # arrival of each streamed token (content chunk)
    num_completion_tokens: int  # from usage; the number of chunks when usage is missing
    latency: float
    error: str | None = None
    sent_at: float = 0.0
    cancelled: bool = False

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def tokens_within(self, start: float, end: float) -> list[float]:
        """Arrival times (relative to sending) of the tokens that arrived in [start, end]."""
        return [t for t in self.token_times if start <= self.sent_at + t <= end]


@dataclass(frozen=True)
class LevelResult:
    """One (mode, workload, concurrency) level of the sweep; latencies in seconds."""

    mode: str
    workload: str
    concurrency: int
    num_requests: int  # finished inside the window
    num_errors: int
    num_completion_tokens: int  # streamed inside the window
    wall_time: float  # the window
    tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    speculating_share: float | None  # None: the server exports no policy decisions
    num_cancelled: int = 0  # still streaming when the window closed
    round: int = 0  # which of the run's rounds (each round measures every mode once per level)


class StreamError(RuntimeError):
    """The server ended a stream with an error event."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None if
    there are no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def amortized_itl(token_times: Sequence[float], burst_gap: float) -> list[float]:
    """Inter-token latencies, one per token after the first burst.

    Tokens of one engine step (a verify step emits several) arrive together: a token within
    `burst_gap` seconds of the previous one joins its burst. A burst of m tokens arriving `gap`
    seconds after the previous burst began gives each of its tokens gap / m, so the latencies
    sum to the time between the first and the last burst, as a client sees the stream advance.
    """
    bursts: list[tuple[float, int]] = []  # (arrival of its first token, tokens)
    previous = None
    for t in token_times:
        if previous is not None and t - previous <= burst_gap:
            bursts[-1] = (bursts[-1][0], bursts[-1][1] + 1)
        else:
            bursts.append((t, 1))
        previous = t
    latencies = []
    for (start_before, _), (start, count) in zip(bursts, bursts[1:], strict=False):
        latencies += [(start - start_before) / count] * count
    return latencies


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One line of a `text/event-stream`: the event's JSON object, "[DONE]", or None for lines
    that carry no data (blank separators, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return payload
    event = json.loads(payload)
    if not isinstance(event, dict):
        raise StreamError(f"unexpected event {payload[:200]!r}")
    return event


class ChatStreamReader:
    """Reads one streamed chat completion line by line, times its tokens and keeps its text."""

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.token_times: list[float] = []
        self.pieces: list[str] = []  # the content of each token's chunk
        self.num_usage_tokens: int | None = None
        self.is_done = False

    def feed(self, line: str, now: float) -> None:
        """Take one line received at `now` (same clock as `sent_at`). Raises StreamError on an
        error event."""
        event = parse_sse_line(line)
        if event is None:
            return
        if event == "[DONE]":
            self.is_done = True
            return
        assert isinstance(event, dict)
        if "error" in event:
            raise StreamError(str(event["error"].get("message", event["error"])))
        usage = event.get("usage")
        if usage:
            self.num_usage_tokens = int(usage["completion_tokens"])
        for choice in event.get("choices") or []:
            if content := (choice.get("delta") or {}).get("content"):
                self.token_times.append(now - self.sent_at)
                self.pieces.append(content)

    @property
    def text(self) -> str:
        """The content streamed so far."""
        return "".join(self.pieces)

    def result(self, prompt_index: int, now: float) -> RequestResult:
        tokens = self.num_usage_tokens
        return RequestResult(
            prompt_index=prompt_index,
            token_times=tuple(self.token_times),
            num_completion_tokens=len(self.token_times) if tokens is None else tokens,
            latency=now - self.sent_at,
            sent_at=self.sent_at,
        )


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition: series name -> [(labels, value)]; comments skipped."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        series.setdefault(name, []).append((dict(_LABEL.findall(labels or "")), float(value)))
    return series


DECISIONS = "specserve:spec_decode_policy_decisions_total"
MODE_TOKENS = "specserve:spec_decode_mode_generation_tokens_total"
MODE_SECONDS = "specserve:spec_decode_mode_seconds_total"


def decision_counts(metrics: Mapping[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    """Policy decisions by decision ("speculate", "skip"), summed over reasons; empty when the
    server does not export them."""
    counts: dict[str, float] = {}
    for labels, value in metrics.get(DECISIONS, []):
        decision = labels.get("decision", "")
        counts[decision] = counts.get(decision, 0.0) + value
    return counts


def mode_counters(
    metrics: Mapping[str, list[tuple[dict[str, str], float]]],
) -> dict[str, tuple[float, float]]:
    """Per speculation mode, the (generation tokens, seconds) of the engine steps decided in it;
    empty when the server does not export them."""
    tokens = {labels.get("mode", ""): v for labels, v in metrics.get(MODE_TOKENS, [])}
    seconds = {labels.get("mode", ""): v for labels, v in metrics.get(MODE_SECONDS, [])}
    return {mode: (tokens[mode], seconds.get(mode, 0.0)) for mode in tokens}


def speculating_share(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """Share of per-request decisions between two scrapes that speculated; None when the
    counters are absent or nothing was decided."""
    if not after:
        return None
    speculate = after.get("speculate", 0.0) - before.get("speculate", 0.0)
    skip = after.get("skip", 0.0) - before.get("skip", 0.0)
    total = speculate + skip
    return speculate / total if total > 0 else None


def summarize_level(
    mode: str,
    workload: str,
    concurrency: int,
    results: Sequence[RequestResult],
    window: tuple[float, float],
    share: float | None,
    burst_gap: float,
) -> LevelResult:
    """Aggregate a level over its window (start, end) on the bench's clock: tokens/s counts the
    tokens that arrived inside it (of finished and cut-off requests alike), TTFT percentiles
    cover the requests whose first token arrived inside it, ITL percentiles the tokens inside it.
    Failed requests count as errors only."""
    start, end = window
    ok = [r for r in results if r.error is None]
    inside = [r.tokens_within(start, end) for r in ok]
    ttfts = [r.ttft for r, times in zip(ok, inside, strict=True) if times and times[0] == r.ttft]
    itls = [x for times in inside for x in amortized_itl(times, burst_gap)]
    num_tokens = sum(len(times) for times in inside)
    wall_time = end - start
    return LevelResult(
        mode=mode,
        workload=workload,
        concurrency=concurrency,
        num_requests=sum(1 for r in ok if not r.cancelled),
        num_errors=len(results) - len(ok),
        num_completion_tokens=num_tokens,
        wall_time=wall_time,
        tokens_per_s=num_tokens / wall_time if wall_time > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(itls, 50),
        itl_p99=percentile(itls, 99),
        speculating_share=share,
        num_cancelled=sum(1 for r in ok if r.cancelled),
    )
