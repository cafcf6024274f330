"""The shipped configs/: each one is a GPU preset that resolves on a CUDA node only, or a CPU
config that resolves on CPU and on GPU."""

from __future__ import annotations

import pytest

from engine.models.bundled import BUNDLED_MODELS
from server.settings import load_settings
from tests.unit.deploy.helpers import CPU_CONFIGS, GPU_PRESETS, assert_gpu_preset
from tests.unit.test_config import cpu_node, fake_cuda_node


def test_configs_are_gpu_presets_or_cpu_configs():
    assert {p.name for p in GPU_PRESETS} >= {
        "gpu-qwen2.5-coder-1.5b.yaml",
        "gpu-qwen2.5-coder-7b.yaml",
        "gpu-llama3.1-8b.yaml",
    }
    assert {p.name for p in CPU_CONFIGS} >= {"default.yaml", "smollm2-cpu.yaml"}


@pytest.mark.parametrize("path", GPU_PRESETS, ids=lambda p: p.name)
def test_gpu_preset_resolves_on_a_cuda_node_only(path, monkeypatch):
    settings = load_settings(path, environ={})
    fake_cuda_node(monkeypatch)
    config = settings.engine_config()
    assert_gpu_preset(config)
    assert config.max_num_seqs >= 32 and config.max_num_batched_tokens >= 2048
    assert config.max_model_len is not None and config.max_model_len >= 8192
    draft = config.speculative_config.model
    header = path.read_text().split("\nengine:")[0]
    if config.model.startswith("/"):  # Hugging Face directories: the header says how to mount
        assert config.model.startswith("/models/") and draft.startswith("/models/")
        assert config.model in header and draft in header and ":/models:ro" in header
        assert settings.served_model_name, "clients should not have to send a path as `model`"
    else:
        assert {config.model, draft} <= set(BUNDLED_MODELS)
    # Anywhere flash-attn cannot run, the preset is refused when the config is built.
    cpu_node(monkeypatch)
    with pytest.raises(ValueError, match="flash_attn runs on cuda only, not cpu"):
        settings.engine_config()
    fake_cuda_node(monkeypatch, flash_attn=False)
    with pytest.raises(ValueError, match="flash_attn is not available"):
        settings.engine_config()


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=lambda p: p.name)
def test_cpu_config_resolves_on_cpu_and_on_gpu(path, monkeypatch):
    settings = load_settings(path, environ={})
    assert "block_size" not in settings.engine_kwargs(), "let the attention backend pick it"
    cpu_node(monkeypatch)
    config = settings.engine_config()
    assert (config.device, config.attention_backend, config.block_size) == ("cpu", "cpu", 16)
    fake_cuda_node(monkeypatch)  # never an impossible combination, whatever the node
    config = settings.engine_config()
    assert (config.device, config.attention_backend, config.block_size) == (
        "cuda",
        "flash_attn",
        256,
    )
