"""The drawing half of render_dashboard.py: matplotlib panels in Grafana's dark theme, placed
where the dashboard JSON puts them on its 24-column grid (timeseries, stat and heatmap panels,
row titles, a header describing the run), from the saved query results of a run. Apart from the
run itself, so a saved run (--from-data) is redrawn with this alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

BACKGROUND, CARD, TEXT, DIM, LINES = "#111217", "#181b1f", "#ccccdc", "#8e8e9e", "#2c3235"
COLORS = ("#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a")
HEAT = LinearSegmentedColormap.from_list("heat", [CARD, "#ff9830", "#fff3b0"])
ROW, HEADER = 0.45, 1.1  # inches per grid row (a grid column is 1 inch), inches above the grid


def fill_variables(expr: str, model: str, rate_interval: str) -> str:
    """The dashboard variables Grafana would substitute: the model and the rate window."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return expr.replace("${model_name}", model).replace("$model_name", model)


def format_value(value: float, unit: str) -> str:
    """A tick or stat label in the panel's Grafana unit."""
    if not np.isfinite(value):
        return "-"
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    if unit == "s":
        return f"{value * 1e3:.0f} ms" if abs(value) < 1 else f"{value:.1f} s"
    return f"{value:.3g}" + (" req/s" if unit == "reqps" else "")


def legend_of(fmt: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt or "")
    return text.strip() or ", ".join(f"{k}={v}" for k, v in labels.items()) or "value"


def panel_series(panel: dict[str, Any], data: dict[str, Any]) -> tuple[list[Any], str | None]:
    """[(legend, values on the run's time grid)] over the panel's targets, and a query error."""
    grid = np.arange(data["query_start"], data["query_end"] + 1e-3, data["step"])
    series, error = [], None
    for target in panel.get("targets", []):
        expr = fill_variables(target["expr"], data["model"], data["rate_interval"])
        result = data["results"].get(expr, {"error": "not queried"})
        if isinstance(result, dict):
            error = error or str(result["error"])
            continue
        for item in result:
            values = np.full(len(grid), np.nan)  # NaN where the series has no point
            for t, v in item["values"]:
                values[min(round((float(t) - grid[0]) / data["step"]), len(grid) - 1)] = float(v)
            series.append((legend_of(target.get("legendFormat", ""), item["metric"]), values))
    return series, error


def time_axis(ax: Axes, data: dict[str, Any]) -> np.ndarray:
    """Minutes since the load started, for the grid; x ticks and the peak plateau shaded."""
    grid = np.arange(data["query_start"], data["query_end"] + 1e-3, data["step"])
    minutes = (grid - data["start"]) / 60
    ax.set_xlim(minutes[0], minutes[-1])
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} min"))
    peak = [(t - data["start"]) / 60 for t, _ in data["ramp"][2:4]]
    ax.axvspan(*peak, color="#ffffff", alpha=0.05, lw=0)
    return minutes


def draw_timeseries(ax: Axes, panel: dict[str, Any], series: list[Any], data: dict[str, Any]):
    minutes = time_axis(ax, data)
    # Series that stay at zero (e.g. decisions for reasons that never came up) are left out.
    shown = [(name, v) for name, v in series if np.nanmax(np.abs(v), initial=0) > 0] or series
    defaults = panel["fieldConfig"]["defaults"]
    colors = [COLORS[i % len(COLORS)] for i in range(len(shown))]
    if defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal":
        stack = [np.nan_to_num(v) for _, v in shown]
        ax.stackplot(minutes, stack, labels=[n for n, _ in shown], colors=colors, alpha=0.7)
    else:
        for (name, values), color in zip(shown, colors, strict=True):
            ax.plot(minutes, values, label=name, color=color, linewidth=1.4)
    ax.set_ylim(bottom=defaults.get("min", 0))
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"] * 1.05)
    unit = defaults.get("unit", "short")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_value(v, unit)))
    ax.grid(color=LINES, linewidth=0.6)
    below = -0.3 / (ax.get_position().height * ax.figure.get_figheight())  # under the ticks
    ax.legend(loc="upper left", bbox_to_anchor=(0, below), ncol=legend_columns(panel, shown))


def legend_columns(panel: dict[str, Any], series: list[Any]) -> int:
    return max(1, min(len(series), panel["gridPos"]["w"] // 3))


def draw_stat(ax: Axes, panel: dict[str, Any], series: list[Any], data: dict[str, Any]):
    """Grafana's stat: the last value large, over a sparkline of the run."""
    minutes = time_axis(ax, data)
    values = series[0][1]
    finite = values[np.isfinite(values)]
    last, peak = (finite[-1], finite.max()) if len(finite) else (np.nan, np.nan)
    ax.fill_between(minutes, np.nan_to_num(values), color=COLORS[0], alpha=0.25, lw=0)
    ax.plot(minutes, values, color=COLORS[0], linewidth=1.2)
    ax.set_ylim(0, peak * 1.1 if np.isfinite(peak) and peak > 0 else 1)
    ax.axis("off")
    unit = panel["fieldConfig"]["defaults"].get("unit", "short")
    text = {"transform": ax.transAxes, "ha": "center", "va": "center"}
    ax.text(0.5, 1.75, format_value(last, unit), fontsize=24, color=COLORS[0], **text)
    ax.text(0.5, 1.18, f"last value; peak {format_value(peak, unit)}", color=DIM, **text)


def draw_heatmap(ax: Axes, panel: dict[str, Any], series: list[Any], data: dict[str, Any]):
    """Cumulative `le` buckets turned into per-bucket counts, one band per bucket."""
    minutes = time_axis(ax, data)
    ordered = sorted(series, key=lambda item: float(item[0]))
    cumulative = np.nan_to_num(np.array([values for _, values in ordered]))  # [num_le, num_times]
    counts = np.diff(cumulative, axis=0, prepend=0)
    # Buckets above the largest k granted stay empty: drawn, they would squash the others.
    num_shown = min(len(ordered), int(np.flatnonzero(counts.sum(axis=1) > 0).max(initial=0)) + 2)
    ordered, counts = ordered[:num_shown], counts[:num_shown]
    edges = np.append(minutes, minutes[-1] + data["step"] / 60)
    ax.pcolormesh(edges, np.arange(len(ordered) + 1) - 0.5, counts, cmap=HEAT)
    ax.set_yticks(range(len(ordered)), [name.removesuffix(".0") for name, _ in ordered])
    ax.set_ylabel("draft tokens (le)", color=DIM)


def add_panel(fig: Figure, panel: dict[str, Any], data: dict[str, Any]) -> None:
    """The panel's card and title, then its axes inside (room left for ticks and legend)."""
    pos, height = panel["gridPos"], fig.get_figheight()
    left, top, width, tall = pos["x"], height - HEADER - pos["y"] * ROW, pos["w"], pos["h"] * ROW
    style = {"boxstyle": "round,pad=0,rounding_size=0.05", "facecolor": CARD, "edgecolor": LINES}
    style["zorder"] = -1  # under the axes
    corner = (left + 0.04, top - tall + 0.04)
    card = FancyBboxPatch(corner, width - 0.08, tall - 0.08, transform=fig.dpi_scale_trans, **style)
    fig.patches.append(card)
    fig.text((left + 0.15) / 24, (top - 0.22) / height, panel["title"], fontsize=11, weight="bold")
    series, error = panel_series(panel, data)
    if panel["type"] == "stat":
        box = (left + 0.2, top - tall + 0.12, width - 0.4, tall * 0.33)
    else:
        has_legend = series and panel["type"] == "timeseries"
        rows = -(-len(series) // legend_columns(panel, series)) if has_legend else 0
        bottom = 0.35 + 0.2 * rows  # x ticks, then the legend
        box = (left + 0.8, top - tall + bottom, width - 1.0, tall - bottom - 0.45)
    ax = fig.add_axes((box[0] / 24, box[1] / height, box[2] / 24, box[3] / height), facecolor=CARD)
    if error or not series:
        ax.axis("off")
        message = f"query error: {error}" if error else "No data"
        ax.text(0.5, 0.5, message, color=DIM, ha="center", va="center", transform=ax.transAxes)
        return
    draw = {"stat": draw_stat, "heatmap": draw_heatmap}.get(panel["type"], draw_timeseries)
    draw(ax, panel, series, data)


def draw_dashboard(dashboard: dict[str, Any], data: dict[str, Any], out: Path) -> None:
    """One figure laid out on the dashboard's 24-column grid: a header, rows, panels."""
    num_rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    height = HEADER + num_rows * ROW + 0.1
    style = {"text.color": TEXT, "xtick.color": DIM, "ytick.color": DIM, "axes.edgecolor": LINES}
    style |= {"legend.fontsize": 8, "legend.frameon": False, "font.size": 9}
    with plt.rc_context(style):
        fig = plt.figure(figsize=(24, height), facecolor=BACKGROUND)
        title = f"{dashboard['title']} dashboard ({dashboard['description'].rstrip('.')})"
        fig.text(0.006, 1 - 0.35 / height, title, fontsize=18, weight="bold", va="center")
        peak = max(clients for _, clients in data["ramp"])
        minutes = (data["end"] - data["start"]) / 60
        outcomes = ", ".join(f"{n} {how}" for how, n in sorted(data["outcomes"].items()))
        subtitle = (
            f"A real local run, every panel's query through Prometheus query_range: "
            f"{data['model']} on CPU, n-gram speculation in mode auto; {minutes:.1f} min of "
            f"streaming chat, clients 1 -> {peak:.0f} -> 1 (the peak plateau is shaded); "
            f"requests: {outcomes}; $__rate_interval = {data['rate_interval']}."
        )
        fig.text(0.006, 1 - 0.8 / height, subtitle, fontsize=11, color=DIM, va="center")
        for panel in dashboard["panels"]:
            if panel["type"] != "row":
                add_panel(fig, panel, data)
                continue
            y = height - HEADER - (panel["gridPos"]["y"] + 0.5) * ROW
            fig.text(0.006, y / height, panel["title"], fontsize=14, weight="bold", va="center")
        fig.savefig(out, dpi=100, facecolor=BACKGROUND)
        plt.close(fig)
