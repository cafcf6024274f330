"""The step-time calibration's cache: a fit is reused only where the same model runs the same way
on the same hardware (the key), a calibration disturbed by other work is not cached, and a cached
fit stands only once the first served steps confirm it (a fit timed under load is dropped)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine import kernels
from engine.core.chunks import attention_reads
from engine.core.stats import StepStats
from engine.execution.graph_buckets import Bucket
from engine.policy import cached_fit, calibration, calibration_cache
from engine.policy.policy import SpeculationPolicy
from engine.policy.step_time import StepTimeModel
from engine.speculative_config import SpeculativeConfig


def _runner(
    weight_format: str = "float32",
    enforce_eager: bool = False,
    graphs: object = None,
    num_speculative_tokens: int = 3,
) -> SimpleNamespace:
    spec = SpeculativeConfig("ngram", num_speculative_tokens=num_speculative_tokens)
    return SimpleNamespace(
        device=SimpleNamespace(torch=torch.device("cpu"), is_cuda=False),
        dtype=torch.float32,
        weight_format=weight_format,
        backend=SimpleNamespace(name="torch"),
        block_size=16,
        config=SimpleNamespace(
            enforce_eager=enforce_eager, max_num_seqs=16, speculative_config=spec
        ),
        graphs=graphs,
    )


def _key(runner: SimpleNamespace, path: Path = Path("/models/a")) -> str:
    return calibration_cache._cache_key(runner, path, 64, 2048)


def test_the_key_is_stable_for_one_setup():
    assert _key(_runner()) == _key(_runner())


def test_the_key_changes_with_what_changes_the_timings(monkeypatch):
    base = _key(_runner())
    assert _key(_runner("gguf (Q4_K), float32 activations")) != base
    int8 = _key(_runner("gguf (Q4_K), int8 activations"))
    assert int8 not in (base, _key(_runner("gguf (Q4_K), float32 activations")))
    assert _key(_runner(), Path("/models/b")) != base
    monkeypatch.setattr(calibration_cache, "cpu_name", lambda: "another CPU")
    other_cpu = _key(_runner())
    assert other_cpu != base
    monkeypatch.setattr(kernels, "speed_signature", lambda: "other kernels")
    assert _key(_runner()) not in (base, other_cpu)


def test_the_key_changes_with_the_path_the_timed_steps_take():
    """A fit timed eagerly is not the fit of steps that replay CUDA graphs, nor one timed over
    other graphs or other served shapes (max_num_seqs, K decide them)."""
    base = _key(_runner())
    eager = _key(_runner(enforce_eager=True))
    graphs = SimpleNamespace(buckets=(Bucket(1, 1), Bucket(1, 2), Bucket(4, 8)))
    graphed = _key(_runner(graphs=graphs))
    fewer = _key(_runner(graphs=SimpleNamespace(buckets=(Bucket(1, 1),))))
    other_k = _key(_runner(num_speculative_tokens=5))
    assert len({base, eager, graphed, fewer, other_k}) == 5


def test_the_cpu_is_named_by_its_model():
    name = calibration_cache.cpu_name()
    assert name and name not in ("x86_64", "")  # not just the architecture where /proc says more


# --------------------------------------------------------------------------- a fit on probation
# The clock is fake throughout: served steps bring the seconds the test gives them, and the
# calibration's forwards are timed by fake timers, so nothing here depends on the machine's load.

FIT = StepTimeModel([1, 8, 64], [0.1, 0.1, 0.4], context_coef=1e-6, row_coef=0.002)
NUM_STEPS = cached_fit.NUM_CHECK_STEPS


def _use_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, under tmp_path, with one key; returns the fit's path there."""
    monkeypatch.setenv("SPECSERVE_CALIBRATION_CACHE", "1")
    monkeypatch.setattr(calibration_cache, "_cache_key", lambda *args: "key")
    return tmp_path / "calibration" / "key.json"


def _write_fit(path: Path, fit: StepTimeModel = FIT) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(fit.to_dict())
    path.write_text(text)
    return text


def _no_forwards(*args: object) -> float:
    raise AssertionError("a cached fit must not time forwards")


def _load(tmp_path: Path, runner: SimpleNamespace | None = None) -> SpeculationPolicy:
    """The policy over load_or_calibrate's model, fed steps as the engine feeds them."""
    blocks = SimpleNamespace(num_blocks=256, block_size=16)
    model = calibration_cache.load_or_calibrate(
        runner or _runner(), blocks, Path("/models/a"), 64, 2048, cache_dir=tmp_path
    )
    return SpeculationPolicy("auto", 4, model)


def _serve(policy: SpeculationPolicy, scale: float, num_steps: int) -> None:
    """num_steps decode steps of 4 sequences (4 tokens, 4 logits rows, 400 KV reads), each
    taking `scale` times what FIT predicts for it."""
    seconds = scale * FIT.predict(4, 400, 4)
    for _ in range(num_steps):
        policy.observe(StepStats((), (), 4, 4, 400, seconds, 0.0, 0.0))


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_a_cached_fit_twice_the_served_steps_is_rescaled_and_dropped(tmp_path, monkeypatch, caplog):
    """The issue's start: the cached fit was timed while another job held the CPU, and predicts
    twice what the steps take. After NUM_CHECK_STEPS decode steps the file is gone (the next
    start calibrates again), the warning names the numbers, and the policy's whole curve (not
    just the served shape) is the fit rescaled to the served steps."""
    caplog.set_level(logging.INFO)
    path = _use_cache(tmp_path, monkeypatch)
    _write_fit(path)
    monkeypatch.setattr(calibration, "time_step", _no_forwards)
    policy = _load(tmp_path)
    assert any(str(path) in m and "cached fit" in m for m in _messages(caplog, logging.INFO))
    _serve(policy, 0.5, NUM_STEPS - 1)
    assert path.exists()  # not judged on fewer steps
    _serve(policy, 0.5, 1)
    assert not path.exists()
    (warning,) = _messages(caplog, logging.WARNING)
    assert "0.50x" in warning and str(path) in warning and "under load" in warning
    assert "100.0 ms" in warning and "50.0 ms" in warning  # t(1) cached and served
    model = policy.step_model
    for n, reads, rows in [(1, 0, 1), (4, 400, 4), (64, 0, 1), (256, 5000, 32)]:
        assert model.predict(n, reads, rows) == pytest.approx(0.5 * FIT.predict(n, reads, rows))
    _serve(policy, 0.25, 3 * NUM_STEPS)  # judged once: the refinement takes it from here
    assert len(_messages(caplog, logging.WARNING)) == 1


def test_a_cached_fit_within_the_margin_is_confirmed_and_kept(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    path = _use_cache(tmp_path, monkeypatch)
    text = _write_fit(path)
    monkeypatch.setattr(calibration, "time_step", _no_forwards)
    policy = _load(tmp_path)
    _serve(policy, 0.85, NUM_STEPS)  # 15% faster: within the margin
    assert path.read_text() == text
    assert any("confirmed" in m and str(path) in m for m in _messages(caplog, logging.INFO))
    assert not _messages(caplog, logging.WARNING)
    assert policy.step_model.predict(64) == pytest.approx(FIT.predict(64))  # not rescaled
    _serve(policy, 0.5, NUM_STEPS)  # confirmed once: later steps are the refinement's
    assert path.read_text() == text


def test_served_steps_slower_than_the_fit_do_not_overwrite_it(tmp_path, monkeypatch, caplog):
    """Steps slower than the fit say the machine is busy now, not that the fit is wrong: the
    file stays as it was (said once), and the check goes on, so a fit that was timed under an
    even heavier load is still caught once the machine quietens."""
    caplog.set_level(logging.INFO)
    path = _use_cache(tmp_path, monkeypatch)
    text = _write_fit(path)
    monkeypatch.setattr(calibration, "time_step", _no_forwards)
    policy = _load(tmp_path)
    _serve(policy, 2.0, 3 * NUM_STEPS)
    assert path.read_text() == text
    busy = [m for m in _messages(caplog, logging.INFO) if "busier" in m]
    assert len(busy) == 1 and "2.00x" in busy[0]
    assert not _messages(caplog, logging.WARNING)
    _serve(policy, 0.5, NUM_STEPS)
    assert not path.exists()


def _fake_timers(monkeypatch: pytest.MonkeyPatch, t1: list[float]) -> list[int]:
    """Forwards timed by a fake clock: t(1) takes the given seconds in turn (the warm-up first),
    every other forward the curve flat at 0.1 s to 8 tokens, then proportional to n. Returns
    the list each timed step's token count is appended to."""
    seconds = iter(t1)
    timed: list[int] = []

    def time_step(runner, blocks, query_lens, context, repeats):
        n = sum(query_lens)
        timed.append(n)
        if n == 1 and context == 0:
            return next(seconds)
        return 0.1 * max(1.0, n / 8) + 1e-7 * sum(attention_reads(context, q) for q in query_lens)

    def time_verify_batch(runner, blocks, num_seqs, num_tokens):
        return 0.1 * max(1.0, num_seqs * num_tokens / 8) + 0.002 * (num_seqs * num_tokens - 1)

    monkeypatch.setattr(calibration, "time_step", time_step)
    monkeypatch.setattr(calibration, "time_verify_batch", time_verify_batch)
    return timed


def test_a_calibration_disturbed_for_most_of_its_t1_timings_is_not_cached(
    tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.INFO)
    path = _use_cache(tmp_path, monkeypatch)
    _fake_timers(monkeypatch, [0.3] + [0.1, 0.17, 0.18] * 10)
    policy = _load(tmp_path)
    assert not path.exists()
    (warning,) = _messages(caplog, logging.WARNING)
    assert "not cached" in warning and "1.70x" in warning and "100.0 to 180.0 ms" in warning
    assert policy.step_model.predict(1) == pytest.approx(0.1, rel=1e-3)  # the least timing


def test_a_quiet_calibration_is_cached_and_checked_like_a_loaded_one(tmp_path, monkeypatch, caplog):
    """One burst spoils one t(1) timing, not the fit (the minimum is kept) nor its caching; and a
    fit measured now under a steady load (no spread to see) is caught by the served steps."""
    caplog.set_level(logging.INFO)
    path = _use_cache(tmp_path, monkeypatch)
    _fake_timers(monkeypatch, [0.3, 0.1, 0.1, 0.25] + [0.1] * 10)
    policy = _load(tmp_path)
    assert path.exists() and not _messages(caplog, logging.WARNING)
    assert any("measured now" in m for m in _messages(caplog, logging.INFO))
    assert policy.step_model.predict(1) == pytest.approx(0.1, rel=1e-3)
    fit = StepTimeModel.from_dict(json.loads(path.read_text()))
    seconds = 0.5 * fit.predict(4, 400, 4)
    for _ in range(NUM_STEPS):
        policy.observe(StepStats((), (), 4, 4, 400, seconds, 0.0, 0.0))
    assert not path.exists()


def test_a_fit_taken_with_graphs_is_not_loaded_with_enforce_eager(tmp_path, monkeypatch):
    """The issue's F3: a fit timed on one path (graphs replayed, enforce_eager False) and cached
    must not price the steps of a start that runs every step eagerly: that start calibrates
    again, and each start then finds its own fit."""
    monkeypatch.setenv("SPECSERVE_CALIBRATION_CACHE", "1")
    timed = _fake_timers(monkeypatch, [0.1] * 60)
    graphed = _runner(graphs=SimpleNamespace(buckets=(Bucket(1, 1), Bucket(4, 8))))
    first = _load(tmp_path, graphed).step_model
    assert isinstance(first, cached_fit.CachedFit) and first.origin == "just measured"
    num_timed = len(timed)
    assert num_timed > 0
    eager = _load(tmp_path, _runner(enforce_eager=True)).step_model
    assert len(timed) > num_timed  # timed again, not loaded
    assert isinstance(eager, cached_fit.CachedFit) and eager.path != first.path
    num_timed = len(timed)
    again = _load(tmp_path, graphed).step_model  # the graphs' own fit is still there
    assert len(timed) == num_timed
    assert isinstance(again, cached_fit.CachedFit) and again.origin == "cached"
    assert again.path == first.path
