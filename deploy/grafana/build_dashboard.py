"""Writes deploy/grafana/dashboards/specserve.json, the Grafana dashboard of specserve.

The panels are data here (title, PromQL, unit) so that the queries read as a list and the JSON is
regenerated, never edited by hand:

    python deploy/grafana/build_dashboard.py           # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check   # exit 1 if the JSON is out of date

Every query names only series that the server exports (tests/unit/test_deploy.py checks the names
against server/metrics.py's list, tests/e2e/test_dashboard_metrics.py against a live /metrics).
`$model_name` selects the served models; `$datasource` the Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).parent / "dashboards" / "specserve.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{model_name=~"$model_name"}'  # every query's selector
WINDOW = "[$__rate_interval]"
GRID_WIDTH = 24


def rate(series: str, by: str = "model_name") -> str:
    """Per-second rate of a counter summed over instances, kept apart by `by`."""
    return f"sum by ({by}) (rate(specserve:{series}{SEL}{WINDOW}))"


def quantile(q: float, histogram: str, by: str = "model_name") -> str:
    """The q-quantile of a histogram over the rate window."""
    buckets = f"sum by (le, {by}) (rate(specserve:{histogram}_bucket{SEL}{WINDOW}))"
    return f"histogram_quantile({q}, {buckets})"


def mean(histogram: str) -> str:
    """The mean observation of a histogram over the rate window."""
    return f"{rate(histogram + '_sum')} / {rate(histogram + '_count')}"


def gauge(series: str) -> str:
    return f"sum by (model_name) (specserve:{series}{SEL})"


@dataclass(frozen=True)
class Query:
    """One PromQL target and its legend."""

    expr: str
    legend: str = "{{model_name}}"
    heatmap: bool = False


@dataclass(frozen=True)
class Panel:
    """One panel: `kind` is a Grafana panel type (timeseries, stat, heatmap)."""

    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    description: str = ""
    stacked: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def _latency(title: str, histogram: str, description: str) -> Panel:
    return Panel(
        title,
        tuple(
            Query(quantile(q, histogram), f"p{round(q * 100)} {{{{model_name}}}}")
            for q in (0.5, 0.99)
        ),
        unit="s",
        description=description,
    )


ACCEPTANCE_RATE = (
    f"{rate('spec_decode_num_accepted_tokens_total')}"
    f" / {rate('spec_decode_num_draft_tokens_total')}"
)
MEAN_ACCEPTANCE_LENGTH = (
    f"1 + {rate('spec_decode_num_accepted_tokens_total')} / {rate('spec_decode_num_drafts_total')}"
)
SHARE_SPECULATING = (
    f"{gauge('spec_decode_requests_speculating')} / {gauge('spec_decode_requests_decoding')}"
)

OVERVIEW = (
    Panel(
        "Generated tokens/s",
        (Query(f"sum({rate('generation_tokens_total')})", "tokens/s"),),
        unit="short",
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Running requests",
        (Query(f"sum({gauge('num_requests_running')})", "running"),),
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Waiting requests",
        (Query(f"sum({gauge('num_requests_waiting')})", "waiting"),),
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "KV cache usage",
        (Query(f"max({gauge('kv_cache_usage_perc')})", "KV"),),
        unit="percentunit",
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Draft acceptance rate",
        (Query(f"avg({ACCEPTANCE_RATE})", "acceptance"),),
        unit="percentunit",
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Mean acceptance length",
        (Query(f"avg({MEAN_ACCEPTANCE_LENGTH})", "tokens/verify"),),
        kind="stat",
        width=4,
        height=4,
    ),
)

SERVING = (
    _latency(
        "Time to first token",
        "time_to_first_token_seconds",
        "From arrival to the first generated token.",
    ),
    _latency(
        "Inter-token latency",
        "inter_token_latency_seconds",
        "Between consecutive output tokens of a request (a verify step that accepts several "
        "tokens spreads its time over them).",
    ),
    _latency(
        "End-to-end request latency",
        "e2e_request_latency_seconds",
        "From arrival to the last token.",
    ),
    Panel(
        "Token throughput",
        (
            Query(rate("generation_tokens_total"), "generated {{model_name}}"),
            Query(rate("prompt_tokens_total"), "prompt {{model_name}}"),
        ),
        unit="short",
        description="Tokens per second.",
    ),
    Panel(
        "Requests running and waiting",
        (
            Query(gauge("num_requests_running"), "running {{model_name}}"),
            Query(gauge("num_requests_waiting"), "waiting {{model_name}}"),
        ),
        description="Waiting requests are what the HorizontalPodAutoscaler scales on.",
    ),
    Panel(
        "KV cache usage",
        (Query(gauge("kv_cache_usage_perc")),),
        unit="percentunit",
        options={"max": 1, "min": 0},
    ),
    Panel(
        "Preemptions",
        (Query(rate("num_preemptions_total")),),
        unit="short",
        description="Requests preempted (recomputed later) per second: the KV pool ran dry.",
    ),
    Panel(
        "Finished requests by reason",
        (
            Query(
                rate("request_success_total", "model_name, finished_reason"),
                "{{finished_reason}} {{model_name}}",
            ),
        ),
        unit="reqps",
        stacked=True,
    ),
    _latency(
        "Queue time",
        "request_queue_time_seconds",
        "From arrival to the first scheduled step.",
    ),
    Panel(
        "Prefix cache hit rate",
        (
            Query(
                f"{rate('prefix_cache_hits_total')} / {rate('prefix_cache_queries_total')}",
            ),
        ),
        unit="percentunit",
        width=24,
        height=6,
        description="Prompt blocks found in the prefix cache, per block looked up.",
    ),
)

SPECULATION = (
    Panel(
        "Draft acceptance rate",
        (Query(ACCEPTANCE_RATE),),
        unit="percentunit",
        description="Accepted draft tokens per draft token verified (the bonus token excluded).",
    ),
    Panel(
        "Mean acceptance length",
        (Query(MEAN_ACCEPTANCE_LENGTH),),
        description="Tokens a verify step yields per request on average: 1 + accepted per draft.",
    ),
    Panel(
        "Acceptance by draft position",
        (
            Query(
                f"{rate('spec_decode_num_accepted_tokens_per_pos_total', 'model_name, position')}"
                f" / on (model_name) group_left {rate('spec_decode_num_drafts_total')}",
                "position {{position}} {{model_name}}",
            ),
        ),
        unit="percentunit",
        description="Share of drafts whose token at this position (1-based) was accepted.",
    ),
    Panel(
        "Draft tokens per step",
        (
            Query(
                "sum by (le) (increase(specserve:spec_decode_draft_tokens_per_step_bucket"
                f"{SEL}{WINDOW}))",
                "{{le}}",
                heatmap=True,
            ),
        ),
        kind="heatmap",
        description="k granted per decoding request per step (0: speculation off for it).",
    ),
    Panel(
        "Draft tokens per step (quantiles)",
        tuple(
            Query(
                quantile(q, "spec_decode_draft_tokens_per_step"),
                f"p{round(q * 100)} {{{{model_name}}}}",
            )
            for q in (0.5, 0.9)
        )
        + (Query(mean("spec_decode_draft_tokens_per_step"), "mean {{model_name}}"),),
    ),
    Panel(
        "Share of decoding requests speculating",
        (Query(SHARE_SPECULATING),),
        unit="percentunit",
        options={"max": 1, "min": 0},
        description="Decoding requests granted k > 0 in the latest step.",
    ),
    Panel(
        "Policy decisions by reason",
        (
            Query(
                rate("spec_decode_policy_decisions_total", "decision, reason"),
                "{{decision}}: {{reason}}",
            ),
        ),
        unit="short",
        stacked=True,
        width=12,
        description="Per-request speculation decisions per second, and why.",
    ),
    Panel(
        "Draft vs verify time per step",
        (
            Query(mean("spec_decode_draft_time_seconds"), "draft mean {{model_name}}"),
            Query(mean("spec_decode_verify_time_seconds"), "verify mean {{model_name}}"),
            Query(quantile(0.99, "spec_decode_draft_time_seconds"), "draft p99 {{model_name}}"),
            Query(quantile(0.99, "spec_decode_verify_time_seconds"), "verify p99 {{model_name}}"),
        ),
        unit="s",
        width=12,
        description="Proposer time per step that drafted; target forward plus verification per "
        "step with drafts.",
    ),
    Panel(
        "Predicted outputs",
        (
            Query(
                rate("spec_decode_num_prediction_accepted_tokens_total"),
                "accepted {{model_name}}",
            ),
            Query(
                rate("spec_decode_num_prediction_rejected_tokens_total"),
                "rejected {{model_name}}",
            ),
            Query(rate("spec_decode_num_cut_by_stop_tokens_total"), "cut by stop {{model_name}}"),
        ),
        unit="short",
        width=24,
        height=6,
        description="Draft tokens per second from requests' `prediction`, and accepted drafts "
        "dropped because a stop condition ended the output.",
    ),
)

ROWS = (("Overview", OVERVIEW), ("Serving", SERVING), ("Speculative decoding", SPECULATION))


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
