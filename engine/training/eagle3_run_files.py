"""A training run's own files and its progress line: the checkpoint (head, optimizer and random
state, replaced in one step so a run stopped mid-save keeps the last one), the metrics log cut
back to the checkpoint when a run resumes, and the progress shown while it trains.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.training.eagle3_head import TrainableEagle3Head

logger = logging.getLogger(__name__)


def save_checkpoint(
    path: Path, head: TrainableEagle3Head, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """The head, the optimizer and the random state after `step`, written in one step."""
    state = {
        "step": step,
        "model": head.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a run stopped mid-save keeps the previous checkpoint


def load_checkpoint(path: Path, head: TrainableEagle3Head, optimizer: torch.optim.Optimizer) -> int:
    """Restore what save_checkpoint wrote into head and optimizer; the step it was taken at."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    head.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return int(state["step"])


def truncate_metrics(path: Path, start: int) -> None:
    """Keep the records of steps <= start (a resumed run writes the later ones again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if _record_step(line) <= start]
    path.write_text("".join(line + "\n" for line in kept))


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return sys.maxsize


class Progress:
    """tqdm on a terminal; elsewhere a log line every `every` steps. Both show the step, the
    loss and the first steps' top-1 accuracy averaged since the last line, and the ETA."""

    def __init__(self, start: int, total: int, every: int) -> None:
        self.start, self.total, self.every = start, total, every
        self.began = time.monotonic()
        self.window: list[dict[str, Any]] = []
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train-eagle3", unit="step")

    def update(self, record: dict[str, Any]) -> None:
        self.window.append(record)
        step = record["step"]
        if self.bar is not None:
            self.bar.update(1)
        if len(self.window) < self.every and step != self.total:
            return
        loss = sum(r["loss"] for r in self.window) / len(self.window)
        acc = _window_acc(self.window)
        self.window = []
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", acc=" ".join(f"{a:.2f}" for a in acc[:3]))
            return
        elapsed = time.monotonic() - self.began
        eta = elapsed / (step - self.start) * (self.total - step)
        logger.info(
            "step %d/%d  loss %.4f  acc %s  eta %s",
            step,
            self.total,
            loss,
            " ".join(f"{a:.3f}" for a in acc),
            _duration(eta),
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _window_acc(records: list[dict[str, Any]]) -> list[float]:
    hits = [sum(col) for col in zip(*(r["hits"] for r in records), strict=True)]
    counts = [sum(col) for col in zip(*(r["counts"] for r in records), strict=True)]
    return [h / c if c else math.nan for h, c in zip(hits, counts, strict=True)]


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
