"""`make gpu-smoke ARGS=--quick` in its CPU dry run: no checks stage, and the bench's core
alone (tests/gpu/smoke/__main__.py)."""

from __future__ import annotations

import json

from tests.gpu.smoke.__main__ import DEVICE_ENV
from tests.gpu.smoke.__main__ import main as smoke
from tests.gpu.smoke.bench import CONCURRENCIES, MODES


def test_the_quick_form_runs_the_core_alone(tmp_path, monkeypatch, capsys):
    """--quick: no checks stage, the graphs engine (off and auto) and the torch formulation's."""
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    out = tmp_path / "smoke.json"
    status = smoke(["--dry-run", "--quick", "--duration", "0.25", "--out", str(out)])
    assert status == 0, capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["quick"] is True and "checks" not in result
    engines = result["bench"]["engines"]
    assert [len(e["points"]) for e in engines] == [len(MODES) * len(CONCURRENCIES), 2, 2]
    assert engines[1]["engine"]["speculation"] is None
    assert engines[2]["engine"]["overlap_scheduling"] is False
