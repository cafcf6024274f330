"""Where the engine keeps what it builds once: converted models, compiled kernels, calibrations."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache root: cache_dir, else $SPECSERVE_CACHE, else ~/.cache/specserve."""
    root = cache_dir or os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve"
    return Path(root).expanduser()
