"""Model resolution of what is not a bundled name: a Hugging Face directory returned as is (one
without config.json refused), an unknown name or a missing GGUF file refused, and the cache
root's precedence (argument, $SPECSERVE_CACHE, ~/.cache/specserve)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models import bundled
from tests.unit.bundled_fakes import _forbid_conversion


def test_hf_directory_is_returned_as_is(tmp_path: Path, monkeypatch):
    _forbid_conversion(monkeypatch)
    (tmp_path / "config.json").write_text("{}")
    assert bundled.resolve_model(str(tmp_path)) == tmp_path
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        bundled.resolve_model(str(empty))


def test_unknown_name_and_missing_gguf_raise(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown model 'HuggingFaceTB/SmolLM2-135M'") as info:
        bundled.resolve_model("HuggingFaceTB/SmolLM2-135M", cache_dir=tmp_path)
    assert "smollm2-135m-instruct" in str(info.value)
    with pytest.raises(ValueError, match="does not exist"):
        bundled.resolve_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)


def test_cache_root_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "env"))
    assert bundled.cache_root() == tmp_path / "env"
    assert bundled.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("SPECSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bundled.cache_root() == tmp_path / ".cache" / "specserve"
