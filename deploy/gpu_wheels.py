"""`make gpu-wheels`: the folder of wheels a bare GPU machine needs to run `make gpu-smoke`.

The check machines have torch, triton and transformers but none of the project's serving
dependencies (fastapi, pydantic, xgrammar, gguf, ...) and no network. This script works out
which distributions to carry: the project's runtime requirements (pyproject.toml) and those the
GPU checks import, with every requirement of theirs, minus what the machine's image already has
(deploy/gpu_image_packages.txt). An image package ends the walk: the image brings its own
dependencies. Versions are those of this venv, which CI tests (read from the installed metadata,
no network); a distribution not installed here is left unpinned. Then `pip download --no-deps`
fetches each for CPython 3.12 on manylinux x86_64 into `.gpu-wheels/` (git-ignored), with a
requirements.txt beside them, and the folder is checked to fit what travels with a device call:
64 MiB together with the working tree.

The bundled SmolLM2 package (93 MB with its weights) cannot travel; its tokenizer files (3.5 MB)
go to `.gpu-wheels/smollm2-tokenizer/`, where the GPU checks that serve a tiny model over
SmolLM2's vocabulary (the HTTP server, structured outputs) find them (SPECSERVE_SMOLLM2_TOKENIZER,
set by the smoke).

    python deploy/gpu_wheels.py [--dest .gpu-wheels] [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
TRAVEL_LIMIT = 64 * 2**20  # the working tree and carried paths of one device call
# What tests/gpu imports beyond the runtime requirements (the test extra has much more).
CHECK_REQUIREMENTS = ("openai", "jsonschema")
# In the image, but our pins need newer than it may have: pydantic 2.14 needs typing-extensions
# >= 4.16. Tiny and backward compatible, so carried rather than hoped for.
CARRIED_ANYWAY = ("typing-extensions",)
TARGET_PYTHON = "3.12"
PLATFORMS = (  # pip matches a manylinux tag exactly: the ones wheels of our closure use
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

logger = logging.getLogger("gpu-wheels")


@dataclass(frozen=True)
class Installed:
    """What the closure needs of an installed distribution: its version and requirements."""

    version: str
    requires: tuple[str, ...]


Lookup = Callable[[str], Installed | None]


def normalize(name: str) -> str:
    """PEP 503's normal form: 'Typing_Extensions' -> 'typing-extensions'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_environment() -> dict[str, str]:
    """Marker values of the GPU machine: CPython 3.12 on Linux x86_64."""
    env = {str(k): str(v) for k, v in default_environment().items()}
    env.update(
        python_version=TARGET_PYTHON,
        python_full_version=f"{TARGET_PYTHON}.0",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def closure(
    roots: Iterable[str], image: set[str], lookup: Lookup, carried: Iterable[str] = ()
) -> dict[str, str | None]:
    """name -> version (None: unpinned) of every distribution to carry: `roots` and their
    requirements, transitively, that apply on the target (markers; no extras) and that the
    image lacks; `carried` names are carried even though the image has them."""
    env = target_environment()
    carried_names = {normalize(c) for c in carried}
    found: dict[str, str | None] = {}
    pending = [*roots, *carried]
    while pending:
        requirement = Requirement(pending.pop())
        if requirement.marker is not None and not requirement.marker.evaluate({**env, "extra": ""}):
            continue
        name = normalize(requirement.name)
        if name in found or (name in image and name not in carried_names):
            continue
        installed = lookup(name)
        found[name] = installed.version if installed else None
        if installed is not None and name not in carried_names:
            pending.extend(installed.requires)
    return dict(sorted(found.items()))


def installed_lookup(name: str) -> Installed | None:
    """This venv's installed distribution of that name."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Installed(dist.version, tuple(dist.requires or ()))


def project_roots(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's runtime requirements and the GPU checks' own."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return [*project["dependencies"], *CHECK_REQUIREMENTS]


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line and not line.startswith("#")}


def pins(found: dict[str, str | None]) -> list[str]:
    """pip requirement lines: name==version, or the bare name where unpinned."""
    return [f"{name}=={version}" if version else name for name, version in found.items()]


def download(requirements: list[str], dest: Path) -> None:
    """Each requirement's wheel for the target, no dependencies (the closure is complete)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms,
        "--dest", str(dest), *requirements,
    ]  # fmt: skip
    subprocess.run(command, check=True)


def travelling_bytes(root: Path = ROOT) -> int:
    """Bytes of what a device call sends besides carried paths: tracked files and untracked ones
    git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    paths = (root / p for p in listed.decode().split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file())


def check_size(wheel_bytes: int, tree_bytes: int, limit: int = TRAVEL_LIMIT) -> str | None:
    """Why the folder cannot travel, or None when it fits."""
    if wheel_bytes + tree_bytes <= limit:
        return None
    return (
        f"wheels {wheel_bytes / 2**20:.1f} MiB + working tree {tree_bytes / 2**20:.1f} MiB > "
        f"{limit / 2**20:.0f} MiB that one device call carries"
    )


TOKENIZER_FOLDER = "smollm2-tokenizer"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def copy_tokenizer(dest: Path, source: Path | None = None) -> int:
    """Copy the bundled SmolLM2's files but its weights (tokenizer, chat template, configs) from
    `source`, else from where the bundled model resolves here, into `dest`; how many were
    copied (0: SmolLM2 is not installed here)."""
    import shutil

    if source is None:
        sys.path.insert(0, str(ROOT))
        try:
            from engine.models.bundled import resolve_model

            source = Path(resolve_model("smollm2-135m-instruct"))
        except Exception:
            return 0
    if not (source / "tokenizer.json").is_file():
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    names = [
        f.name
        for f in sorted(source.iterdir())
        if f.is_file() and not f.name.startswith(".") and f.suffix not in WEIGHT_SUFFIXES
    ]
    for name in names:
        shutil.copy(source / name, dest / name)
    return len(names)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--dry-run", action="store_true", help="print the list, download nothing")
    args = parser.parse_args(argv)
    requirements = pins(
        closure(project_roots(), image_packages(), installed_lookup, CARRIED_ANYWAY)
    )
    logger.info("%d distributions to carry: %s", len(requirements), " ".join(requirements))
    if args.dry_run:
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):  # one version of each: two stop the install
        old.unlink()
    download(requirements, args.dest)
    (args.dest / "requirements.txt").write_text("\n".join(requirements) + "\n")
    copied = copy_tokenizer(args.dest / TOKENIZER_FOLDER)
    logger.info("SmolLM2 tokenizer: %s", f"{copied} files" if copied else "not installed here")
    wheel_bytes = sum(f.stat().st_size for f in args.dest.rglob("*") if f.is_file())
    tree_bytes = travelling_bytes()
    logger.info(
        "%s: %.1f MiB of wheels; the working tree %.1f MiB",
        args.dest,
        wheel_bytes / 2**20,
        tree_bytes / 2**20,
    )
    problem = check_size(wheel_bytes, tree_bytes)
    if problem:
        logger.error("too big: %s", problem)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
