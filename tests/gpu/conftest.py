"""Fixtures of the GPU-node checks and the one summary `make gpu-test` ends with.

Every test here is marked `gpu` and skips without CUDA (see `tests.gpu.node` for the device
override). A test names the summary line it counts towards with `@pytest.mark.gpu_check(name)`
(default: its module's name); figures worth reading but never asserted on (decode speed) go
through the `gpu_record` fixture. The summary block prints once some gpu test has run.

A skip is not a pass: on a CUDA device a skipped check of a feature in `REQUIRED_ON_CUDA` (the
Triton backend, CUDA graphs) fails the run, and `--require NAME` (repeatable) makes a skipped
check of NAME fail anywhere: `--require flash-attn` on a node that must serve with flash-attn (the
image), where a missing or broken flash-attn would otherwise read as a skip. A check belongs to a
feature when its id or its skip reason names it (`FEATURES`), e.g. "needs CUDA and flash-attn".
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

# A feature a check may need -> the words (lower case) that name it in a test id or skip reason.
FEATURES = {
    "flash-attn": ("flash-attn", "flash_attn"),
    "triton": ("triton",),
    "cuda-graphs": ("cuda graph", "cuda_graph"),
    "nvml": ("nvml",),
}
# What a CUDA node must run whatever it was asked: without flash-attn, a node serves with Triton
# and CUDA graphs, so their checks may not skip there. NVML may be absent (MIG, containers).
REQUIRED_ON_CUDA = ("triton", "cuda-graphs")


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
_SKIPPED_REQUIRED = pytest.StashKey[list[str]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require",
        action="append",
        default=[],
        choices=sorted(FEATURES),
        help="a skipped check of this feature fails the run (repeatable), e.g. flash-attn",
    )


def required_features(config: pytest.Config) -> set[str]:
    """`--require`'s features, and on a CUDA device those it must always run."""
    required = set(config.getoption("require", default=None) or [])
    device = requested_device()
    if device is not None and device.startswith("cuda"):
        required.update(REQUIRED_ON_CUDA)
    return required


def features_named(text: str) -> set[str]:
    """The features a test id or skip reason names."""
    lowered = text.lower()
    return {name for name, words in FEATURES.items() if any(w in lowered for w in words)}


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    return reason.removeprefix("Skipped: ")


def _missing_required(config: pytest.Config, nodeid: str, reason: str) -> list[str]:
    """The required features a skip leaves unchecked; none where the skip's reason names a
    feature that is not required (the flash-attn case of a CUDA-graph check, on a node that
    serves with Triton: the Triton case of the same check must run)."""
    required = required_features(config)
    if features_named(reason) - required:
        return []
    return sorted(features_named(f"{nodeid} {reason}") & required)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{CHECK_MARKER}(name): the line of the GPU-node summary a test counts towards"
    )
    config.stash[_REPORT] = NodeReport()
    config.stash[_SKIPPED_REQUIRED] = []


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
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        missing = _missing_required(item.config, item.nodeid, reason)
        if missing:  # a required check that did not run has failed
            report.outcome = "failed"
            report.longrepr = f"required {', '.join(missing)} check skipped: {reason}"
    node = item.config.stash[_REPORT]
    if item.nodeid in node.check_of:
        node.note(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A module skipped whole at collection (`importorskip` at its top) has no test report to
    fail: note it, and `pytest_sessionfinish` fails the run (a collection error would stop it)."""
    report = yield
    if report.skipped:
        missing = _missing_required(collector.config, report.nodeid, _skip_reason(report))
        if missing:
            collector.config.stash[_SKIPPED_REQUIRED].append(
                f"{report.nodeid}: required {', '.join(missing)} checks skipped"
            )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.stash.get(_SKIPPED_REQUIRED, None) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
    for skipped in config.stash[_SKIPPED_REQUIRED]:
        statuses.append("FAIL")
        write(f"FAIL  {skipped}")
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
