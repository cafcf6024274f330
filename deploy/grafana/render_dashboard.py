"""Renders the Grafana dashboard's panels, fed by a real local run, into docs/dashboard.png.

No Grafana needed: the script starts `specserve serve` (the bundled SmolLM2-135M on CPU, n-gram
speculation in mode auto) and a Prometheus that scrapes its /metrics every second, then drives a
few minutes of streaming chat load whose concurrency ramps 1 -> peak -> 1 (code edits whose
answers copy the prompt, where n-gram drafts are accepted; open questions; stop strings; predicted
outputs; clients that hang up mid-stream). Every panel's PromQL from
deploy/grafana/dashboards/specserve.json then goes through Prometheus' query_range API and
matplotlib draws the panels where the dashboard places them (its 24-column grid).

    python deploy/grafana/render_dashboard.py [--duration 210] [--max-clients 20]
        [--prometheus prometheus] [--out docs/dashboard.png] [--save-data run.json]
    python deploy/grafana/render_dashboard.py --from-data run.json   # redraw, no new run

Needs a `prometheus` binary (e.g. Debian's `prometheus` package) and matplotlib.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import matplotlib
import numpy as np
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from policy_workload import FUNCTIONS, OPEN_CHAT, code_edit_prompts  # noqa: E402
from processes import free_port, running, wait_ready  # noqa: E402

logger = logging.getLogger("render_dashboard")
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "specserve.json"
# The offered load as a share of --max-clients over the run: (fraction of the run, share).
RAMP = ((0.0, 0.0), (0.12, 0.0), (0.42, 1.0), (0.58, 1.0), (0.88, 0.0), (1.0, 0.0))


def offered_clients(fraction: float, max_clients: int) -> int:
    """Clients that should be sending at this point of the run (at least one)."""
    for (x0, y0), (x1, y1) in itertools.pairwise(RAMP):
        if x0 <= fraction <= x1:
            share = y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)
            return max(1, round(share * max_clients))
    return 1


def request_body(n: int, model: str) -> tuple[dict[str, Any], int | None]:
    """The n-th request (a streamed chat) and after how many chunks its client hangs up."""
    edits = code_edit_prompts()
    if n % 2 == 0:  # a code edit, greedy: the answer copies the prompt's code
        i = n // 2 % len(edits)
        body: dict[str, Any] = {"messages": [{"role": "user", "content": edits[i]}]}
        body |= {"max_tokens": 200, "temperature": 0}
        if n % 6 == 0:  # Predicted Outputs: the unchanged code is a good guess of the answer
            body["prediction"] = {"type": "content", "content": FUNCTIONS[i % len(FUNCTIONS)][0]}
        if n % 8 == 2:  # a stop string inside the copied code cuts accepted drafts short
            body["stop"] = ["    return"]
    else:  # an open question, sampled
        question = OPEN_CHAT[n // 2 % len(OPEN_CHAT)]
        body = {"messages": [{"role": "user", "content": question}]}
        body |= {"max_tokens": 128, "temperature": 0.7, "seed": n}
        if n % 4 == 1:
            body["stop"] = ["\n\n"]
    body |= {"model": model, "stream": True}
    return body, (4 + n % 12 if n % 9 == 4 else None)


async def one_request(client: httpx.AsyncClient, model: str, n: int) -> str:
    """Stream the n-th request to its end (or hang up early); returns how it ended."""
    body, hang_up_after = request_body(n, model)
    num_chunks = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"http {response.status_code}"
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    num_chunks += 1
                    if hang_up_after is not None and num_chunks >= hang_up_after:
                        return "hung up"
    except httpx.HTTPError as e:
        return type(e).__name__
    return "completed"


async def drive_load(base_url: str, model: str, duration: float, max_clients: int) -> Counter:
    """Closed-loop streaming clients; client i sends only while i < offered_clients(now)."""
    start = time.monotonic()
    numbers = itertools.count()
    outcomes: Counter[str] = Counter()

    async def client_loop(client: httpx.AsyncClient, slot: int) -> None:
        while (elapsed := time.monotonic() - start) < duration:
            if slot >= offered_clients(elapsed / duration, max_clients):
                await asyncio.sleep(0.5)
                continue
            outcomes[await one_request(client, model, next(numbers))] += 1

    async def report() -> None:
        while (elapsed := time.monotonic() - start) < duration:
            clients = offered_clients(elapsed / duration, max_clients)
            logger.info("t=%3.0f s: %d clients, %s", elapsed, clients, dict(outcomes))
            await asyncio.sleep(15)

    limits = httpx.Limits(max_connections=max_clients + 4)
    timeout = httpx.Timeout(300, connect=10)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        await asyncio.gather(report(), *(client_loop(client, i) for i in range(max_clients)))
    return outcomes


def prometheus_config(target: str, interval: str) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [{"job_name": "specserve", "static_configs": [{"targets": [target]}]}],
    }


def fill_variables(expr: str, model: str, rate_interval: str) -> str:
    """The dashboard variables Grafana would substitute: the model and the rate window."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return expr.replace("${model_name}", model).replace("$model_name", model)


def panel_queries(dashboard: dict[str, Any], model: str, rate_interval: str) -> list[str]:
    """Every target's expr with the variables filled in, in panel order."""
    panels = dashboard["panels"]
    targets = [target for panel in panels for target in panel.get("targets", [])]
    return [fill_variables(target["expr"], model, rate_interval) for target in targets]


def query_range(prom_url: str, expr: str, start: float, end: float, step: float) -> Any:
    """Prometheus' matrix result for `expr`, or {"error": ...} when the query fails."""
    params = {"query": expr, "start": start, "end": end, "step": step}
    payload = httpx.get(f"{prom_url}/api/v1/query_range", params=params, timeout=60).json()
    if payload.get("status") != "success":
        return {"error": payload.get("error", "unknown error")}
    return payload["data"]["result"]


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    spec = {"method": "ngram", "num_speculative_tokens": 5, "mode": "auto"}
    command = [sys.executable, "-m", "server.cli", "serve", "--config", str(args.config)]
    command += ["--model", args.model, "--speculative-config", json.dumps(spec)]
    command += ["--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.kv_blocks)]
    command += ["--port", str(port), "--log-stats-interval", "0"]
    return command + ["--shutdown-timeout", "5", "--log-level", "warning"]


def prometheus_command(args: argparse.Namespace, tmp: Path, address: str, target: str) -> list[str]:
    """Prometheus scraping `target` every --scrape-interval, its data in `tmp`."""
    config_path = tmp / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(prometheus_config(target, args.scrape_interval)))
    command = [args.prometheus, f"--config.file={config_path}", "--log.level=warn"]
    return command + [f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address={address}"]


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Serve, scrape and load; returns the run's times and every panel query's result."""
    server_port, prom_port = free_port(), free_port()
    server = server_command(args, server_port)
    prometheus = prometheus_command(args, tmp, f"127.0.0.1:{prom_port}", f"127.0.0.1:{server_port}")
    base_url, prom_url = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{prom_port}"
    with (
        running(prometheus, tmp / "prometheus.log") as prom_proc,
        running(server, tmp / "server.log") as server_proc,
    ):
        wait_ready(f"{prom_url}/-/ready", prom_proc, tmp / "prometheus.log", 60)
        wait_ready(f"{base_url}/health", server_proc, tmp / "server.log", args.startup_timeout)
        warmup = {"model": args.model, "messages": [{"role": "user", "content": "Hi"}]}
        httpx.post(f"{base_url}/v1/chat/completions", json=warmup | {"max_tokens": 8}, timeout=300)
        logger.info("server and Prometheus up; %.0f s of load", args.duration)
        start = time.time()
        outcomes = asyncio.run(drive_load(base_url, args.model, args.duration, args.max_clients))
        end = time.time()
        logger.info("requests: %s", dict(outcomes))
        time.sleep(5)  # the last scrapes
        dashboard = json.loads(DASHBOARD.read_text())
        exprs = panel_queries(dashboard, args.model, args.rate_interval)
        query_start, query_end = round(start - 10, 3), round(end + 5, 3)
        results = {e: query_range(prom_url, e, query_start, query_end, args.step) for e in exprs}
    return {
        "start": start,
        "end": end,
        "query_start": query_start,
        "query_end": query_end,
        "step": args.step,
        "rate_interval": args.rate_interval,
        "model": args.model,
        "ramp": [[start + x * (end - start), y * args.max_clients] for x, y in RAMP],
        "outcomes": dict(outcomes),
        "results": results,
    }


# --------------------------------------------------------------------------- drawing

BACKGROUND, CARD, TEXT, DIM, LINES = "#111217", "#181b1f", "#ccccdc", "#8e8e9e", "#2c3235"
COLORS = ("#73bf69", "#f2cc0c", "#5794f2", "#ff9830", "#f2495c", "#b877d9", "#8ab8ff", "#fade2a")
HEAT = LinearSegmentedColormap.from_list("heat", [CARD, "#ff9830", "#fff3b0"])
ROW, HEADER = 0.45, 1.1  # inches per grid row (a grid column is 1 inch), inches above the grid


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-cpu.yaml")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--duration", type=float, default=210.0, help="seconds of load")
    parser.add_argument("--max-clients", type=int, default=20, help="peak concurrency")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=320, help="KV cache blocks")
    parser.add_argument("--prometheus", default="prometheus", help="the Prometheus binary")
    parser.add_argument("--scrape-interval", default="1s")
    parser.add_argument("--rate-interval", default="15s", help="for $__rate_interval")
    parser.add_argument("--step", type=float, default=2.0, help="query_range step, seconds")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--save-data", type=Path, help="also write the query results (JSON)")
    parser.add_argument("--from-data", type=Path, help="redraw saved results, run nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server and Prometheus are stopped either way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.from_data:
        data = json.loads(args.from_data.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="specserve-dashboard-") as tmp:
            try:
                data = run(args, Path(tmp))
            except BaseException:
                for log in sorted(Path(tmp).glob("*.log")):
                    logger.error(
                        "%s (tail):\n%s", log.name, log.read_text(errors="replace")[-3000:]
                    )
                raise
        if args.save_data:
            args.save_data.write_text(json.dumps(data))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw_dashboard(json.loads(DASHBOARD.read_text()), data, args.out)
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
