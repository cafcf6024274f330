"""Renders the Grafana dashboard's panels, fed by a real local run, into docs/dashboard.png.

No Grafana needed: the script starts `specserve serve` (the bundled SmolLM2-135M on CPU, n-gram
speculation in mode auto) and a Prometheus that scrapes its /metrics every second, then drives a
few minutes of streaming chat load whose concurrency ramps 1 -> peak -> 1 (code edits whose
answers copy the prompt, where n-gram drafts are accepted; open questions; stop strings; predicted
outputs; clients that hang up mid-stream). Every panel's PromQL from
deploy/grafana/dashboards/specserve.json then goes through Prometheus' query_range API and
matplotlib draws the panels where the dashboard places them (its 24-column grid;
deploy/grafana/dashboard_drawing.py).

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
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import yaml
from dashboard_drawing import draw_dashboard, fill_variables

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the bench package lies at the repository root
    sys.path.insert(0, str(ROOT))

from bench.common.processes import free_port, running, wait_ready  # noqa: E402
from bench.policy.workload import FUNCTIONS, OPEN_CHAT, code_edit_prompts  # noqa: E402

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
