"""Writes deploy/grafana/dashboards/specserve.json, the Grafana dashboard of specserve.

The panels are data (title, PromQL, unit; deploy/grafana/dashboard_panels.py) so that the queries
read as a list; this script lays them out and the JSON is regenerated, never edited by hand:

    python deploy/grafana/build_dashboard.py           # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check   # exit 1 if the JSON is out of date

Every query names only series that the server exports (tests/unit/deploy/test_grafana.py checks
the names against server/metrics.py's list, tests/e2e/test_dashboard_metrics.py against a live
/metrics).
`$model_name` selects the served models; `$datasource` the Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # already first when run as a script
    sys.path.insert(0, str(Path(__file__).parent))

from dashboard_panels import ROWS, Panel, Query  # noqa: E402

OUTPUT = Path(__file__).parent / "dashboards" / "specserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


def _target(query: Query, ref_id: str) -> dict[str, Any]:
    target: dict[str, Any] = {
        "datasource": DATASOURCE,
        "expr": query.expr,
        "legendFormat": query.legend,
        "refId": ref_id,
    }
    if query.heatmap:
        target["format"] = "heatmap"
    return target


def _field_config(panel: Panel) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit, **panel.options}
    if panel.kind == "timeseries":
        defaults["custom"] = {
            "drawStyle": "line",
            "fillOpacity": 20 if panel.stacked else 8,
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": True,
            "stacking": {"group": "A", "mode": "normal" if panel.stacked else "none"},
        }
    return {"defaults": defaults, "overrides": []}


def _panel_options(panel: Panel) -> dict[str, Any]:
    if panel.kind == "stat":
        return {
            "colorMode": "value",
            "graphMode": "area",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        }
    if panel.kind == "heatmap":
        return {
            "calculate": False,
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "yAxis": {"axisLabel": "draft tokens"},
        }
    return {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "targets": [_target(query, chr(ord("A") + i)) for i, query in enumerate(panel.queries)],
        "fieldConfig": _field_config(panel),
        "options": _panel_options(panel),
    }


def _layout() -> list[dict[str, Any]]:
    """Rows one under the other; panels fill each row left to right, wrapping at 24 columns."""
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row_panels in ROWS:
        panels.append(
            {
                "id": len(panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        x, line_height = 0, 0
        for panel in row_panels:
            if x + panel.width > GRID_WIDTH:
                x, y, line_height = 0, y + line_height, 0
            panels.append(_panel_json(panel, len(panels) + 1, x, y))
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return panels


def _templating() -> dict[str, Any]:
    model_query = "label_values(specserve:num_requests_running, model_name)"
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
            },
            {
                "name": "model_name",
                "label": "Model",
                "type": "query",
                "datasource": DATASOURCE,
                "definition": model_query,
                "query": {"query": model_query, "refId": "model_name"},
                "includeAll": True,
                "allValue": ".*",
                "multi": True,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "refresh": 2,
                "sort": 1,
                "hide": 0,
            },
        ]
    }


def build_dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model."""
    return {
        "uid": "specserve",
        "title": "specserve",
        "description": "Serving and speculative decoding of specserve.",
        "tags": ["specserve", "llm"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "annotations": {"list": []},
        "links": [],
        "templating": _templating(),
        "panels": _layout(),
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            sys.stderr.write(f"{OUTPUT} is out of date: run {Path(__file__).name}\n")
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
