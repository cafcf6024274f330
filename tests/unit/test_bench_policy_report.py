"""bench/policy/report.py: the tables per workload, auto against the best fixed mode round by
round, the pooled ratios and the targets."""

from __future__ import annotations

import pytest

from bench.policy import measurements as M
from bench.policy import report as PR


def _level(mode, c, tps, workload="mixed", share=None, round=0) -> M.LevelResult:
    return M.LevelResult(
        mode, workload, c, 4, 0, 100, 1.0, tps, 0.1, 0.2, 0.01, 0.02, share, round=round
    )


def test_report_has_a_table_and_a_comparison_per_workload():
    levels = [
        _level(mode, c, tps * scale, workload=w)
        for w, scale in (("mixed", 1.0), ("code_gen", 2.0))
        for c in (1, 4)
        for mode, tps in (("off", 10.0), ("auto", 12.0))
    ]
    levels += [_level("off", c, 10.0, "code_edit") for c in (1, 4)]
    levels += [_level("auto", 1, 16.0, "code_edit"), _level("auto", 4, 30.0, "code_edit")]
    text = PR.report(levels)
    headings = [line for line in text.splitlines() if line.endswith(":")]
    assert headings == [
        "Mixed workload (code edit + open chat):",
        "Code generation (functions to complete):",
        "Code edit only:",
    ]
    assert "c=4: auto vs best(off): +20.0% median" in text  # mixed: unprefixed, as before
    assert "code_gen c=4: auto vs best(off): +20.0% median" in text
    assert "code_edit c=4: auto vs best(off): +200.0% median" in text
    targets = PR.check_targets(levels)
    assert targets["code_edit_c1_auto_over_off"] == pytest.approx(1.6)  # c = 1's, not c = 4's
    assert set(targets["auto_vs_best"]) == {1, 4}  # the target stays on the mixed workload
    assert "Code edit only, concurrency 1:" in PR.report([x for x in levels if x.concurrency == 1])


def test_auto_vs_best_pairs_the_rounds_and_judges_the_median():
    levels = []
    for r, (off, always, auto) in enumerate(
        [(10.0, 20.0, 19.5), (12.0, 18.0, 19.8), (9.0, 22.0, 19.8)]
    ):
        levels += [_level("off", 1, off, round=r), _level("always", 1, always, round=r)]
        levels.append(_level("auto", 1, auto, round=r))
    for r, (off, always, auto) in enumerate(
        [(50.0, 40.0, 47.0), (40.0, 30.0, 41.0), (52.0, 41.0, 49.0)]
    ):
        levels += [_level("off", 8, off, round=r), _level("always", 8, always, round=r)]
        levels.append(_level("auto", 8, auto, round=r))
    levels += [_level("off", 1, 10.0, "code_edit", round=r) for r in range(3)]
    levels += [_level("auto", 1, x, "code_edit", round=r) for r, x in enumerate([16.0, 14.0, 17.0])]
    gaps = PR.auto_vs_best(levels)
    assert gaps[1].best == "always"  # the higher median: 20 against 10
    assert gaps[1].per_round == pytest.approx((-0.025, 0.1, -0.1))
    assert gaps[1].median == pytest.approx(-0.025)
    assert gaps[8].best == "off"
    assert gaps[8].per_round == pytest.approx((-0.06, 0.025, 49 / 52 - 1))
    assert gaps[8].median == pytest.approx(49 / 52 - 1)  # -5.8%: paired in its round
    targets = PR.check_targets(levels)
    assert targets["auto_vs_best"][1] == pytest.approx(-0.025)
    assert targets["auto_within_tolerance"] is False  # c=8 trails off by 5.8%
    assert targets["code_edit_c1_per_round"] == pytest.approx([1.6, 1.4, 1.7])
    assert targets["code_edit_c1_auto_over_off"] == pytest.approx(1.6)
    assert targets["code_edit_c1_target_met"] is True
    c1 = [x for x in levels if x.concurrency == 1 and x.workload == "mixed"]
    assert PR.check_targets(c1)["auto_within_tolerance"] is True
    assert PR.check_targets(c1)["code_edit_c1_target_met"] is None
    single = PR.check_targets([x for x in levels if x.round == 0])  # one round: as it reads
    assert single["auto_vs_best"] == pytest.approx({1: -0.025, 8: -0.06})
    # A run of off and auto alone judges auto against off; without a fixed mode, not at all.
    no_always = [x for x in levels if x.mode != "always"]
    assert {c: g.best for c, g in PR.auto_vs_best(no_always).items()} == {1: "off", 8: "off"}
    assert PR.auto_vs_best(no_always)[1].per_round == pytest.approx((0.95, 0.65, 1.2))
    assert "c=1: auto vs best(off): +95.0% median" in PR.report(no_always)
    assert PR.auto_vs_best([x for x in levels if x.mode == "auto"]) == {}


def test_pooled_ratios_weigh_each_slice_by_its_seconds():
    # One client, code edits: each slice held a request or two, so rounds pair different edits.
    def level(mode, round, tokens, seconds):
        return M.LevelResult(
            mode,
            "code_edit",
            1,
            2,
            0,
            tokens,
            seconds,
            tokens / seconds,
            0.1,
            0.2,
            0.01,
            0.02,
            None,
            round=round,
        )

    slices = [(120, 10.0, 240, 10.0), (120, 10.0, 130, 10.0), (60, 5.0, 130, 10.0)]
    levels = []
    for r, (off_tokens, off_s, auto_tokens, auto_s) in enumerate(slices):
        levels += [level("off", r, off_tokens, off_s), level("auto", r, auto_tokens, auto_s)]
    targets = PR.check_targets(levels)
    assert targets["code_edit_c1_per_round"] == pytest.approx([2.0, 130 / 120, 13 / 12])
    assert targets["code_edit_c1_auto_over_off"] == pytest.approx(13 / 12)  # the median
    # pooled: 500 tokens in 30 s against 300 in 25 s
    assert targets["code_edit_c1_pooled"] == pytest.approx((500 / 30) / (300 / 25))
    gap = PR.auto_vs_best(levels, "code_edit")[1]
    assert gap.pooled == pytest.approx((500 / 30) / (300 / 25) - 1)
    report = PR.report(levels)
    assert "(pooled over the rounds: 1.39x)" in report
    assert "+8.3% median, +38.9% pooled" in report
    assert PR.pooled([level("auto", 0, 10, 1.0)], [level("off", 0, 0, 1.0)]) is None


def test_format_table_shows_the_medians_their_range_and_the_ratio_to_off():
    table = PR.format_table([_level("auto", 2, 30.0, share=0.5), _level("off", 2, 20.0)])
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| 2 | off | 20.00 | - | 1.00x | 100 | 200 | 10 | 20 |")
    assert rows[1].startswith("| 2 | auto | 30.00 | - | 1.50x |") and "| 50% |" in rows[1]
    rounds = [_level("off", 2, x, round=r) for r, x in enumerate([20.0, 26.0, 21.0])]
    rounds += [_level("auto", 2, x, share=0.5, round=r) for r, x in enumerate([30.0, 31.5, 27.0])]
    rows = PR.format_table(rounds).splitlines()[2:]
    assert rows[0].startswith("| 2 | off | 21.00 | 20.00-26.00 | 1.00x |")
    assert rows[1].startswith("| 2 | auto | 30.00 | 27.00-31.50 | 1.43x |")
    (off,) = [r for r in PR.combined(rounds) if r.mode == "off"]
    assert off.num_requests == 12 and off.num_completion_tokens == 300 and off.round == 3
