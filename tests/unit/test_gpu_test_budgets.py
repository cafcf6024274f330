"""Every engine the GPU-node checks build names its KV size (issue 33, F1).

Without `num_kv_blocks` (or `kv_cache_memory`) an engine on CUDA sizes its KV cache to
`gpu_memory_utilization` (0.9) of the card less what is in use, so the first engine of a test
takes nearly all of it and a second one, alive beside it, cannot hold one block. A share
(`gpu_memory_utilization`) does not help: it is of the whole card, so two engines with the same
share still overlap. This reads tests/gpu/ and fails on an engine built without a size.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from tests.gpu.node import FLASH_BF16, TORCH_FP32

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"
# What builds an engine: the offline LLM, the engine itself, the server's settings.
ENGINE_BUILDERS = {"LLM", "LLMEngine", "AsyncEngine", "EngineConfig", "Settings"}
SIZES = {"num_kv_blocks", "kv_cache_memory"}
SIZED_HELPER = "engine_kwargs"  # tests.gpu.node.Setup.engine_kwargs, which sets num_kv_blocks


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _is_sized_helper(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _callee(node) == SIZED_HELPER


def _sized_names(func: ast.AST) -> set[str]:
    """Names a function assigns from `engine_kwargs(...)` (`kwargs = setup.engine_kwargs(d)`)."""
    names = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and _is_sized_helper(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_sized(call: ast.Call, sized_names: set[str]) -> bool:
    for kw in call.keywords:
        if kw.arg in SIZES:
            return True
        if kw.arg is None:  # **mapping
            if _is_sized_helper(kw.value):
                return True
            if isinstance(kw.value, ast.Name) and kw.value.id in sized_names:
                return True
    return False


def unsized_engines(source: str, filename: str) -> list[str]:
    """`file:line` of every engine construction in `source` that does not size its KV cache."""
    tree = ast.parse(source, filename)
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _callee(node) in ENGINE_BUILDERS):
            continue
        enclosing = [s for s in scopes if s.lineno <= node.lineno <= (s.end_lineno or 0)]
        sized_names = set().union(*(_sized_names(s) for s in enclosing)) if enclosing else set()
        if not _is_sized(node, sized_names):
            found.append(f"{filename}:{node.lineno}")
    return found


def test_every_gpu_test_engine_sizes_its_kv_cache():
    files = sorted(GPU_TESTS.glob("*.py"))
    assert any(f.name == "test_cuda_graphs.py" for f in files)
    unsized = [
        where for f in files for where in unsized_engines(f.read_text(), f"tests/gpu/{f.name}")
    ]
    assert unsized == [], f"engines built without num_kv_blocks/kv_cache_memory: {unsized}"


def test_the_sized_helper_sets_a_small_kv_pool():
    for setup in (TORCH_FP32, FLASH_BF16):
        kwargs = setup.engine_kwargs(torch.device("cpu"), enforce_eager=True)
        assert 0 < kwargs["num_kv_blocks"] * kwargs["block_size"] <= 16384


def test_the_check_catches_an_unsized_engine():
    unsized = """
def _llm(model, **kwargs):
    return LLM(str(model), dtype="bfloat16", device="cuda", **kwargs)

def sized(model, setup, device):
    kwargs = setup.engine_kwargs(device)
    a = LLM(str(model), **kwargs)
    b = LLM(str(model), **setup.engine_kwargs(device), seed=1)
    c = LLM(str(model), num_kv_blocks=4)
    return Settings(model=str(model), gpu_memory_utilization=0.3)
"""
    assert unsized_engines(unsized, "x.py") == ["x.py:3", "x.py:10"]
