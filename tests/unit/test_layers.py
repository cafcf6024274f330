"""The layers hold: no import circle in engine/, server/ or bench/ (an import under
TYPE_CHECKING or inside a function counts like any other), the ground floor imports nothing
above it, the scheduler knows the policy only through its interface, and no module outgrows
400 lines (the C++ kernels aside)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "bench")
# The data every stage passes on: the step's types (engine/core/) and the public data they are
# made of (a request's sampling options and outputs, the engine's request error).
GROUND_FLOOR = (
    "engine.core",
    "engine.sampling_params",
    "engine.outputs",
    "engine.errors",
    "engine.structured.spec",
)
MAX_LINES = 400


def _modules(package: str) -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = {name: path for package in PACKAGES for name, path in _modules(package).items()}


def _resolve(name: str) -> str | None:
    """The module of ours that `name` (a module, or a name inside one) is or lies in."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imports_of(module: str) -> set[str]:
    """Every module of ours that `module` imports, wherever the import statement sits."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(r for a in node.names if (r := _resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                target = _resolve(f"{base}.{alias.name}") or _resolve(base)
                if target:
                    found.add(target)
    found.discard(module)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_cycle_finder_finds_a_circle_hidden_in_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_an_import_inside_a_function_or_under_type_checking_is_an_edge(tmp_path, monkeypatch):
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from engine.engine import LLMEngine\n"
        "def f():\n    from engine.config import EngineConfig\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "engine.probe", path)
    assert {"engine.engine", "engine.config"} <= imports_of("engine.probe")


def test_no_import_circle():
    assert _cycles(GRAPH) == []


def _is_ground(module: str) -> bool:
    return any(module == g or module.startswith(g + ".") for g in GROUND_FLOOR)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _is_ground(m)))
def test_the_ground_floor_imports_nothing_above_it(module):
    above = sorted(m for m in GRAPH[module] if not _is_ground(m))
    assert above == [], f"{module} imports {above}"


def test_the_scheduler_sees_the_policy_only_through_its_interface():
    # It asks a DraftPolicy (its own protocol) with the ground floor's types: no policy module.
    for module in ("engine.scheduling.scheduler", "engine.scheduling.block_manager"):
        assert not {m for m in GRAPH[module] if m.startswith(("engine.policy", "engine.drafters"))}


def test_the_wings_do_not_import_each_other():
    # Drafters and policy meet only in the ground floor and in the engine that builds both.
    for module, imported in GRAPH.items():
        if module.startswith("engine.drafters"):
            assert not {m for m in imported if m.startswith("engine.policy")}, module
        if module.startswith("engine.policy"):
            assert not {m for m in imported if m.startswith("engine.drafters")}, module


@pytest.mark.parametrize("package", [*PACKAGES, "tests"])
def test_no_module_over_400_lines(package):
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def _sections(markdown: str) -> list[tuple[str, str]]:
    """(heading, body) of every section of a markdown page."""
    parts = re.split(r"^(#+ .*)$", markdown, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return len(body) <= 1 and all(isinstance(n, ast.Expr) for n in body)


@pytest.mark.parametrize("package", ["engine", "server"])
def test_the_architecture_page_names_every_module(package):
    """docs/architecture.md lists every module: by its path under the package (`core/request.py`)
    or, in a section headed with a folder above it (`### engine/models/`), by its path under that
    folder (`eagle3/head.py`). A package whose __init__.py holds only its docstring is named by
    its heading."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    sections = [
        (re.findall(r"(?:engine|server)/(?:\w+/)*", heading), body)
        for heading, body in _sections(page)
    ]
    missing = []
    for path in sorted((ROOT / package).rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if f"`{path.relative_to(ROOT / package).as_posix()}`" in page:
            continue
        folder = name.rpartition("/")[0] + "/"
        if path.name == "__init__.py" and _only_a_docstring(path):
            # Its package is named: a heading holds the folder, or a row holds a module in it.
            if any(folder in folders for folders, _ in sections) or any(
                folder.startswith(f) and f"`{folder[len(f) :]}" in body
                for folders, body in sections
                for f in folders
            ):
                continue
        elif any(
            name.startswith(f) and f"`{name[len(f) :]}`" in body
            for folders, body in sections
            for f in folders
        ):
            continue
        missing.append(name)
    assert missing == []
