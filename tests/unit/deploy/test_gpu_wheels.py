"""`make gpu-wheels`' requirement list (deploy/gpu_wheels.py), without the network: the closure
walked over fake metadata and over this venv's, and the size check."""

from __future__ import annotations

import importlib.util
import sys

from tests.unit.deploy.helpers import DEPLOY


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_wheels", DEPLOY / "gpu_wheels.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_wheels = _load_script()

FAKE = {
    "fastapi": gpu_wheels.Installed(
        "0.165.0",
        (
            "starlette>=1.6",
            "pydantic>=2.9",
            "typing-extensions>=4.8",
            "uvloop; extra == 'standard'",  # an extra: not walked
        ),
    ),
    "starlette": gpu_wheels.Installed("1.10.0", ("anyio<5,>=4", "typing-extensions>=4.10")),
    "pydantic": gpu_wheels.Installed(
        "2.14.4", ("pydantic-core==2.50.5", "typing-extensions>=4.16")
    ),
    "pydantic-core": gpu_wheels.Installed("2.50.5", ("typing-extensions>=4.14",)),
    "uvicorn": gpu_wheels.Installed(
        "0.54.0",
        ("click>=7", "h11>=0.8", "typing-extensions>=4; python_version < '3.11'"),
    ),
    "h11": gpu_wheels.Installed("0.16.0", ()),
    "xgrammar": gpu_wheels.Installed(
        "0.2.8",
        (
            "apache-tvm-ffi>=0.1.11",
            "torch>=1.10",
            "triton; platform_system == 'Linux' and platform_machine == 'x86_64'",
            "mlx-lm; sys_platform == 'darwin'",  # not on the Linux target
        ),
    ),
    "typing-extensions": gpu_wheels.Installed("4.16.0", ()),
    "torch": gpu_wheels.Installed("2.13.0", ("nvidia-cublas; platform_system == 'Linux'",)),
}
IMAGE = {"torch", "triton", "anyio", "click", "typing-extensions", "nvidia-cublas"}


def test_closure_walks_requirements_the_image_lacks():
    found = gpu_wheels.closure(
        ["fastapi>=0.110", "uvicorn>=0.29", "xgrammar>=0.2.8", "torch>=2.4"],
        IMAGE,
        FAKE.get,
    )
    assert found == {
        "apache-tvm-ffi": None,  # not installed here: carried unpinned
        "fastapi": "0.165.0",
        "h11": "0.16.0",
        "pydantic": "2.14.4",
        "pydantic-core": "2.50.5",  # a requirement of a requirement
        "starlette": "1.10.0",
        "uvicorn": "0.54.0",
        "xgrammar": "0.2.8",
    }
    # The image brings torch with its own dependencies; extras and other platforms' needs stay.
    assert gpu_wheels.pins(found)[:2] == ["apache-tvm-ffi", "fastapi==0.165.0"]


def test_carried_anyway_means_carried_but_not_walked():
    found = gpu_wheels.closure(["pydantic"], IMAGE, FAKE.get, carried=["Typing_Extensions"])
    assert found == {
        "pydantic": "2.14.4",
        "pydantic-core": "2.50.5",
        "typing-extensions": "4.16.0",
    }


def test_the_projects_closure_against_the_image_list():
    """This venv's metadata, the real pyproject and image list: the serving stack travels, what
    the image has (torch, transformers and theirs) does not."""
    image = gpu_wheels.image_packages()
    assert {"torch", "transformers", "triton", "nvidia-ml-py", "typing-extensions"} <= image
    roots = gpu_wheels.project_roots()
    assert any(r.startswith("fastapi") for r in roots) and "openai" in roots
    found = gpu_wheels.closure(roots, image, gpu_wheels.installed_lookup, gpu_wheels.CARRIED_ANYWAY)
    assert {"fastapi", "uvicorn", "pydantic", "pydantic-core", "xgrammar", "gguf", "openai"} <= set(
        found
    )
    assert not {"torch", "transformers", "numpy", "safetensors", "tokenizers"} & set(found)
    assert all(found[name] for name in ("fastapi", "pydantic", "xgrammar")), found


def test_size_check_counts_the_tree_beside_the_wheels():
    mib = 2**20
    assert gpu_wheels.check_size(11 * mib, 7 * mib) is None
    problem = gpu_wheels.check_size(60 * mib, 7 * mib)
    assert problem is not None and "60.0 MiB + working tree 7.0 MiB > 64 MiB" in problem
    assert gpu_wheels.travelling_bytes() > 0


def test_markers_are_judged_for_the_machine_not_this_host():
    env = gpu_wheels.target_environment()
    assert (env["python_version"], env["platform_machine"]) == ("3.12", "x86_64")
    found = gpu_wheels.closure(["tomli; python_version < '3.11'", "h11"], set(), FAKE.get)
    assert found == {"h11": "0.16.0"}


def test_the_smollm2_tokenizer_travels_without_its_weights(tmp_path):
    """The bundled SmolLM2 package (93 MB with weights) cannot travel to a GPU node (64 MiB a
    call); its tokenizer, chat template and configs do, and nothing else."""
    source = tmp_path / "smollm2"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        (source / name).write_text("{}")
    for name in ("model.safetensors", "model.gguf", ".specserve-complete"):
        (source / name).write_bytes(b"\0" * 64)
    dest = tmp_path / ".gpu-wheels" / gpu_wheels.TOKENIZER_FOLDER
    assert gpu_wheels.copy_tokenizer(dest, source) == 4
    assert sorted(p.name for p in dest.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    (source / "tokenizer.json").unlink()
    assert gpu_wheels.copy_tokenizer(tmp_path / "none", source) == 0  # no tokenizer: nothing
    assert not (tmp_path / "none").exists()
