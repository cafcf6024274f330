"""The CUDA path's fused layer kernels, checked on CPU: their checks and the kernel count of a
decode step (tests/unit/triton_layer_interpreted.py) pass in Triton's interpreter, in a subprocess
of their own; and the config turns them on exactly where they can run."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from tests.unit.test_config import fake_cuda_node
from tests.unit.test_triton_attn import needs_triton, run_interpreted

CHECKS = Path(__file__).with_name("triton_layer_interpreted.py")


@needs_triton
def test_the_fused_kernel_checks_pass_in_the_triton_interpreter():
    run_interpreted(CHECKS)


def test_fused_layers_default_to_cuda_with_triton(monkeypatch):
    assert EngineConfig(model="m", device="cpu").fused_layers is False
    with pytest.raises(ValueError, match="fused_layers runs on cuda"):
        EngineConfig(model="m", device="cpu", fused_layers=True)
    fake_cuda_node(monkeypatch, flash_attn=False, triton=True)
    assert EngineConfig(model="m").fused_layers is True
    # Switchable, so a GPU run can time the torch formulation beside them.
    assert EngineConfig(model="m", fused_layers=False).fused_layers is False
