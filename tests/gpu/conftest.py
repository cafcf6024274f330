"""Fixtures of the GPU-node checks and the one summary `make gpu-test` ends with.

Every test here is marked `gpu` and skips without CUDA (see `tests.gpu.node` for the device
override). A test names the summary line it counts towards with `@pytest.mark.gpu_check(name)`
(default: its module's name); figures worth reading but never asserted on (decode speed) go
through the `gpu_record` fixture. The summary block prints once some gpu test has run.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.conftest import build_tiny_model
from tests.gpu.node import DEVICE_ENV, requested_device

CHECK_MARKER = "gpu_check"
_HERE = Path(__file__).parent
# The summary lists the checks of these modules first, in this order, then the others'.
_SUMMARY_ORDER = ("test_gpu_parity", "test_gpu_engine", "test_gpu_server", "test_gpu_bench")


@dataclass
class NodeReport:
    """What the summary prints: each test's check and outcome, and the recorded figures."""

    check_of: dict[str, str] = field(default_factory=dict)  # nodeid -> check
    rank: dict[str, tuple[int, str, int]] = field(default_factory=dict)  # check -> summary place
    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)  # nodeid -> (outcome, why)
    figures: dict[str, str] = field(default_factory=dict)

    def record(self, name: str, value: str) -> None:
        self.figures[name] = value

    def note(self, report: pytest.TestReport) -> None:
        """Fold one phase's report in: failed beats passed beats skipped."""
        previous = self.outcomes.get(report.nodeid, ("", ""))[0]
        if report.failed:
            self.outcomes[report.nodeid] = ("failed", report.when)
        elif previous == "failed":
            return
        elif report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.outcomes[report.nodeid] = ("skipped", reason.removeprefix("Skipped: "))
        elif report.when == "call" and report.passed:
            self.outcomes[report.nodeid] = ("passed", "")


_REPORT = pytest.StashKey[NodeReport]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{CHECK_MARKER}(name): the line of the GPU-node summary a test counts towards"
    )
    config.stash[_REPORT] = NodeReport()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    report = config.stash[_REPORT]
    for item in items:
        if _HERE not in item.path.parents or item.get_closest_marker("gpu") is None:
            continue
        marker = item.get_closest_marker(CHECK_MARKER)
        default = item.path.stem.removeprefix("test_").replace("_", " ")
        check = marker.args[0] if marker else default
        report.check_of[item.nodeid] = check
        module = item.path.stem
        place = _SUMMARY_ORDER.index(module) if module in _SUMMARY_ORDER else len(_SUMMARY_ORDER)
        rank = (place, module, item.location[1] or 0)
        report.rank[check] = min(report.rank.get(check, rank), rank)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    node = item.config.stash[_REPORT]
    if item.nodeid in node.check_of:
        node.note(report)
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    report = config.stash.get(_REPORT, None)
    if report is None or all(o == "skipped" for o, _ in report.outcomes.values()):
        return  # no GPU here and no dry run asked for: nothing to report
    write = terminalreporter.write_line
    terminalreporter.write_sep("=", "specserve GPU node")
    for line in _environment_lines():
        write(line)
    checks: dict[str, list[tuple[str, str]]] = {}
    for nodeid, check in report.check_of.items():
        if nodeid in report.outcomes:
            checks.setdefault(check, []).append(report.outcomes[nodeid])
    statuses = []
    for check, outcomes in sorted(checks.items(), key=lambda c: report.rank[c[0]]):
        status, line = _check_line(check, outcomes)
        statuses.append(status)
        write(line)
    if report.figures:
        write("recorded (not asserted):")
        width = max(len(name) for name in report.figures)
        for name, value in report.figures.items():
            write(f"  {name:<{width}}  {value}")
    words = {"PASS": "passed", "FAIL": "failed", "SKIP": "skipped"}
    counts = ", ".join(f"{statuses.count(s)} {word}" for s, word in words.items())
    # A module that failed to import has no check line; pytest's exit status still says so.
    verdict = "FAIL" if "FAIL" in statuses or exitstatus != 0 else "PASS"
    write(f"node: {verdict} (checks: {counts}; pytest exit status {exitstatus})", bold=True)


def _check_line(check: str, outcomes: list[tuple[str, str]]) -> tuple[str, str]:
    """The check's status (PASS, FAIL or SKIP) and its summary line."""
    counts = {o: sum(1 for x, _ in outcomes if x == o) for o in ("passed", "failed", "skipped")}
    if counts["failed"]:
        status = "FAIL"
    elif counts["passed"]:
        status = "PASS"
    else:
        status = "SKIP"
    detail = f"{counts['passed']}/{len(outcomes)} passed"
    if counts["failed"]:
        detail += f", {counts['failed']} failed"
    if counts["skipped"]:
        reason = next(why for o, why in outcomes if o == "skipped")
        detail += f", {counts['skipped']} skipped ({reason})"
    return status, f"{status:<5} {check:<48} {detail}"


def _environment_lines() -> list[str]:
    name = requested_device()
    if name is not None and name.startswith("cuda") and torch.cuda.is_available():
        device = torch.device(name)
        props = torch.cuda.get_device_properties(device)
        described = (
            f"{props.name} ({device}, compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB)"
        )
    elif name is not None and name.startswith("cuda"):
        described = f"{name} requested, but torch sees no CUDA device"
    else:
        described = f"{name} (a dry run: {DEVICE_ENV}={name})"
    try:
        flash = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        flash = "not installed"
    return [
        f"device      {described}",
        f"versions    torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
        f"flash-attn {flash}",
    ]


# --------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The one device every GPU-node check runs on."""
    name = requested_device()
    if name is None:
        pytest.skip(f"needs CUDA (or {DEVICE_ENV}=cpu for a CPU dry run)")
    chosen = torch.device(name)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"{DEVICE_ENV}={name}, but torch {torch.__version__} sees no CUDA device")
    return chosen


@pytest.fixture(scope="session")
def gpu_record(pytestconfig: pytest.Config) -> Callable[[str, str], None]:
    """`gpu_record(name, value)`: a figure for the summary (never asserted on)."""
    return pytestconfig.stash[_REPORT].record


# head_dim 64 (as real models have; flash-attn's kernels are instantiated per head size), GQA 2:1.
_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def gpu_target(device, tmp_path_factory) -> Path:
    """The target: a tiny random-weight Llama (2 layers, head_dim 64)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("gpu-target"),
        "llama",
        seed=21,
        max_position_embeddings=1024,
        **_SHAPE,
    )


@pytest.fixture(scope="session")
def gpu_qwen2(device, tmp_path_factory) -> Path:
    """Qwen2 with tied embeddings and q/k/v biases: the loader's other branch."""
    return build_tiny_model(
        tmp_path_factory.mktemp("gpu-qwen2"),
        "qwen2",
        seed=22,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        **_SHAPE,
    )


@pytest.fixture(scope="session")
def gpu_draft(gpu_target, tmp_path_factory) -> Path:
    """The target cut to its first layer: it agrees with the target on some tokens and not on
    others, so windows are accepted in part (a random draft would be rejected at every token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpu_target, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    path = tmp_path_factory.mktemp("gpu-draft")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def gpu_chat_model(device, tmp_path_factory) -> Path:
    """A tiny Llama over SmolLM2's vocabulary with its tokenizer and chat template."""
    from tests.e2e.conftest import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("gpu-chat"), seed=24, **_SHAPE)
