"""Where step-time fits are kept: under <cache root>/calibration/, keyed by everything that decides
the timings (engine/policy/calibration.py's docstring lists it); `load_or_calibrate` returns the
cached fit (on probation: engine/policy/cached_fit.py), else calibrates now and caches the fit
when it was quiet and plausible.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

from engine import kernels
from engine.execution.graph_buckets import verify_query_len
from engine.execution.runner import ModelRunner
from engine.policy.cached_fit import FIT_MARGIN, NUM_CHECK_STEPS, CachedFit
from engine.policy.calibration import QUIET_SPREAD, calibration_grid, measure
from engine.policy.step_time import StepTimeModel
from engine.runtime.cache import cache_root
from engine.scheduling.block_manager import BlockManager

logger = logging.getLogger(__name__)


def load_or_calibrate(
    runner: ModelRunner,
    block_manager: BlockManager,
    model_path: Path,
    max_num_batched_tokens: int,
    max_model_len: int,
    cache_dir: str | Path | None = None,
) -> StepTimeModel:
    """The cached fit for this model, device and dtype, else a fresh calibration (then cached
    if it was quiet and plausible). A fit in the cache comes back as a CachedFit: unconfirmed
    until the first served steps judge it."""
    key = _cache_key(runner, model_path, max_num_batched_tokens, max_model_len)
    path = cache_root(cache_dir) / "calibration" / f"{key}.json"
    is_cached = os.environ.get("SPECSERVE_CALIBRATION_CACHE", "1") != "0"
    try:
        if not is_cached:
            raise OSError("calibration cache disabled")
        text = path.read_text()
        model = StepTimeModel.from_dict(json.loads(text))
        taken = datetime.fromtimestamp(path.stat().st_mtime).isoformat(sep=" ", timespec="seconds")
        logger.info(
            "calibration: cached fit from %s (taken %s): t(1) = %.1f ms, knee at %d tokens; "
            "unconfirmed until %d served decode steps agree with it within %.2fx",
            path,
            taken,
            model.predict(1) * 1e3,
            model.knee,
            NUM_CHECK_STEPS,
            FIT_MARGIN,
        )
        return CachedFit(model, path, text, "cached")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    start = time.perf_counter()
    run = measure(runner, block_manager, max_num_batched_tokens, max_model_len)
    model = run.model
    logger.info(
        "calibration: measured now, in %.1f s: t(1) = %.1f ms, t(%d) = %.1f ms, knee at %d "
        "tokens, %.4f us per KV position a query token reads",
        time.perf_counter() - start,
        model.predict(1) * 1e3,
        model.grid[-1],
        model.predict(model.grid[-1]) * 1e3,
        model.knee,
        model.context_coef * 1e6,
    )
    if model.context_grid is not None and model.context_coefs is not None:
        logger.info(
            "calibration: the attention runs a step's queries in parallel here; us per KV read "
            "by query count: %s",
            ", ".join(
                f"{n}: {c * 1e6:.4f}"
                for n, c in zip(model.context_grid, model.context_coefs, strict=True)
            ),
        )
    if not is_cached:
        return model
    if not run.is_quiet:
        logger.warning(
            "calibration: t(1) timed %d times from %.1f to %.1f ms, median %.2fx the least "
            "(over %.2fx: other work on the machine): the fit takes the least, is not cached, "
            "and the next start calibrates again",
            len(run.t1_seconds),
            min(run.t1_seconds) * 1e3,
            max(run.t1_seconds) * 1e3,
            run.spread,
            QUIET_SPREAD,
        )
    elif not is_plausible(model):
        logger.warning(
            "calibration: the step-time fit is flat up to %d tokens (other work on the "
            "machine?): not cached; the online refinement takes it from here and the next start "
            "calibrates again",
            model.grid[-1],
        )
    else:
        text = json.dumps(model.to_dict())
        if _write_atomic(path, text):
            return CachedFit(model, path, text, "just measured")
    return model


def is_plausible(model: StepTimeModel) -> bool:
    """A forward over 64+ tokens costs visibly more than over one on any real device; a fit that
    says otherwise was timed while something else held the machine, and must not be cached."""
    if model.predict(1) <= 0.0:
        return False
    return model.grid[-1] < 64 or model.predict(model.grid[-1]) >= 1.2 * model.predict(1)


def _cache_key(
    runner: ModelRunner, model_path: Path, max_num_batched_tokens: int, max_model_len: int
) -> str:
    config = runner.config
    graphs = runner.graphs
    device = runner.device.torch
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"{cpu_name()}-{torch.get_num_threads()}threads-{kernels.speed_signature()}"
    parts = [
        str(Path(model_path).resolve()),
        device_name,
        str(runner.dtype),
        runner.weight_format,  # the blocks' formats and what they multiply (int8 or float)
        torch.__version__,
        runner.backend.name,
        str(runner.block_size),
        str(calibration_grid(max_num_batched_tokens, verify_query_len(config))),
        str(max_model_len),
        # The path and shape of the timed steps: graphs replayed or eager, and which buckets.
        f"enforce_eager={config.enforce_eager}",
        "eager" if graphs is None else f"graphs {list(graphs.buckets)}",
        f"max_num_seqs={config.max_num_seqs} query_len={verify_query_len(config)}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says: machines of one kind may
    differ in their CPU, and so in every timing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _write_atomic(path: Path, text: str) -> bool:
    """Write text to path in one step; whether it was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError as e:  # a read-only cache only costs the next start a calibration
        logger.warning("could not cache the step-time model at %s: %s", path, e)
        return False
