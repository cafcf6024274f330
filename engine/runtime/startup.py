"""Start-up phases, timed: each logs one line with its duration when it ends, so a slow start
says where its time went.

    startup: model files qwen2.5-coder-1.5b-instruct 9.8 s
    startup: config and tokenizer 1.2 s
    startup: CPU kernels 0.1 s
    startup: load weights qwen2.5-coder-1.5b-instruct 14.0 s
    ...
    ready in 61.4 s

The phases are the engine's (engine.engine, engine.execution.draft_runners, the policy's calibration in
engine.drafters.speculator), the CPU kernels' build or load (engine.kernels: wherever it first
happens, which in the CLI is while the settings are resolved) and the server's; the last line,
"ready in", counts from the command's start. Long phases show their own progress meanwhile (the
GGUF assembly's and the dequantisation's progress bars, the kernel build's log lines).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


@contextmanager
def startup_phase(name: str) -> Iterator[None]:
    """Log "startup: <name> <seconds> s" once the block ends ("... failed after" if it raises)."""
    logger.debug("startup: %s ...", name)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        logger.info("startup: %s failed after %.1f s", name, time.perf_counter() - start)
        raise
    logger.info("startup: %s %.1f s", name, time.perf_counter() - start)


def log_ready(started: float, what: str = "") -> None:
    """The last start-up line: "ready in <seconds> s", counted from `started` (time.monotonic()
    when the command began), then `what` is ready for."""
    suffix = f": {what}" if what else ""
    logger.info("ready in %.1f s%s", time.monotonic() - started, suffix)
