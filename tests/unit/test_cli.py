"""The CLI's settings: YAML file first, flags over it, speculative config as JSON."""

from __future__ import annotations

import argparse
import json
import re
import textwrap

import pytest

from engine.config import EngineConfig
from engine.speculative_config import SpeculativeConfig
from server.cli import build_parser, load_engine_settings
from server.settings import ENGINE_FIELDS, FIELDS, Settings, load_settings


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
        SpeculativeConfig.parse(spec)
    with pytest.raises(SystemExit, match=message):  # the settings refuse it before any load
        load_engine_settings(None, _args(model="m", speculative_config=json.dumps(spec)))


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
    # EngineConfig's keyword arguments: the YAML's mapping parsed at this edge.
    assert settings.engine_kwargs()["speculative_config"] == SpeculativeConfig("ngram")
    assert "port" not in settings.engine_kwargs()


@pytest.mark.parametrize(
    ("yaml_text", "flags", "message"),
    [
        ("engine:\n  model: m\n  max_num_seqs: 0\n", {}, "max_num_seqs"),
        ("engine:\n  model: m\n  unknown_knob: 1\n", {}, "unknown_knob"),
        ("engines:\n  model: m\n", {}, "unknown sections"),
        ("engine:\n  model: m\n", {"port": "http"}, "port"),
        ("engine:\n  model: m\n", {"speculative_config": "{nope"}, "not valid JSON"),
        ("server:\n  tool_parser: mistral\n", {"model": "m"}, "tool_parser: .*hermes"),
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


# --- flags derived from the settings' declarations ---------------------------------------------

SERVE_FIELDS = tuple(name for name in FIELDS if name != "log_level")  # the top-level --log-level
GENERATE_FIELDS = tuple(name for name in ENGINE_FIELDS if name != "seed")  # --seed: sampling


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.mark.parametrize(
    ("command", "fields"), [("serve", SERVE_FIELDS), ("generate", GENERATE_FIELDS)]
)
def test_help_lists_every_flag_with_its_description(capsys, monkeypatch, command, fields):
    monkeypatch.setenv("COLUMNS", "100")  # argparse's layout follows the terminal's width
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    compact = "".join(text.split())  # argparse wraps lines, also after hyphens
    for name in fields:
        assert re.search(rf"^  {_flag(name)}[ ,\n]", text, re.MULTILINE), name
        assert "".join(Settings.model_fields[name].description.split()) in compact, name
    assert _undescribed(text) == []


def _undescribed(help_text: str) -> list[str]:
    """The options of a --help text that have no help: argparse starts it at column 24, on the
    option's line or, after a long option, on the next one."""
    lines = help_text.splitlines()
    missing = []
    for line, following in zip(lines, [*lines[1:], ""], strict=True):
        if line.startswith("  -"):
            beside = len(line) > 24 and line[22:24] == "  "
            below = following.startswith(" " * 24) and not following[24:25].isspace()
            if not (beside or below):
                missing.append(line.split()[0])
    return missing


def test_generate_takes_the_engine_fields():
    args = vars(build_parser().parse_args(["generate"]))
    assert set(args) & set(SERVE_FIELDS) == set(GENERATE_FIELDS)
    assert "sampling_seed" in args


def test_bool_settings_have_a_no_flag():
    bools = [name for name, info in Settings.model_fields.items() if info.annotation is bool]
    assert {"enable_prefix_caching", "enforce_eager", "speculation_stats"} <= set(bools)
    parser = build_parser()
    for name in bools:
        assert getattr(parser.parse_args(["serve", _flag(name)]), name) is True
        no_flag = "--no-" + _flag(name)[2:]
        assert getattr(parser.parse_args(["serve", no_flag]), name) is False
        # Not given: the YAML file, the environment or the default decides.
        assert getattr(parser.parse_args(["serve"]), name) is None


def test_numbers_are_converted_by_the_flag(capsys):
    args = build_parser().parse_args(
        ["serve", "--port", "9000", "--gpu-memory-utilization", "0.5", "--block-size", "32"]
    )
    assert (args.port, args.gpu_memory_utilization, args.block_size) == (9000, 0.5, 32)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-seqs", "abc"])
    assert "argument --max-num-seqs: invalid int value: 'abc'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--dtype", "fp8"])
    assert "argument --dtype: invalid choice: 'fp8'" in capsys.readouterr().err


def test_undescribed_finds_an_option_without_help():
    text = textwrap.dedent("""\
        options:
          -h, --help            show this help message and exit
          --prompt PROMPT
          --max-num-batched-tokens MAX_NUM_BATCHED_TOKENS
                                most tokens computed in one step
          --max-tokens MAX_TOKENS
        """)
    assert _undescribed(text) == ["--prompt", "--max-tokens"]


def test_generation_config_is_auto_or_none(capsys):
    assert load_settings(None, {"model": "m"}, {}).generation_config == "auto"
    environ = {"SPECSERVE_GENERATION_CONFIG": "none"}
    assert load_settings(None, {"model": "m"}, environ).generation_config == "none"
    args = build_parser().parse_args(["serve", "--generation-config", "none"])
    assert args.generation_config == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--generation-config", "off"])
    assert "argument --generation-config: invalid choice: 'off'" in capsys.readouterr().err


def test_the_engine_config_takes_a_parsed_speculative_config():
    # The edges parse a mapping (LLM(...), the server's settings); the engine sees only the type.
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(TypeError, match="must be a SpeculativeConfig or None, got dict"):
        EngineConfig(model="m", speculative_config=spec)  # type: ignore[arg-type]
    parsed = SpeculativeConfig.parse(spec)
    assert parsed == SpeculativeConfig("ngram", num_speculative_tokens=2)
    assert SpeculativeConfig.parse(parsed) is parsed and SpeculativeConfig.parse(None) is None
    with pytest.raises(ValueError, match="must be a mapping"):
        SpeculativeConfig.parse("ngram")  # type: ignore[arg-type]
    assert EngineConfig(model="m", speculative_config=parsed).speculative_config is parsed
