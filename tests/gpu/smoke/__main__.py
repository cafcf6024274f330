"""`make gpu-smoke`: one command that proves a GPU node, in about ten minutes on an H100.

    python -m tests.gpu.smoke [--require flash-attn] [--duration 20] [--out FILE]
    python -m tests.gpu.smoke --quick         # the bench's core alone: about 5 minutes
    python -m tests.gpu.smoke --dry-run       # the same on the CPU, a tiny model, ~1 s a point

Stages, in order; the first failure of the environment stops it, later stages always run:
1. Wheels: on a bare node whose image lacks the project's pure-Python dependencies, install the
   folder `make gpu-wheels` built (--wheels, default .gpu-wheels/) into a private directory with
   `pip install --no-index --find-links` (nothing is fetched; the image's torch is untouched).
2. Environment: driver, CUDA, torch, the GPU, which attention kernels import and which of the
   engine's backends are available, NVML. No CUDA device, or a dependency that does not import,
   fails here (SPECSERVE_GPU_TESTS_DEVICE=cpu or --dry-run runs on the CPU instead).
3. Checks: `pytest -m gpu tests/gpu` (tests/gpu/conftest.py prints its summary); with
   `--require flash-attn` a skipped flash-attn check fails; on CUDA the Triton and CUDA-graph
   checks must run whatever is asked.
4. Bench: the GPU preset over a random-weight Qwen2.5-1.5B-shaped model made here from a seed,
   with a draft that is its first layer (tests/gpu/smoke/models.py), at c = 1, 8, 64, speculation
   off and auto, CUDA graphs on and off; then the batch-invariant mode's price at c = 1, 8, and a
   random EAGLE-3 head (mode always, graphs on) at c = 1, 8: its graphs' replay share and its
   steps' cost; and the torch formulation of the layers (`fused_layers: false`, graphs on, off)
   at c = 1, 64, beside the fused kernels' rows, and every step in series (`overlap_scheduling:
   false`, off) at c = 1, 64 beside the overlapped ones (tests/gpu/smoke/bench.py). Each point
   reports the forward's achieved bandwidth, the host's time a step and its share of overlapped
   steps; each engine the kernels one eager decode step launches.
`--quick` skips the checks and keeps the graphs engine (off and auto at c = 1, 8, 64), the
torch formulation's and the serial one's, 10 s a point: about 6 minutes on an H100 or H200
(estimated: three engines built ~2 min, 10 points x 10 s, the model 30 s), for a machine lent
for minutes.
It writes one JSON (--out; default $OUT/gpu-smoke.json where $OUT is set, else
bench/results/gpu-smoke.json) and prints one markdown table. Exit status 0 only when every stage
passed.

Time on an H100 (estimated, not yet measured): environment 10 s, checks ~3 min, model 30 s, two
engines built (weights, mode auto's calibration, graph capture) ~2 min, 12 points x 20 s = 4 min:
about 10 minutes. `--duration` trades the points' precision for time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
DEVICE_ENV = "SPECSERVE_GPU_TESTS_DEVICE"  # as tests/gpu/node.py reads it
SITE = Path(tempfile.gettempdir()) / "specserve-gpu-site"
MAX_JSON_BYTES = 16 * 2**20  # what comes back from a check machine, per file

logger = logging.getLogger("gpu-smoke")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.smoke", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help=f"on the CPU (as {DEVICE_ENV}=cpu)")
    parser.add_argument("--require", action="append", default=[], help="e.g. flash-attn")
    parser.add_argument("--duration", type=float, help="seconds per bench point (20; dry: 1)")
    parser.add_argument("--out", type=Path, help="the JSON file to write")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--tests", nargs="+", default=["tests/gpu"], help="what pytest runs")
    parser.add_argument("--skip-checks", action="store_true", help="no pytest stage")
    parser.add_argument("--skip-bench", action="store_true", help="no bench stage")
    parser.add_argument(
        "--quick", action="store_true", help="no checks; the bench's core at 10 s a point"
    )
    parser.add_argument("--seed", type=int, default=0, help="the random models' seed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ[DEVICE_ENV] = "cpu"
    device = os.environ.setdefault(DEVICE_ENV, "cuda")  # the checks fail, not skip, without one
    dry = device == "cpu"
    started = time.perf_counter()
    result: dict[str, Any] = {"device": device, "dry_run": dry, "require": args.require}
    out = _out_path(args.out)
    # A machine's time limit ends the run with SIGTERM: end it as an exception, so the stages
    # done so far are written below rather than lost.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _run_stages(args, device, result, out)
    except KeyboardInterrupt:
        result.update(verdict="FAIL", interrupted=True)
        _say("gpu-smoke: interrupted", [])
        return 1
    finally:
        result["seconds"] = round(time.perf_counter() - started, 1)
        _write(out, result)


def _run_stages(args: argparse.Namespace, device: str, result: dict[str, Any], out: Path) -> int:
    from tests.gpu.smoke.environment import missing_modules, probe

    if missing_modules():
        result["wheels"] = install_wheels(args.wheels, SITE)
    tokenizer = args.wheels / "smollm2-tokenizer"  # deploy/gpu_wheels.py: without the weights
    if (tokenizer / "tokenizer.json").is_file():
        os.environ.setdefault("SPECSERVE_SMOLLM2_TOKENIZER", str(tokenizer.resolve()))
    env = probe(device)
    result["environment"] = env.__dict__
    _say("environment", env.lines())
    problems = env.problems()
    if problems:
        result.update(verdict="FAIL", problems=problems)
        _say("FAIL before any check", problems)
        return 2
    passed = True
    _write(out, result)
    if not args.skip_checks and not args.quick:
        result["checks"] = run_checks(args.tests, args.require, device, out.parent)
        passed = result["checks"]["exit_status"] == 0
        _write(out, result)
    if not args.skip_bench:
        from tests.gpu.smoke.report import bench_failures, markdown_table

        result["quick"] = args.quick
        result["bench"] = run_bench(
            device,
            args.duration or (1.0 if device == "cpu" else 10.0 if args.quick else 20.0),
            args.seed,
            lambda: _write(out, result),
            quick=args.quick,
        )
        failures = bench_failures(result["bench"])
        result["bench"]["failures"] = failures
        _say("bench", [markdown_table(result["bench"])] + failures)
        passed = passed and not failures
    result["verdict"] = "PASS" if passed else "FAIL"
    _say(f"gpu-smoke: {result['verdict']}", [])
    return 0 if passed else 1


def install_wheels(folder: Path, site: Path) -> dict[str, Any]:
    """pip-install every wheel of `folder` into `site` (no index, no dependencies resolved: the
    folder holds the closure) and put `site` first on this process's and its children's path."""
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        return {"folder": str(folder), "installed": 0, "error": "no wheels there"}
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links",
        str(folder), "--no-deps", "--no-compile", "--upgrade", "--target", str(site), *wheels,
    ]  # fmt: skip
    status = subprocess.run(command, check=False).returncode
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p
    )
    return {"folder": str(folder), "installed": len(wheels), "pip_exit_status": status}


def run_checks(tests: list[str], require: list[str], device: str, folder: Path) -> dict[str, Any]:
    """`pytest -m gpu` over `tests` in a child process (its output goes straight through; a
    JUnit report of every check, failures' tracebacks included, lands in `folder`)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu"]
    command += ["-rfEs", "--durations=15", f"--junitxml={folder / 'gpu-checks.xml'}"]
    command += [*tests, *(f"--require={name}" for name in require)]
    start = time.perf_counter()
    status = subprocess.run(command, cwd=ROOT, env={**os.environ, DEVICE_ENV: device}).returncode
    return {
        "command": " ".join(command[1:]),
        "exit_status": status,
        "seconds": round(time.perf_counter() - start, 1),
    }


def run_bench(
    device: str,
    duration_s: float,
    seed: int,
    save: Callable[[], None] = lambda: None,
    quick: bool = False,
) -> dict[str, Any]:
    """Build the model pair here, then one engine per setting (`quick`: the graphs engine and the
    torch formulation's only); an engine's error is recorded (and fails the bench) rather than
    raised, the next engine still runs, and `save` writes what is done after each engine, so the
    JSON comes back whatever stops the run."""
    import torch
    import yaml

    from tests.gpu.smoke.bench import (
        INVARIANT_CONCURRENCIES,
        PRESET,
        Workload,
        engine_config,
        run_engine,
    )
    from tests.gpu.smoke.models import QWEN25_1_5B, TINY, build_head, build_pair

    dry = device == "cpu"
    # Mode auto's calibration measured on this node now, not read from an earlier run's cache.
    os.environ.setdefault("SPECSERVE_CALIBRATION_CACHE", "0")
    model, dtype = (TINY, torch.float32) if dry else (QWEN25_1_5B, torch.bfloat16)
    workload = Workload(prompt_len=16 if dry else 512, max_tokens=8 if dry else 128,
                        duration_s=duration_s, seed=seed)  # fmt: skip
    overrides: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch.")}
    if dry:
        # A short context and step budget: mode auto's calibration times steps up to it.
        overrides.update(max_model_len=256, max_num_batched_tokens=256)
    bench: dict[str, Any] = {"workload": workload.__dict__, "engines": []}
    with tempfile.TemporaryDirectory(prefix="specserve-smoke-") as tmp:
        start = time.perf_counter()
        try:
            pair = build_pair(Path(tmp), model, seed, dtype, torch.device(device))
        except Exception:
            bench["error"] = traceback.format_exc(limit=20)
            logger.exception("the model pair could not be built")
            return bench
        bench["model"] = {**model.__dict__, "draft_layers": pair.draft_layers, "seed": seed,
                          "build_s": round(time.perf_counter() - start, 1)}  # fmt: skip

        def one(name: str, run: Callable[[], dict[str, Any]]) -> None:
            try:
                bench["engines"].append(run())
            except Exception:
                bench.setdefault("errors", {})[name] = traceback.format_exc(limit=20)
                bench["error"] = f"{name}: " + traceback.format_exc(limit=1).strip()
                logger.exception("the bench's %s engine failed", name)
            save()

        for graphs in (True,) if quick else (True, False):
            config = engine_config(pair, torch.device(device), graphs, **overrides)
            one("graphs" if graphs else "eager", lambda config=config: run_engine(config, workload))
        # The layers' torch formulation beside the fused kernels (on CUDA; the CPU has neither).
        unfused = {**overrides, "fused_layers": False, "speculative_config": None}
        config = engine_config(pair, torch.device(device), True, **unfused)
        one("unfused", lambda: run_engine(config, workload, (1, 64)))
        # Every step in series (overlap scheduling off) beside the overlapped steps.
        serial = {**overrides, "overlap_scheduling": False, "speculative_config": None}
        serial_config = engine_config(pair, torch.device(device), True, **serial)
        one("serial", lambda: run_engine(serial_config, workload, (1, 64)))
        if quick:
            return bench
        # Mode auto with n-gram lookup alone: what the draft model adds or costs beside it.
        spec = yaml.safe_load(PRESET.read_text())["engine"]["speculative_config"]
        ngram = {**spec, "method": "ngram", "model": None}
        config = engine_config(pair, torch.device(device), True, **overrides,
                               speculative_config=ngram)  # fmt: skip
        one("ngram", lambda: run_engine(config, workload, modes=("auto",)))
        config = engine_config(pair, torch.device(device), True, batch_invariant=True, **overrides)
        one("batch_invariant", lambda: run_engine(config, workload, INVARIANT_CONCURRENCIES))

        def eagle3() -> dict[str, Any]:
            head = build_head(Path(tmp), pair, dtype)
            spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
            config = engine_config(pair, torch.device(device), True, **overrides,
                                   speculative_config=dict(spec, mode="always"))  # fmt: skip
            return run_engine(config, workload, INVARIANT_CONCURRENCIES, modes=("always",))

        one("eagle3", eagle3)
    return bench


def _out_path(given: Path | None) -> Path:
    if given is not None:
        return given
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu-smoke.json"
    return ROOT / "bench" / "results" / "gpu-smoke.json"


def _write(out: Path, result: dict[str, Any]) -> None:
    text = json.dumps(result, indent=1, default=str)
    if len(text) > MAX_JSON_BYTES:  # never expected: drop the bulk, keep the verdict
        result = {k: result[k] for k in ("device", "verdict", "seconds") if k in result}
        text = json.dumps(result, indent=1, default=str)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    logger.info("wrote %s (%d bytes)", out, len(text))


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _say(title: str, lines: list[str]) -> None:
    """A block of the command's report on stdout (the logs, on stderr, say how it goes)."""
    print(f"\n===== {title}", *lines, sep="\n", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.exit(main())
