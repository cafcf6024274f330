"""bench/structured/grammar_mask.py without a tokenizer or a model: the walk through a document
(what it times, where it rolls back), the per-library summary and the table's ratios, over a fake
grammar library that accepts one token sequence."""

from __future__ import annotations

import pytest

from bench.structured import grammar_mask as G


class FakeLibrary:
    """Accepts exactly `expected`, token by token; records every call."""

    name = "fake"

    def __init__(self, expected: list[int]) -> None:
        self.expected = expected
        self.calls: list[tuple] = []
        self.num_matchers = 0

    def matcher(self, schema: str) -> list[int]:
        self.num_matchers += 1
        return []  # the tokens accepted so far

    def bitmask(self) -> None:
        return None

    def fill(self, matcher: list[int], bitmask: None) -> None:
        self.calls.append(("fill", len(matcher)))

    def advance(self, matcher: list[int], token_id: int) -> bool:
        if len(matcher) >= len(self.expected) or self.expected[len(matcher)] != token_id:
            return False
        matcher.append(token_id)
        return True

    def forced(self, matcher: list[int]) -> str:
        self.calls.append(("forced", len(matcher)))
        return ""

    def rollback(self, matcher: list[int], num_tokens: int) -> None:
        self.calls.append(("rollback", len(matcher), num_tokens))
        del matcher[len(matcher) - num_tokens :]


def test_walk_times_every_token_and_rolls_back_content_windows_only():
    ids = [10, 11, 12, 13, 14, 99]  # 5 content tokens, then the stop token
    lib = FakeLibrary(ids)
    run = G.walk(lib, "{}", ids, rollback_tokens=2)
    times = run["times"]
    assert len(times["fill"]) == len(times["advance"]) == len(times["step"]) == 6
    assert len(times["forced"]) == 5  # none after the stop token
    # windows of 2 inside the 5 content tokens: starting at 0..3
    rollbacks = [c for c in lib.calls if c[0] == "rollback"]
    assert rollbacks[:4] == [("rollback", p + 2, 2) for p in range(4)]
    assert rollbacks[4] == ("rollback", 6, 1)  # the stop token, then accepted again
    assert run["can_reaccept_stop"] is True
    assert lib.num_matchers == 2  # the timed walk and the rollback walk each compile
    assert run["first_mask_s"] == times["fill"][0]
    assert all(
        s == pytest.approx(f + a)
        for s, f, a in zip(*(times[k] for k in ("step", "fill", "advance")), strict=True)
    )


def test_walk_stops_on_a_refused_token():
    lib = FakeLibrary([1, 2, 3])
    with pytest.raises(SystemExit, match="refused token 1"):
        G.walk(lib, "{}", [1, 5, 3], rollback_tokens=1)


def _run(case: str, compile_s: float, step_s: list[float], stop_ok: bool = True) -> dict:
    times = {part: list(step_s) for part in G.PARTS}
    return {
        "case": case,
        "compile_s": compile_s,
        "first_mask_s": step_s[0],
        "can_reaccept_stop": stop_ok,
        "times": times,
    }


def test_summarize_pools_tokens_and_takes_the_median_compile_per_case():
    runs = [
        _run("a", 0.010, [1e-6, 2e-6, 3e-6]),
        _run("a", 0.030, [4e-6]),
        _run("a", 0.020, [5e-6]),
        _run("b", 0.100, [6e-6], stop_ok=False),
    ]
    summary = G.summarize(runs, prep_s=0.5)
    assert summary["tokenizer_prep_s"] == 0.5
    assert summary["compile_ms"] == pytest.approx({"a": 20.0, "b": 100.0})
    assert summary["compile_ms_median"] == pytest.approx(60.0)
    step = summary["per_token"]["step"]
    assert step["num"] == 6
    assert step["p50_us"] == pytest.approx(3.5)
    assert step["mean_us"] == pytest.approx(3.5)
    assert step["p99_us"] == pytest.approx(5.95)
    assert summary["first_mask_us_median"] == pytest.approx(4.5)
    assert summary["can_reaccept_stop_after_rollback"] is False


def test_report_has_a_row_per_figure_and_the_ratio_of_the_libraries():
    xgr = G.summarize([_run("a", 0.01, [2e-6, 2e-6])], prep_s=0.5)
    llg = G.summarize([_run("a", 0.001, [6e-6, 6e-6])], prep_s=1.5)
    table = G.report({"libraries": {"xgrammar": xgr, "llguidance": llg}})
    lines = table.splitlines()
    assert len(lines) == 1 + 3 + 3 * len(G.PARTS) + 1
    assert lines[1].split()[-1] == "3.00x"  # tokenizer prep
    step = next(line for line in lines if line.startswith("step p50"))
    assert step.split()[-3:] == ["2.00", "6.00", "3.00x"]
    assert lines[-1].endswith("xgrammar yes, llguidance yes")
