"""Fixtures several unit-test modules share (fakes over the helpers beside them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.bundled_fakes import install_fake_site, record_conversions
from tests.unit.cuda_graph_fakes import load_model_parts


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site-packages of fake bundled-model packages (tests/unit/bundled_fakes.py)."""
    return install_fake_site(tmp_path, monkeypatch)


@pytest.fixture
def fake_converter(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, tuple]]:
    """The GGUF conversions asked for, recorded instead of run."""
    return record_conversions(monkeypatch)


@pytest.fixture(scope="module")
def model_parts(tiny_llama):
    """The tiny Llama's loaded parts, for runners built around fake devices."""
    return load_model_parts(tiny_llama)
