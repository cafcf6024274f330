"""The GPU image's pins hold: every pip install of the Dockerfile takes the constraints file the
stage copied, the constraints pin torch, flash-attn and transformers exactly, torch and flash-attn
as the Dockerfile's ARGs say, and transformers at the major pyproject.toml supports, which is the
major CPU CI runs."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import tomllib
from pathlib import PurePosixPath

from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit.deploy.helpers import ROOT, dockerfile_settings, dockerfile_stages

DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "deploy" / "constraints-gpu.txt"
PINNED = ("torch", "flash-attn", "transformers")


def constraint_pins(text: str) -> dict[str, str]:
    """name -> version of every `name==version` line (comments and blank lines skipped)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", f"not an exact pin: {line}"
            pins[requirement.name] = specifier.version
    return pins


def pip_installs(stage: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(the stage's WORKDIR then, the arguments) of every `pip install` of its RUNs."""
    found, workdir = [], "/"
    for keyword, args in stage:
        if keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / args)
        if keyword == "RUN":
            for command in re.split(r"&&|;", args):
                words = shlex.split(command)
                if words[:2] == ["pip", "install"]:
                    found.append((workdir, words[2:]))
    return found


def copied_constraints(stage: list[tuple[str, str]]) -> set[str]:
    """Absolute paths where the stage put deploy/constraints-gpu.txt."""
    paths, workdir = set(), "/"
    for keyword, args in stage:
        if keyword == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / args)
        if keyword == "COPY" and not args.startswith("--from"):
            *sources, dest = args.split()
            if "deploy/constraints-gpu.txt" in sources:
                target = PurePosixPath(workdir) / dest
                paths.add(str(target / CONSTRAINTS.name if dest.endswith("/") else target))
    return paths


def constraint_paths(workdir: str, args: list[str]) -> list[str]:
    """The constraints files one pip install names with -c / --constraint, made absolute."""
    paths = []
    for i, arg in enumerate(args):
        if arg in ("-c", "--constraint"):
            paths.append(str(PurePosixPath(workdir) / args[i + 1]))
        elif arg.startswith("--constraint="):
            paths.append(str(PurePosixPath(workdir) / arg.split("=", 1)[1]))
    return paths


def test_every_pip_install_of_the_gpu_image_takes_the_constraints():
    installs = 0
    for stage in dockerfile_stages(DOCKERFILE):
        copied = copied_constraints(stage)
        for workdir, args in pip_installs(stage):
            installs += 1
            paths = constraint_paths(workdir, args)
            assert paths and set(paths) <= copied, f"pip install {' '.join(args)}: -c {paths}"
    assert installs >= 3  # torch, flash-attn, the project (and the test stage's extra)


def test_constraints_pin_what_the_dockerfile_installs():
    pins = constraint_pins(CONSTRAINTS.read_text())
    assert set(PINNED) <= set(pins), pins
    args = dockerfile_settings(DOCKERFILE, "ARG")
    assert pins["torch"] == args["TORCH_VERSION"]
    wheel = re.search(r"/flash_attn-([^+]+)\+", args["FLASH_ATTN_WHEEL"])
    assert wheel and pins["flash-attn"] == wheel.group(1)


def test_transformers_major_agrees_between_pyproject_ci_and_image():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = (
        Requirement(r) for r in pyproject["dependencies"] if Requirement(r).name == "transformers"
    )
    image = Version(constraint_pins(CONSTRAINTS.read_text())["transformers"])
    ci = Version(importlib.metadata.version("transformers"))
    assert image.major == ci.major, "CPU CI and the GPU image run different transformers majors"
    # pyproject states one major: the image's is in its range, the ones beside it are not.
    assert requirement.specifier.contains(image)
    assert not requirement.specifier.contains(f"{image.major - 1}.99")
    assert not requirement.specifier.contains(f"{image.major + 1}.0")


def test_pins_parser_refuses_a_range():
    assert constraint_pins("torch==2.8.0  # why\n\nflash-attn==2.8.3") == {
        "torch": "2.8.0",
        "flash-attn": "2.8.3",
    }
    try:
        constraint_pins("transformers>=5")
    except AssertionError as e:
        assert "not an exact pin" in str(e)
    else:
        raise AssertionError("a range passed as a pin")
