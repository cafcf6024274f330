"""The CLI's settings: YAML file first, flags over it, speculative config as JSON."""

from __future__ import annotations

import argparse

import pytest

from engine.config import EngineConfig
from engine.spec.config import SpeculativeConfig
from server.cli import load_engine_settings


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
