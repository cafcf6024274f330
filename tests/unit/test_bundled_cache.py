"""A bundled model's cache: the GGUF converted once and then read from the cache (also by
concurrent resolves), an incomplete, outdated or failed build rebuilt or left out, the dense
checkpoint written only on first use (once, and never half), and `specserve install-model`
writing dense weights only when asked."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest

from engine.models import bundled, packages
from tests.unit.bundled_fakes import (
    _fake_model,
    _forbid_conversion,
    _make_fake_packages,
)


def test_resolve_bundled_converts_once_then_uses_cache(
    fake_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_converter
):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF-head", b"-tail"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(bundled, "BUNDLED_MODELS", {model.name: model})

    out = bundled.resolve_model("Fake-Model", cache_dir=tmp_path)
    assert out == tmp_path / "models" / "fake-model"
    assert fake_converter == [(whole, (2,))]
    marker = json.loads((out / bundled.MARKER_NAME).read_text())
    assert marker["sha256"] == model.sha256 and marker["format"] == bundled.CACHE_FORMAT_VERSION
    # The assembled GGUF and the build directory are gone; only the lock and the model remain.
    assert sorted(p.name for p in out.parent.iterdir()) == [".fake-model.lock", "fake-model"]

    _forbid_conversion(monkeypatch)
    assert bundled.resolve_model("fake-model", cache_dir=tmp_path) == out


def test_incomplete_or_outdated_cache_is_rebuilt(
    fake_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_converter
):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF-v2"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    target = tmp_path / "models" / "fake-model"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"half": "written"}')  # no marker: a crashed build
    bundled._resolve_bundled(model, tmp_path)
    assert len(fake_converter) == 1 and (target / "config.json").read_text() == "{}"

    # A marker for another checksum (the pinned GGUF changed) does not count as complete either.
    marker = json.loads((target / bundled.MARKER_NAME).read_text())
    (target / bundled.MARKER_NAME).write_text(json.dumps({**marker, "sha256": "f" * 64}))
    bundled._resolve_bundled(model, tmp_path)
    assert len(fake_converter) == 2


def test_failed_build_leaves_no_cache(fake_site: Path, tmp_path: Path, monkeypatch):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())

    def broken(gguf_path: Path, out_dir: Path, eos_token_ids=None) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(bundled, "write_model_files", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        bundled._resolve_bundled(model, tmp_path)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".fake-model.lock"]


def test_concurrent_resolves_convert_once(fake_site: Path, tmp_path: Path, monkeypatch):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    num_calls = []

    def slow(gguf_path: Path, out_dir: Path, eos_token_ids=None) -> None:
        num_calls.append(1)
        time.sleep(0.3)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(bundled, "write_model_files", slow)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(bundled._resolve_bundled(model, tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(num_calls) == 1
    assert results == [tmp_path / "models" / "fake-model"] * 3


def test_a_version_2_cache_stays_valid_and_older_ones_are_rebuilt(
    fake_site: Path, tmp_path: Path, fake_converter
):
    """Version 2 directories always hold the dense checkpoint: still valid. Version 1 ones lack
    model.gguf: rebuilt."""
    parts, whole = _make_fake_packages(fake_site, [b"GGUF-v2"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    target = tmp_path / "models" / "fake-model"
    target.mkdir(parents=True)
    (target / bundled.DENSE_NAME).write_bytes(b"dense")
    marker = {"source": "bundled:fake-model", "sha256": model.sha256, "format": 2}
    (target / bundled.MARKER_NAME).write_text(json.dumps(marker))
    assert bundled._resolve_bundled(model, tmp_path) == target
    assert fake_converter == [] and (target / bundled.DENSE_NAME).read_bytes() == b"dense"

    (target / bundled.MARKER_NAME).write_text(json.dumps({**marker, "format": 1}))
    bundled._resolve_bundled(model, tmp_path)
    assert len(fake_converter) == 1 and not (target / bundled.DENSE_NAME).exists()
    written = json.loads((target / bundled.MARKER_NAME).read_text())
    assert written["format"] == bundled.CACHE_FORMAT_VERSION == 3


def test_the_dense_checkpoint_is_written_once_on_first_use(
    fake_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_converter
):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF-head", b"-tail"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(bundled, "BUNDLED_MODELS", {model.name: model})
    calls: list[bytes] = []

    def dequantize(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path.read_bytes())
        time.sleep(0.3)
        (out_dir / bundled.DENSE_NAME).write_bytes(b"dense")

    monkeypatch.setattr(bundled, "write_dense_checkpoint", dequantize)
    out = bundled.resolve_model("fake-model", cache_dir=tmp_path)
    assert (out / "model.gguf").read_bytes() == whole
    assert not bundled.has_dense_checkpoint(out) and calls == []  # a GGUF path needs none

    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                bundled.resolve_model("fake-model", cache_dir=tmp_path, dense=True)
            )
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [out] * 3 and calls == [whole]
    assert (out / bundled.DENSE_NAME).read_bytes() == b"dense"
    assert sorted(p.name for p in out.parent.iterdir()) == [".fake-model.lock", "fake-model"]
    marker = json.loads((out / bundled.MARKER_NAME).read_text())
    assert marker["format"] == bundled.CACHE_FORMAT_VERSION  # the directory stays complete
    _forbid_conversion(monkeypatch)
    assert bundled.resolve_model("fake-model", cache_dir=tmp_path, dense=True) == out


def test_a_failed_dense_conversion_leaves_no_checkpoint(
    fake_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_converter
):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    out = bundled._resolve_bundled(model, tmp_path)

    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / bundled.DENSE_NAME).write_bytes(b"half")
        raise RuntimeError("out of disk")

    monkeypatch.setattr(bundled, "write_dense_checkpoint", broken)
    with pytest.raises(RuntimeError, match="out of disk"):
        bundled.ensure_dense_checkpoint(out)
    assert not bundled.has_dense_checkpoint(out)
    assert sorted(p.name for p in out.parent.iterdir()) == [".fake-model.lock", "fake-model"]
    # A directory without a GGUF file is left alone: nothing to convert, no lock taken.
    plain = tmp_path / "elsewhere" / "plain"
    plain.mkdir(parents=True)
    (plain / "config.json").write_text("{}")
    bundled.ensure_dense_checkpoint(plain)
    assert [p.name for p in plain.parent.iterdir()] == ["plain"]
    assert [p.name for p in plain.iterdir()] == ["config.json"]


def test_install_model_writes_dense_weights_only_when_asked(
    fake_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_converter
):
    from server.cli import main

    parts, whole = _make_fake_packages(fake_site, [b"GGUF"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(bundled, "BUNDLED_MODELS", {model.name: model})
    monkeypatch.setattr(packages, "install_packages", lambda model: None)
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    calls: list[Path] = []

    def dequantize(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        (out_dir / bundled.DENSE_NAME).write_bytes(b"dense")

    monkeypatch.setattr(bundled, "write_dense_checkpoint", dequantize)
    assert main(["install-model", "fake-model", "--convert"]) == 0
    out = tmp_path / "cache" / "models" / "fake-model"
    assert len(fake_converter) == 1 and calls == [] and not bundled.has_dense_checkpoint(out)
    assert main(["install-model", "fake-model", "--dense"]) == 0
    assert len(fake_converter) == 1 and calls == [out / "model.gguf"]
    assert (out / bundled.DENSE_NAME).read_bytes() == b"dense"
