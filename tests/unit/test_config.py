"""EngineConfig resolves device, attention backend, block size and dtype together, once.

The GPU cases run on CPU: `fake_cuda_node` makes torch report a GPU and flash-attn importable,
which is all the resolution looks at (nothing here allocates on a device).
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from pathlib import Path

import pytest
import torch

import engine.attention
import engine.kernels
from engine.attention import BACKENDS, check_attention_backend
from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.speculative_config import SpeculativeConfig
from server.cli import build_parser, load_cli_settings
from server.settings import ENGINE_FIELDS, Settings, load_settings


def fake_cuda_node(
    monkeypatch: pytest.MonkeyPatch, *, flash_attn: bool = True, triton: bool = False
) -> None:
    """Make this process look like a CUDA node, with flash-attn installed when `flash_attn` and
    Triton when `triton` (whatever this machine has installed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine.attention, "flash_attn_available", lambda: flash_attn)
    monkeypatch.setattr(engine.attention, "triton_available", lambda: triton)


def cpu_node(monkeypatch: pytest.MonkeyPatch, *, kernels: bool = True) -> None:
    """Make this process look like a machine without a GPU (also on a GPU CI runner), where our
    CPU kernels build when `kernels`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(engine.kernels, "cpu_kernels", lambda: object() if kernels else None)


def _checkpoint(torch_dtype: str) -> ModelConfig:
    """A ModelConfig whose only field that matters here is the checkpoint's dtype."""
    return ModelConfig(
        path=Path("unused"),
        architecture="LlamaForCausalLM",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        torch_dtype=torch_dtype,
        eos_token_ids=(2,),
        hf_config=None,
    )


def _resolved(config: EngineConfig) -> tuple[str, str, int | None]:
    return config.device, config.attention_backend, config.block_size


# --- the registry -----------------------------------------------------------------------------


def test_backends_declare_their_constraints():
    from engine.attention.flash_attn import PAGE_SIZE_MULTIPLE

    torch_spec, flash = BACKENDS["torch"], BACKENDS["flash_attn"]
    assert torch_spec.supports_device("cpu") and torch_spec.supports_device("cuda")
    assert torch_spec.supports_dtype(torch.float32) and torch_spec.supports_block_size(1)
    assert torch_spec.default_block_size == 16
    assert flash.device_types == ("cuda",) and not flash.supports_device("cpu")
    assert flash.dtypes == ("bfloat16", "float16") and not flash.supports_dtype(torch.float32)
    # The registry and the kernel wrapper agree on flash-attn 2's page size rule.
    assert flash.block_size_multiple == PAGE_SIZE_MULTIPLE == 256
    assert flash.default_block_size == 256
    assert flash.supports_block_size(512) and not flash.supports_block_size(128)


def test_check_names_what_is_wrong_and_what_works(monkeypatch):
    fake_cuda_node(monkeypatch)
    ok = check_attention_backend("flash_attn", "cuda", {"dtype": torch.bfloat16}, 512)
    assert ok.name == "flash_attn"
    with pytest.raises(ValueError, match=r"multiple of 256, got 16; use block_size: 256"):
        check_attention_backend("flash_attn", "cuda", (), 16)
    with pytest.raises(ValueError, match=r"not dtype: float32; set dtype: bfloat16"):
        check_attention_backend("flash_attn", "cuda", {"dtype": torch.float32}, 256)
    with pytest.raises(ValueError, match=r"runs on cuda only, not cpu"):
        check_attention_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match=r"unknown attention backend 'xformers'"):
        check_attention_backend("xformers", "cuda")


# --- the resolution table ---------------------------------------------------------------------


def test_auto_on_cpu_is_cpu_with_16_token_pages(monkeypatch):
    cpu_node(monkeypatch)
    config = EngineConfig(model="m")
    assert _resolved(config) == ("cpu", "cpu", 16)
    assert config.torch_device() == torch.device("cpu")
    assert _resolved(EngineConfig(model="m", dtype="float32")) == ("cpu", "cpu", 16)


def test_auto_on_cpu_without_our_kernels_is_torch(monkeypatch):
    cpu_node(monkeypatch, kernels=False)
    assert _resolved(EngineConfig(model="m")) == ("cpu", "torch", 16)
    with pytest.raises(ValueError, match="attention backend cpu is not available here"):
        EngineConfig(model="m", attention_backend="cpu")


def test_cpu_backend_is_for_the_cpu_and_its_dtypes(monkeypatch):
    fake_cuda_node(monkeypatch)
    with pytest.raises(ValueError, match="runs on cpu only, not cuda"):
        EngineConfig(model="m", attention_backend="cpu")
    cpu_node(monkeypatch)
    with pytest.raises(ValueError, match="cpu supports dtype bfloat16 or float32, not dtype"):
        EngineConfig(model="m", attention_backend="cpu", dtype="float16")
    assert _resolved(EngineConfig(model="m", dtype="float16")) == ("cpu", "torch", 16)


def test_auto_on_cuda_with_flash_attn_is_flash_attn_with_256_token_pages(monkeypatch):
    fake_cuda_node(monkeypatch)
    config = EngineConfig(model="m")
    assert _resolved(config) == ("cuda", "flash_attn", 256)
    assert config.torch_device() == torch.device("cuda")


def test_auto_on_cuda_without_flash_attn_is_torch(monkeypatch):
    fake_cuda_node(monkeypatch, flash_attn=False)
    assert _resolved(EngineConfig(model="m")) == ("cuda", "torch", 16)


def test_explicit_device_is_kept(monkeypatch):
    fake_cuda_node(monkeypatch)
    config = EngineConfig(model="m", device="cuda:1")
    assert _resolved(config) == ("cuda:1", "flash_attn", 256)
    assert config.torch_device() == torch.device("cuda", 1)
    cpu_node(monkeypatch)
    assert _resolved(EngineConfig(model="m", device="cpu", block_size=4)) == ("cpu", "cpu", 4)
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig(model="m", device="gpu")


def test_flash_attn_refuses_16_token_pages(monkeypatch):
    fake_cuda_node(monkeypatch)
    with pytest.raises(ValueError, match="multiple of 256, got 16") as error:
        EngineConfig(model="m", attention_backend="flash_attn", block_size=16)
    assert "flash_attn" in str(error.value)
    config = EngineConfig(model="m", attention_backend="flash_attn", block_size=512)
    assert _resolved(config) == ("cuda", "flash_attn", 512)


def test_flash_attn_refuses_float32(monkeypatch):
    fake_cuda_node(monkeypatch)
    with pytest.raises(
        ValueError, match="flash_attn supports dtype bfloat16 or float16, not dtype: float32"
    ):
        EngineConfig(model="m", attention_backend="flash_attn", dtype="float32")
    assert (
        EngineConfig(model="m", attention_backend="flash_attn", dtype="float16").block_size == 256
    )


def test_flash_attn_on_cpu_is_an_error(monkeypatch):
    cpu_node(monkeypatch)
    with pytest.raises(ValueError, match="runs on cuda only, not cpu"):
        EngineConfig(model="m", attention_backend="flash_attn")
    fake_cuda_node(monkeypatch)  # a GPU node, but the config pins the CPU
    with pytest.raises(ValueError, match="runs on cuda only, not cpu"):
        EngineConfig(model="m", device="cpu", attention_backend="flash_attn")


def test_flash_attn_without_the_package_is_an_error(monkeypatch):
    fake_cuda_node(monkeypatch, flash_attn=False)
    with pytest.raises(ValueError, match="flash_attn is not available here"):
        EngineConfig(model="m", attention_backend="flash_attn")


def test_auto_falls_back_to_torch_for_what_flash_attn_refuses(monkeypatch, caplog):
    fake_cuda_node(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="engine.attention"):
        assert _resolved(EngineConfig(model="m", block_size=16)) == ("cuda", "torch", 16)
    assert "auto skips flash_attn" in caplog.text and "multiple of 256" in caplog.text
    assert EngineConfig(model="m", dtype="float32").attention_backend == "torch"


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa'"):
        EngineConfig(model="m", attention_backend="sdpa")


@pytest.mark.parametrize(
    ("node", "checkpoint", "expected"),
    [
        ("cuda", "float32", torch.bfloat16),  # flash_attn refuses float32: its preferred dtype
        ("cuda", "float16", torch.float16),
        ("cuda", "bfloat16", torch.bfloat16),
        ("cpu", "float32", torch.float32),
        ("cpu", "float16", torch.bfloat16),  # float16 is slow on CPU
    ],
)
def test_dtype_auto_picks_one_the_backend_accepts(monkeypatch, node, checkpoint, expected):
    if node == "cuda":
        fake_cuda_node(monkeypatch)
    else:
        cpu_node(monkeypatch)
    config = EngineConfig(model="m")
    assert config.attention_backend == ("flash_attn" if node == "cuda" else "cpu")
    dtype = config.torch_dtype(_checkpoint(checkpoint))
    assert dtype == expected
    assert BACKENDS[config.attention_backend].supports_dtype(dtype)


def test_explicit_dtype_is_kept(monkeypatch):
    cpu_node(monkeypatch)
    assert EngineConfig(model="m", dtype="float16").torch_dtype(_checkpoint("float32")) == (
        torch.float16
    )


def test_draft_dtype_is_checked_against_the_backend(monkeypatch):
    fake_cuda_node(monkeypatch)
    spec = {"method": "draft_model", "model": "d"}
    with pytest.raises(ValueError, match="not speculative_config.draft_dtype: float32"):
        EngineConfig(
            model="m",
            attention_backend="flash_attn",
            speculative_config=SpeculativeConfig(**spec, draft_dtype="float32"),
        )
    with pytest.raises(ValueError, match="draft_dtype must be one of"):
        EngineConfig(model="m", speculative_config=SpeculativeConfig(**spec, draft_dtype="fp8"))
    config = EngineConfig(
        model="m", speculative_config=SpeculativeConfig(**spec, draft_dtype="float16")
    )
    assert config.attention_backend == "flash_attn"
    cpu_node(monkeypatch)
    config = EngineConfig(
        model="m", speculative_config=SpeculativeConfig(**spec, draft_dtype="float32")
    )
    assert config.attention_backend == "cpu"
    config = EngineConfig(
        model="m", speculative_config=SpeculativeConfig(**spec, draft_dtype="float16")
    )
    assert config.attention_backend == "torch"  # the cpu backend has no float16 kernel


@pytest.mark.parametrize("value", [0.0, -0.5, 1.01, 2])
def test_gpu_memory_utilization_must_be_in_0_1(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(model="m", gpu_memory_utilization=value)


def test_valid_hardware_knobs_are_kept():
    config = EngineConfig(model="m", gpu_memory_utilization=1.0, enforce_eager=True)
    assert config.gpu_memory_utilization == 1.0 and config.enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        EngineConfig(model="m", enforce_eager="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        EngineConfig(model="m", block_size=0)


def test_resolution_is_stable_and_frozen(monkeypatch):
    fake_cuda_node(monkeypatch)
    config = EngineConfig(model="m", max_num_seqs=4)
    assert dataclasses.replace(config, max_num_seqs=8) == dataclasses.replace(
        EngineConfig(model="m"), max_num_seqs=8
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 16  # type: ignore[misc]


# --- settings and flags -----------------------------------------------------------------------


def test_engine_settings_are_engine_config_fields():
    fields = dataclasses.fields(EngineConfig)
    # Settings' first fields are EngineConfig's, in its order (and so in --help).
    assert tuple(Settings.model_fields)[: len(fields)] == tuple(f.name for f in fields)
    declared = typing.get_type_hints(EngineConfig, include_extras=True)
    for f in fields:
        info = Settings.model_fields[f.name]
        if f.default is dataclasses.MISSING:
            assert info.is_required(), f.name
        else:
            assert info.default == f.default, f.name
        _, declaration = typing.get_args(declared[f.name])
        assert info.description == declaration.description, f.name
        assert info.metadata == declaration.metadata, f.name  # the bounds


def test_every_setting_has_a_description():
    for name, info in Settings.model_fields.items():
        assert info.description, name


def _outside_the_bounds() -> list[tuple[str, float]]:
    """One value beyond each bound an engine field declares."""
    step = {"ge": -1, "gt": 0, "le": 1, "lt": 0}
    return [
        (name, getattr(bound, key) + offset)
        for name in ENGINE_FIELDS
        for bound in Settings.model_fields[name].metadata
        for key, offset in step.items()
        if hasattr(bound, key)
    ]


@pytest.mark.parametrize(("name", "value"), _outside_the_bounds())
def test_a_declared_bound_holds_for_the_engine_and_the_settings(name, value):
    with pytest.raises(ValueError, match=f"{name} must be"):
        EngineConfig(model="m", **{name: value})
    with pytest.raises(ValueError, match=name):
        load_settings(None, {"model": "m", name: value}, {})


def test_declared_choices_hold_for_the_engine_and_the_settings():
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float16, float32"):
        EngineConfig(model="m", dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        load_settings(None, {"model": "m", "dtype": "fp8"}, {})


def test_settings_round_trip_the_new_fields(tmp_path, monkeypatch):
    cpu_node(monkeypatch)
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  model: m\n  gpu_memory_utilization: 0.75\n  enforce_eager: true\n")
    settings = load_settings(path, environ={})
    kwargs = settings.engine_kwargs()
    assert "block_size" not in kwargs  # left out: the backend picks
    assert kwargs["gpu_memory_utilization"] == 0.75 and kwargs["enforce_eager"] is True
    config = settings.engine_config()
    assert (config.gpu_memory_utilization, config.enforce_eager) == (0.75, True)
    assert _resolved(config) == ("cpu", "cpu", 16)
    environ = {"SPECSERVE_ENFORCE_EAGER": "false", "SPECSERVE_BLOCK_SIZE": "32"}
    config = load_settings(path, environ=environ).engine_config()
    assert config.enforce_eager is False and config.block_size == 32


@pytest.mark.parametrize("value", ["0", "1.5", "-1"])
def test_settings_refuse_bad_gpu_memory_utilization(tmp_path, value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        load_settings(None, {"model": "m", "gpu_memory_utilization": value}, {})


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_flags(monkeypatch, command):
    cpu_node(monkeypatch)
    args = build_parser().parse_args(
        [command, "--model", "m", "--enforce-eager", "--gpu-memory-utilization", "0.8"]
    )
    config = load_cli_settings(args.config, args).engine_config()
    assert config.enforce_eager is True and config.gpu_memory_utilization == 0.8
    assert config.block_size == 16  # --block-size omitted: the torch backend's default
    args = build_parser().parse_args([command, "--model", "m", "--no-enforce-eager"])
    assert load_cli_settings(args.config, args).engine_config().enforce_eager is False
    fake_cuda_node(monkeypatch)
    args = build_parser().parse_args([command, "--model", "m"])
    assert _resolved(load_cli_settings(args.config, args).engine_config()) == (
        "cuda",
        "flash_attn",
        256,
    )


def test_cli_stops_on_an_impossible_combination(monkeypatch):
    cpu_node(monkeypatch)
    args = build_parser().parse_args(["serve", "--model", "m", "--attention-backend", "flash_attn"])
    with pytest.raises(SystemExit, match="specserve: attention backend flash_attn runs on cuda"):
        load_cli_settings(args.config, args)


def test_dtype_auto_is_float32_where_gguf_blocks_are_served(monkeypatch):
    cpu_node(monkeypatch)
    config = EngineConfig(model="m")
    assert config.torch_dtype(_checkpoint("bfloat16")) == torch.bfloat16
    assert config.torch_dtype(_checkpoint("bfloat16"), quantized=True) == torch.float32
    explicit = EngineConfig(model="m", dtype="bfloat16")
    assert explicit.torch_dtype(_checkpoint("float32"), quantized=True) == torch.bfloat16
