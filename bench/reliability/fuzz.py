"""bench/reliability/run.py's fuzz: schemathesis bodies for createChatCompletion and
createCompletion, positive and negative, streaming included, against the live server; it counts
5xx responses, transport failures and 200 streams that do not end with [DONE].

The spec is cut as tests/e2e/test_schemathesis.py cuts it (`strip_spec`: the two operations,
the fields the server reads). Unlike that test, half the cases stream, and the only check is
the server's: no 5xx (the test holds the response schemas). A case's body is edited only to pin
the model, set `stream` and keep generation short.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import tempfile
import time
from typing import Any

import yaml

logger = logging.getLogger("bench.reliability")

MAX_NEW_TOKENS = 4
MAX_N = 2


@dataclasses.dataclass(frozen=True)
class FuzzResult:
    """What the fuzz sent and what came back."""

    num_cases: int
    statuses: dict[str, int]  # status code -> responses
    num_streamed: int  # 200 responses with an SSE body
    num_5xx: int
    num_transport_errors: int  # no response at all (a reset, a timeout)
    num_broken_streams: int  # a 200 SSE body without [DONE] at its end
    # 200 streams schemathesis stopped reading (it reads at most 20 events of a stream): not
    # judged, since their end was never read
    num_cut_short: int
    seconds: float
    examples: tuple[str, ...]  # the first few failures, for the log


def prepare(body: Any, model: str, is_stream: bool) -> Any:
    """A copy of a generated body with the model pinned to the served one, `stream` set to
    `is_stream` where it is a bool or absent (a non-bool value is the case's point), and
    max_tokens and n capped where the spec allows the generated value (an out-of-range value is
    sent as is)."""
    if not isinstance(body, dict):
        return body
    body = copy.deepcopy(body)
    if isinstance(body.get("model"), str):
        body["model"] = model
    if type(body.get("stream", False)) is bool:
        body["stream"] = is_stream
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_NEW_TOKENS  # chat's default is the rest of the context
    for name, high in (("max_tokens", MAX_NEW_TOKENS), ("max_completion_tokens", MAX_NEW_TOKENS)):
        _cap(body, name, high)
    _cap(body, "n", MAX_N)
    return body


def _cap(body: dict[str, Any], name: str, high: int) -> None:
    value = body.get(name)
    if type(value) is int and value >= 1:
        body[name] = min(value, high)


def _is_sse(headers: dict[str, list[str]]) -> bool:
    types = [
        v for name, values in headers.items() if name.lower() == "content-type" for v in values
    ]
    return any(t.startswith("text/event-stream") for t in types)


def run_fuzz(
    base_url: str, model: str, headers: dict[str, str], num_cases: int, spec_path: str
) -> FuzzResult:
    """`num_cases` cases in all, an eighth per (operation, positive / negative, streamed or
    not), derandomised (the same cases every run). Left to the generator, `stream` is rarely
    true in a body the server accepts; setting it per run makes half the cases streams."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.configuration import set_hypothesis_home_dir
    from hypothesis.strategies import just
    from schemathesis import GenerationMode

    from tests.openapi_spec import OPERATIONS, strip_spec

    with open(spec_path, encoding="utf-8") as f:
        spec, _ = strip_spec(yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    schema = schemathesis.openapi.from_dict(spec)
    statuses: collections.Counter[str] = collections.Counter()
    counts = collections.Counter[str]()
    examples: list[str] = []
    start = time.perf_counter()
    runs = [
        (path, mode, is_stream)
        for path, _ in OPERATIONS.values()
        for mode in GenerationMode
        for is_stream in (False, True)
    ]
    per_run = [num_cases // len(runs) + (i < num_cases % len(runs)) for i in range(len(runs))]

    def note(kind: str, case: Any, detail: str) -> None:
        counts[kind] += 1
        if len(examples) < 5:
            examples.append(f"{kind} {case.path}: {detail[:200]} body={str(case.body)[:300]}")

    with tempfile.TemporaryDirectory(prefix="specserve-hypothesis-") as home:
        set_hypothesis_home_dir(home)  # no .hypothesis/ in the repository
        try:
            for (path, mode, is_stream), n in zip(runs, per_run, strict=True):
                operation = schema[path]["POST"]

                @settings(
                    max_examples=n,
                    derandomize=True,
                    database=None,
                    deadline=None,
                    phases=[hypothesis.Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=operation.as_strategy(generation_mode=mode), is_stream=just(is_stream))
                def send(case: Any, is_stream: bool) -> None:
                    case.body = prepare(case.body, model, is_stream)
                    try:
                        response = case.call(
                            base_url=f"{base_url}/v1", headers=headers, timeout=120
                        )
                    except Exception as e:  # noqa: BLE001 - no response is a failure to count
                        note("transport", case, f"{type(e).__name__}: {e}")
                        return
                    statuses[str(response.status_code)] += 1
                    if response.status_code >= 500:
                        note("5xx", case, response.text)
                    if response.status_code == 200 and _is_sse(response.headers):
                        counts["streamed"] += 1
                        if response.stream_cut_short:
                            counts["cut short"] += 1
                        elif not response.text.rstrip().endswith("data: [DONE]"):
                            note("broken stream", case, response.text[-200:])

                send()
                streamed = "streamed" if is_stream else "not streamed"
                logger.info("fuzz %s %s %s: %d cases", path, mode.value, streamed, n)
        finally:
            set_hypothesis_home_dir(None)
    return FuzzResult(
        num_cases=sum(statuses.values()) + counts["transport"],
        statuses=dict(sorted(statuses.items())),
        num_streamed=counts["streamed"],
        num_5xx=counts["5xx"],
        num_transport_errors=counts["transport"],
        num_broken_streams=counts["broken stream"],
        num_cut_short=counts["cut short"],
        seconds=time.perf_counter() - start,
        examples=tuple(examples),
    )
