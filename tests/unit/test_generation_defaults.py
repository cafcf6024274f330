"""A model's generation_config.json as sampling defaults: which keys count, do_sample: false,
and files whose values could not serve as a request's (each a ValueError naming the file)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from engine.models.generation_defaults import GenerationDefaults, load_generation_defaults


def _write(directory: Path, config: Any) -> Path:
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "generation_config.json").write_text(text)
    return directory


def test_no_file_no_defaults(tmp_path):
    assert load_generation_defaults(tmp_path) == GenerationDefaults()
    assert GenerationDefaults().given() == {}


def test_a_file_without_sampling_keys_gives_none(tmp_path):
    # What the bundled models' files hold.
    config = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "transformers_version": "5"}
    assert load_generation_defaults(_write(tmp_path, config)) == GenerationDefaults()


def test_the_sampling_keys_are_read_and_the_rest_ignored(tmp_path):
    config = {
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
        "max_new_tokens": 2048,
        "eos_token_id": [151645, 151643],
    }
    defaults = load_generation_defaults(_write(tmp_path, config))
    assert defaults == GenerationDefaults(0.7, 0.8, 20, 0.05, 1.05)
    assert defaults.given() == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
    }


def test_nulls_give_no_default_and_integers_are_numbers(tmp_path):
    defaults = load_generation_defaults(_write(tmp_path, {"temperature": 1, "top_p": None}))
    assert defaults == GenerationDefaults(temperature=1.0)
    assert isinstance(defaults.temperature, float)


@pytest.mark.parametrize(
    ("config", "temperature"),
    [
        ({"do_sample": False}, 0.0),  # Hugging Face's greedy
        ({"do_sample": False, "temperature": 0.6}, 0.6),  # a temperature stands
        ({"do_sample": True}, None),
        ({"do_sample": None}, None),
    ],
)
def test_do_sample_false_without_a_temperature_is_greedy(tmp_path, config, temperature):
    assert load_generation_defaults(_write(tmp_path, config)).temperature == temperature


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "0.7"),
        ("temperature", True),
        ("temperature", math.nan),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", 2.5),
        ("top_k", -2),
        ("top_k", True),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", 3),
    ],
)
def test_values_a_request_could_not_ask_for_are_refused(tmp_path, key, value):
    _write(tmp_path, {key: value})
    with pytest.raises(ValueError, match=rf"generation_config\.json: {key} must .*none\)$"):
        load_generation_defaults(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "[0.7]"])
def test_a_malformed_file_is_refused(tmp_path, text):
    with pytest.raises(ValueError, match=r"generation_config\.json: .*--generation-config none"):
        load_generation_defaults(_write(tmp_path, text))
