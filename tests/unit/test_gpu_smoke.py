"""`make gpu-smoke` on the CPU: the driver's dry run end to end (a tiny random model, short
points), and `--require`: a skipped check of a required feature fails the run (tests/gpu/conftest.py),
on a CUDA node for Triton and CUDA graphs whatever was asked."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.execution.cuda_graphs import NOT_CAPTURED
from tests.gpu.smoke.__main__ import main as smoke
from tests.gpu.smoke.bench import CONCURRENCIES, INVARIANT_CONCURRENCIES, MODES
from tests.gpu.smoke.counters import ReplayCounter
from tests.gpu.smoke.models import TINY, build_pair
from tests.gpu.smoke.report import COLUMNS, bench_failures, markdown_table

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
DEVICE_ENV = "SPECSERVE_GPU_TESTS_DEVICE"

# A stand-in for tests/gpu: its conftest, one check that runs, and skipped ones of the kinds a
# node may lack.
_FAKE_CONFTEST = "from tests.gpu.conftest import *  # noqa: F403\n"
_FAKE_CHECKS = """
import pytest

pytestmark = pytest.mark.gpu


def test_torch_backend_runs():
    assert 1 + 1 == 2


@pytest.mark.skipif(True, reason="needs CUDA and flash-attn")
def test_flash_attn_kernel():
    pass


def test_nvml_monitor():
    pytest.skip("pynvml is not installed: NVML absent")
"""
_FAKE_GRAPHS = """
import pytest

pytestmark = pytest.mark.gpu


def test_cuda_graphs_replay():
    pytest.skip("no graphable attention backend")


def test_cuda_graphs_with_flash_attn():  # its Triton case runs: this skip is not a failure
    pytest.skip("flash_attn needs CUDA and the flash-attn package")
"""


@pytest.fixture
def fake_node(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    pytester.makeconftest(_FAKE_CONFTEST)
    pytester.makepyfile(test_fake_node=_FAKE_CHECKS)
    return pytester


def test_required_flash_attn_check_that_skips_fails_the_run(fake_node):
    plain = fake_node.runpytest("-m", "gpu")
    plain.assert_outcomes(passed=1, skipped=2)
    assert plain.ret == 0

    required = fake_node.runpytest("-m", "gpu", "--require", "flash-attn")
    # Only the flash-attn check turned into a failure: NVML may still be absent.
    required.assert_outcomes(passed=1, skipped=1, errors=1)
    assert required.ret == pytest.ExitCode.TESTS_FAILED
    required.stdout.fnmatch_lines(
        ["*required flash-attn check skipped: needs CUDA and flash-attn*"]
    )


def test_a_cuda_node_must_run_its_graph_checks(fake_node, monkeypatch):
    fake_node.makepyfile(test_fake_graphs=_FAKE_GRAPHS)
    on_cpu = fake_node.runpytest("-m", "gpu")  # a dry run cannot run graphs: a skip is a skip
    on_cpu.assert_outcomes(passed=1, skipped=4)
    # The device is only named, never used: the fake checks touch no GPU.
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    on_cuda = fake_node.runpytest("-m", "gpu")
    on_cuda.assert_outcomes(passed=1, skipped=3, failed=1)
    assert on_cuda.ret == pytest.ExitCode.TESTS_FAILED
    on_cuda.stdout.fnmatch_lines(["*required cuda-graphs check skipped*"])
    on_cuda.stdout.no_fnmatch_line("*flash-attn check skipped*")  # not required unless asked


def test_driver_fails_the_node_on_a_required_skip(tmp_path):
    """The whole command, as `make gpu-smoke ARGS=...` runs it: --require reaches the checks."""
    checks = tmp_path / "fake_gpu_checks"
    checks.mkdir()
    (checks / "conftest.py").write_text(_FAKE_CONFTEST)
    (checks / "test_fake_node.py").write_text(_FAKE_CHECKS)
    out = tmp_path / "smoke.json"
    command = [sys.executable, "-m", "tests.gpu.smoke", "--dry-run", "--skip-bench"]
    command += ["--tests", str(checks), "--out", str(out), "--require", "flash-attn"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads(out.read_text())
    # 1: tests failed (a usage error, as an unknown --require, would be 4).
    assert result["checks"]["exit_status"] == 1 and result["verdict"] == "FAIL"
    assert (
        result["require"] == ["flash-attn"]
        and "--require=flash-attn" in result["checks"]["command"]
    )
    assert "gpu-smoke: FAIL" in done.stdout


def test_dry_run_writes_the_json_and_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    out = tmp_path / "smoke.json"
    status = smoke(["--dry-run", "--skip-checks", "--duration", "0.25", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert out.stat().st_size < 16 * 2**20
    result = json.loads(out.read_text())
    assert (result["verdict"], result["device"], result["dry_run"]) == ("PASS", "cpu", True)
    env = result["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__
    assert set(env["kernels"]) == {"flash_attn", "triton"} and env["missing_modules"] == []
    assert "torch" in env["backends"] and env["nvml"]

    bench = result["bench"]
    assert bench["failures"] == [] and "error" not in bench
    assert bench["model"]["name"] == "tiny" and bench["model"]["draft_layers"] == 1
    engines = bench["engines"]
    assert [(e["engine"]["graphs"], e["engine"]["batch_invariant"]) for e in engines] == [
        (True, False),
        (False, False),
        (True, False),  # the layers' torch formulation
        (True, False),  # every step in series
        (True, False),
        (True, True),
        (True, False),
    ]
    eagle3 = engines.pop()
    assert eagle3["engine"]["speculation"] == "eagle3"
    assert [(p["mode"], p["concurrency"]) for p in eagle3["points"]] == [
        ("always", c) for c in INVARIANT_CONCURRENCIES
    ]
    assert all(p["num_tokens"] > 0 and p["acceptance"] is not None for p in eagle3["points"])
    invariant = engines.pop()
    assert invariant["engine"]["attention_backend"] == "cpu"  # the CPU's batch-invariant one
    assert [(p["mode"], p["concurrency"]) for p in invariant["points"]] == [
        ("off", c) for c in INVARIANT_CONCURRENCIES
    ]
    assert all(p["num_tokens"] > 0 and p["acceptance"] is None for p in invariant["points"])
    ngram = engines.pop()
    assert ngram["engine"]["speculation"] == "ngram"
    unfused = engines.pop(2)
    assert unfused["engine"]["speculation"] is None
    assert [(p["mode"], p["concurrency"]) for p in unfused["points"]] == [("off", 1), ("off", 64)]
    serial = engines.pop(2)
    assert serial["engine"]["speculation"] is None
    assert serial["engine"]["overlap_scheduling"] is False
    assert [(p["mode"], p["concurrency"]) for p in serial["points"]] == [("off", 1), ("off", 64)]
    assert [(p["mode"], p["concurrency"]) for p in ngram["points"]] == [
        ("auto", c) for c in CONCURRENCIES
    ]
    for p in ngram["points"]:
        # Every step of the point is in the breakdown, split by whether it verified drafts; the
        # policy's decisions (one per request a lookup found a draft for) counted by reason.
        steps = p["steps"]
        split = [steps[k] for k in ("with_drafts", "without_drafts") if k in steps]
        assert sum(s["steps"] for s in split) == p["num_steps"]
        assert all(s["forward_ms"] > 0 and s["rest_ms"] >= 0 for s in split)
        assert all(s["read_mb_per_step"] > 0 and s["forward_gb_per_s"] > 0 for s in split)
        decided = steps["decisions"]
        assert all(k.split("/")[0] in ("speculate", "skip") and n > 0 for k, n in decided.items())
        assert decided.get("speculate/goodput", 0) >= steps.get("with_drafts", {}).get("steps", 0)
    for engine in engines:
        facts = engine["engine"]
        assert facts["num_kv_blocks"] > 0 and facts["num_graph_buckets"] == 0  # no graphs on CPU
        assert facts["kernels_per_decode_step"] is None and facts["fused_layers"] is False
        points = engine["points"]
        assert [(p["mode"], p["concurrency"]) for p in points] == [
            (m, c) for m in MODES for c in CONCURRENCIES
        ]
        for p in points:
            assert p["num_tokens"] > 0 and p["tokens_per_s"] > 0 and p["num_steps"] > 0
            assert 0 < p["ttft_p50_ms"] <= p["ttft_p95_ms"]
            assert p["graph_share"] == 0.0 and p["peak_memory_bytes"] is None
            if p["mode"] == "off":
                assert p["acceptance"] is None  # speculation off drafted nothing
        # Where auto drafted (its choices follow measured times on a loaded CPU, so it may draft
        # in a step or two only, all of whose first tokens can miss), acceptance is a share.
        assert all(0 <= p["acceptance"] <= 1 for p in points if p["acceptance"] is not None)

    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    assert len(table) == (
        2
        + 2 * len(MODES) * len(CONCURRENCIES)
        + len(CONCURRENCIES)
        + 2 * len(INVARIANT_CONCURRENCIES)
        + 2  # the torch formulation's
        + 2  # the serial steps'
    )
    assert printed.rstrip().endswith("===== gpu-smoke: PASS")


def test_the_draft_of_the_random_model_is_right_only_sometimes(tmp_path):
    """The pair the bench runs: the draft (the target's first layer) agrees with the target at
    some greedy tokens and not at others, so speculation has something to accept and to reject.
    Mode always: acceptance here does not depend on measured times."""
    from engine import LLM, SamplingParams

    pair = build_pair(tmp_path, TINY, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    spec = {"method": "draft_model", "model": str(pair.draft), "mode": "always"}
    llm = LLM(str(pair.target), dtype="float32", max_model_len=128, speculative_config=spec)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, TINY.shape["vocab_size"]) for _ in range(16)] for _ in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert 0.1 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9


def test_no_cuda_device_fails_before_any_check(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    out = tmp_path / "smoke.json"
    assert smoke(["--out", str(out)]) == 2
    result = json.loads(out.read_text())
    assert result["verdict"] == "FAIL" and "no CUDA device" in result["problems"][0]
    assert "checks" not in result and "bench" not in result


class _FakeGraphs:
    """Replays the steps of up to `capacity` tokens, as CudaGraphs.forward answers."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def forward(self, num_tokens: int):
        return torch.zeros(num_tokens, 4) if num_tokens <= self.capacity else NOT_CAPTURED


class _FakeRunner:
    def __init__(self, graphs: _FakeGraphs | None) -> None:
        self.graphs = graphs

    def forward(self, num_tokens: int):
        if self.graphs is not None:
            logits = self.graphs.forward(num_tokens)
            if logits is not NOT_CAPTURED:
                return logits
        return torch.ones(num_tokens, 4)


def test_replay_counter_counts_the_steps_a_graph_replayed():
    runner = _FakeRunner(_FakeGraphs(capacity=8))
    counter = ReplayCounter(runner)
    for num_tokens in (1, 8, 9, 300, 2):
        runner.forward(num_tokens)
    assert (counter.num_forwards, counter.num_replays) == (5, 3)
    assert counter.share == pytest.approx(0.6)
    counter.reset()
    runner.forward(100)
    assert (counter.num_forwards, counter.num_replays, counter.share) == (1, 0, 0.0)

    eager = ReplayCounter(_FakeRunner(None))
    assert eager.share is None  # no forward yet: nothing to judge the graphs by


class _FakeHeadGraphs(_FakeGraphs):
    def hidden_states(self, num_tokens: int, hidden: torch.Tensor):
        return torch.zeros(num_tokens, 4) if num_tokens <= self.capacity else NOT_CAPTURED

    def kv_states(self, num_tokens: int, hidden: torch.Tensor):
        return None if num_tokens <= self.capacity else NOT_CAPTURED


class _FakeHeadRunner(_FakeRunner):
    """An EAGLE-3 head's runner: drafts through hidden_forward, extends through kv_forward."""

    def hidden_forward(self, num_tokens: int, hidden: torch.Tensor):
        out = self.graphs.hidden_states(num_tokens, hidden)
        return torch.ones(num_tokens, 4) if out is NOT_CAPTURED else out

    def kv_forward(self, num_tokens: int, hidden: torch.Tensor) -> None:
        self.graphs.kv_states(num_tokens, hidden)


def test_replay_counter_counts_an_eagle3_heads_drafts_and_extends():
    """A head never calls forward: counting forward alone read its share as 0 on an H200."""
    runner = _FakeHeadRunner(_FakeHeadGraphs(capacity=8))
    counter = ReplayCounter(runner)
    hidden = torch.zeros(1)
    for num_tokens in (1, 4, 20):
        runner.hidden_forward(num_tokens, hidden)
    runner.kv_forward(3, hidden)
    runner.kv_forward(64, hidden)
    assert (counter.num_forwards, counter.num_replays) == (5, 3)


def _bench(num_buckets: int, graph_share: float, peak: int, budget: int | None) -> dict:
    point = dict(
        graphs=True, batch_invariant=False, mode="auto", concurrency=8, seconds=1.0, num_requests=3, num_tokens=100,
        tokens_per_s=100.0, ttft_p50_ms=5.0, ttft_p95_ms=9.0, num_steps=20,
        graph_share=graph_share, draft_graph_share=None, acceptance=0.5, peak_memory_bytes=peak,
    )  # fmt: skip
    facts = dict(
        graphs=True, attention_backend="triton", num_kv_blocks=1000,
        num_graph_buckets=num_buckets, memory_budget_bytes=budget,
    )  # fmt: skip
    return {"engines": [{"engine": facts, "points": [point]}]}


def test_bench_failures_name_what_fails_a_node():
    assert bench_failures(_bench(10, 0.8, 2**30, 2**31)) == []
    assert bench_failures(_bench(0, 0.0, 2**30, None)) == []  # eager: nothing to replay
    (unreplayed,) = bench_failures(_bench(10, 0.0, 2**30, 2**31))
    assert "graphs captured, none replayed" in unreplayed
    (over,) = bench_failures(_bench(10, 0.8, 3 * 2**30, 2**31))
    assert "past the budget (3.0 / 2.0 GiB)" in over
    assert (
        "| on | off | auto | 8 | 100 | - | - | - | 5.0 | 9.0 | 0.80 | - | 0.50 | 1000 | 1.0 / 2.0 |"
        in (markdown_table(_bench(10, 0.8, 2**30, 2**31)))
    )


def test_checks_over_smollm2s_vocabulary_use_the_carried_tokenizer(tmp_path, monkeypatch):
    """On a GPU node without the bundled SmolLM2 the chat-model fixture takes the tokenizer
    `make gpu-wheels` carried (SPECSERVE_SMOLLM2_TOKENIZER); without either it skips."""
    from engine.models import bundled
    from tests.e2e import conftest as e2e

    def missing(name: str):
        raise RuntimeError(f"bundled model {name!r} needs packages that are not installed")

    monkeypatch.setattr(bundled, "resolve_model", missing)
    monkeypatch.delenv("SPECSERVE_SMOLLM2_TOKENIZER", raising=False)
    with pytest.raises(pytest.skip.Exception, match="SmolLM2 tokenizer is not available"):
        e2e.smollm2_tokenizer_dir()
    carried = tmp_path / "smollm2-tokenizer"
    carried.mkdir()
    (carried / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("SPECSERVE_SMOLLM2_TOKENIZER", str(carried))
    assert e2e.smollm2_tokenizer_dir() == carried


class _PromptRecorder:
    """An engine that finishes every request in the step after it arrives, keeping prompts."""

    model_config = SimpleNamespace(vocab_size=1000)

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self._pending: list[str] = []

    def add_request(self, request_id: str, prompt: list[int], params) -> None:
        self.prompts.append(list(prompt))
        self._pending.append(request_id)

    def step(self):
        done, self._pending = self._pending, []
        piece = SimpleNamespace(token_ids=[7], num_output_tokens=1)
        return [SimpleNamespace(request_id=r, outputs=[piece], finished=True) for r in done]

    def abort(self, request_id: str) -> None:
        pass


def test_each_mode_of_a_point_gets_its_own_prompts():
    """The bench runs off, then auto, at each concurrency on one engine: with the same prompts
    the second mode found the first's in the prefix cache (on the H200, 496 of 512 tokens), so
    its points paid only a prompt's tail. Each mode now draws its own prompts, and the same ones
    again when a point is rerun."""
    from tests.gpu.smoke.bench import Workload, _run_point

    workload = Workload(prompt_len=32, max_tokens=1, duration_s=0.0, seed=0)
    prompts = {}
    for mode in ("off", "auto", "off"):
        engine = _PromptRecorder()
        _run_point(engine, 4, workload, stream=mode)  # type: ignore[arg-type]
        prompts.setdefault(mode, []).append(engine.prompts)
    off, again = prompts["off"]
    assert off == again and len(off) >= 4
    shared = {tuple(p[:16]) for p in off} & {tuple(p[:16]) for p in prompts["auto"][0]}
    assert not shared
