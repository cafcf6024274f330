"""The Grafana dashboard: its JSON is what deploy/grafana/build_dashboard.py generates, its layout
fits the grid, and every query parses as PromQL and names only series the server exports
(EXPORTED, from tests/metric_schema.py, mirrors the server's metric list)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

from tests.metric_schema import EXPORTED
from tests.unit.deploy.helpers import DASHBOARD, DEPLOY, dashboard_exprs, promql_selectors


def test_dashboard_json_is_generated(monkeypatch):
    path = DEPLOY / "grafana" / "build_dashboard.py"
    spec = importlib.util.spec_from_file_location("build_dashboard", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run python deploy/grafana/build_dashboard.py"


def test_dashboard_layout():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "model_name"]
    titles = {p["title"] for p in panels}
    assert {
        "Draft acceptance rate",
        "Mean acceptance length",
        "Acceptance by draft position",
        "Draft tokens per step",
        "Policy decisions by reason",
        "Draft vs verify time per step",
        "Share of decoding requests speculating",
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Token throughput",
        "Requests running and waiting",
        "KV cache usage",
        "Preemptions",
    } <= titles


def test_dashboard_queries_name_exported_series():
    exprs = dashboard_exprs()
    assert len(exprs) > 30
    for expr in exprs:
        selectors = promql_selectors(expr)
        assert selectors, expr
        for name, labels in selectors:
            assert name in EXPORTED, f"{name} is not exported ({expr})"
            if "$model_name" in expr:
                assert labels.get("model_name") == "x", f"{name} ignores $model_name ({expr})"
    used = {name for expr in exprs for name, _ in promql_selectors(expr)}
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in EXPORTED}
    unused = families - {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert not unused, f"exported but on no panel: {sorted(unused)}"


def test_promql_check_is_not_blind():
    assert promql_selectors('rate(specserve:x_total{model_name=~"$model_name"}[$__rate_interval])')
    with pytest.raises(ValueError):
        promql_selectors("sum(rate(specserve:x_total[5m])")
    assert "specserve:spec_decode_num_accepted_tokens" not in EXPORTED  # counters carry _total
