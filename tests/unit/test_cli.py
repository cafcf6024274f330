"""The CLI's settings: YAML file first, flags over it, speculative config as JSON."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from engine.spec.config import SpeculativeConfig
from server.cli import load_engine_settings
from server.settings import load_settings


def _args(**kwargs) -> argparse.Namespace:
    return argparse.Namespace(**kwargs)


def test_flags_override_yaml(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "engine:\n  model: some-model\n  max_num_seqs: 4\n  block_size: 32\n"
        "  speculative_config: {method: ngram, num_speculative_tokens: 2}\n"
    )
    settings = load_engine_settings(str(config), _args(max_num_seqs=8, model=None))
    assert settings["model"] == "some-model"
    assert settings["max_num_seqs"] == 8 and settings["block_size"] == 32
    engine_config = EngineConfig(**settings)
    assert engine_config.speculative_config == SpeculativeConfig("ngram", num_speculative_tokens=2)


def test_speculative_config_flag_is_json():
    settings = load_engine_settings(
        None,
        _args(model="m", speculative_config='{"method": "ngram+draft_model", "model": "d"}'),
    )
    spec = EngineConfig(**settings).speculative_config
    assert isinstance(spec, SpeculativeConfig) and spec.methods == ("ngram", "draft_model")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "medusa"}, "unknown speculative method"),
        ({"method": "draft_model"}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5}, "prompt_lookup_min"),
        ({"method": "ngram", "k": 3}, "unknown speculative_config keys"),
        ({"num_speculative_tokens": 3}, "needs 'method'"),
    ],
)
def test_bad_speculative_config(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", speculative_config=spec)


def test_no_model_is_an_error():
    with pytest.raises(SystemExit):
        load_engine_settings(None, _args())


def test_yaml_then_environment_then_flags(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "engine:\n  model: m\n  max_num_seqs: 4\n"
        "server:\n  port: 9000\n  api_key: from-yaml\n  max_queue: 7\n"
    )
    environ = {
        "SPECSERVE_PORT": "9001",
        "SPECSERVE_MAX_NUM_SEQS": "5",
        "SPECSERVE_CORS_ALLOW_ORIGINS": "http://a, http://b",
        "SPECSERVE_SPECULATIVE_CONFIG": '{"method": "ngram"}',
        "SPECSERVE_CACHE": "/not/a/setting",
    }
    settings = load_settings(config, {"port": "9002", "model": None}, environ)
    assert (settings.port, settings.max_num_seqs, settings.max_queue) == (9002, 5, 7)
    assert settings.api_key == "from-yaml" and settings.model_name == "m"
    assert settings.cors_allow_origins == ["http://a", "http://b"]
    assert settings.engine_kwargs()["speculative_config"] == {"method": "ngram"}
    assert "port" not in settings.engine_kwargs()


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("engine:\n  model: m\n  max_num_seqs: 0\n", {}, "max_num_seqs"),
        ("engine:\n  model: m\n  unknown_knob: 1\n", {}, "unknown_knob"),
        ("engines:\n  model: m\n", {}, "unknown sections"),
        ("engine:\n  model: m\n", {"port": "http"}, "port"),
        ("engine:\n  model: m\n", {"speculative_config": "{nope"}, "not valid JSON"),
        # A well-formed but invalid speculative_config fails here, before the server binds.
        ("engine:\n  model: m\n", {"speculative_config": '{"method": "x"}'}, "unknown spec"),
        (
            "engine:\n  model: m\n  speculative_config: {method: ngram, k: 3}\n",
            {},
            "unknown speculative_config keys",
        ),
    ],
)
def test_bad_settings_name_the_field(tmp_path, yaml_text, flags, message):
    config = tmp_path / "c.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ValueError, match=message):
        load_settings(config, flags, {})
