"""What the bundled-model tests share: fake bundled models whose parts are small files in fake
package directories, a fake site those packages count as installed in, a fake GGUF converter
that records its calls, and a guard that no conversion runs. tests/unit/conftest.py wraps
install_fake_site and record_conversions in the `fake_site` and `fake_converter` fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models import bundled, packages
from engine.models.packages import BundledModel, PackagePart


def _make_fake_packages(root: Path, blobs: list[bytes], prefix: str = "fake-model-part") -> tuple:
    """Write each blob as <root>/<module>/data/partNN.bin; return (parts, concatenation)."""
    parts = []
    for i, blob in enumerate(blobs, start=1):
        part = PackagePart(f"{prefix}{i}", "1.0", f"data/part{i:02d}.bin")
        path = root / part.module / part.relpath
        path.parent.mkdir(parents=True)
        path.write_bytes(blob)
        parts.append(part)
    return tuple(parts), b"".join(blobs)


def _fake_model(parts: tuple, sha256: str, name: str = "fake-model") -> BundledModel:
    return BundledModel(name, "a test model", parts, sha256, (2,))


def install_fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Packages installed (version 1.0) iff their module directory exists under the returned root."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.setattr(
        packages,
        "_installed_version",
        lambda pkg: "1.0" if (root / pkg.replace("-", "_")).is_dir() else None,
    )
    monkeypatch.setattr(
        packages,
        "_find_package_dir",
        lambda module: root / module if (root / module).is_dir() else None,
    )
    return root


def record_conversions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, tuple]]:
    """Replace the GGUF converter; record (gguf bytes, eos ids) of every call."""
    calls: list[tuple[bytes, tuple]] = []

    def convert(gguf_path: Path, out_dir: Path, eos_token_ids=None) -> None:
        calls.append((gguf_path.read_bytes(), tuple(eos_token_ids or ())))
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(bundled, "write_model_files", convert)
    return calls


def _no_convert(*args, **kwargs) -> None:
    raise AssertionError("the converter must not run for a cached model")


def _forbid_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled, "write_model_files", _no_convert)
    monkeypatch.setattr(bundled, "write_dense_checkpoint", _no_convert)
