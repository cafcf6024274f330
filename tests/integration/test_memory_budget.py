"""One KV budget for the target and the draft model: the draft's KV counts against it (it used to
be allocated on top), and on CUDA it is measured after every weight is loaded. The CUDA path runs
here on CPU through a Device that reports chosen memory figures."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from engine.execution.kv_plan import activation_bytes
from engine.runtime.device import Device
from tests.conftest import build_tiny_model

MiB = 2**20


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    # Fewer layers and KV heads than the target: its bytes per block differ from the target's.
    return build_tiny_model(
        tmp_path_factory.mktemp("draft"),
        "llama",
        seed=5,
        num_hidden_layers=1,
        num_key_value_heads=1,
    )


def _spec(draft, **extra) -> dict:
    spec = {
        "method": "draft_model",
        "model": str(draft),
        "mode": "always",
        "draft_min_confidence": 0,
    }
    return spec | extra


def _kv_bytes(runner) -> int:
    """Bytes of the runner's KV tensors without the pad block."""
    per_block = sum(2 * k.numel() * k.element_size() // k.shape[0] for k, _ in runner.kv_caches)
    return per_block * runner.num_blocks


def _check_pools(engine, num_blocks: int) -> None:
    """Both runners have num_blocks blocks the block manager hands out, plus the pad block."""
    assert engine.block_manager.num_blocks == num_blocks
    for runner in (engine.runner, engine.draft_runner):
        assert runner.num_blocks == num_blocks and runner.pad_block == num_blocks
        for k, v in runner.kv_caches:
            assert k.shape[0] == v.shape[0] == num_blocks + 1
            assert k.shape[1:] == (
                engine.config.block_size,
                runner.model_config.num_kv_heads,
                runner.model_config.head_dim,
            )


@pytest.mark.parametrize("draft_dtype", [None, "bfloat16"])
def test_kv_cache_memory_bounds_target_and_draft_together(tiny_llama, draft, draft_dtype):
    budget = 1_000_000
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        kv_cache_memory=budget,
        speculative_config=_spec(draft, draft_dtype=draft_dtype),
    )
    engine = llm.engine
    target, drafter = engine.runner, engine.draft_runner
    per_block = target.kv_bytes_per_block + drafter.kv_bytes_per_block
    assert target.kv_bytes_per_block == 2 * 2 * 2 * 16 * 4 * 16  # K+V, layers, heads, dim, fp32
    assert drafter.kv_bytes_per_block == 2 * 1 * 1 * 16 * (2 if draft_dtype else 4) * 16
    assert engine.block_manager.num_blocks == budget // per_block
    _check_pools(engine, budget // per_block)
    assert _kv_bytes(target) + _kv_bytes(drafter) <= budget
    # The proposer drafts with the engine's runner: no second pool outside the budget.
    proposer = next(p for p in engine.speculator.chain if p.name == "draft_model")
    assert proposer.runner is drafter
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    assert engine.spec_stats.num_draft_tokens > 0


def test_without_a_draft_the_target_takes_the_whole_budget(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=1_000_000)
    assert llm.engine.draft_runner is None
    assert llm.engine.block_manager.num_blocks == 1_000_000 // llm.engine.runner.kv_bytes_per_block


def test_num_kv_blocks_gives_both_models_that_many(tiny_llama, draft):
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=37, speculative_config=_spec(draft))
    _check_pools(llm.engine, 37)


def test_max_model_len_that_does_not_fit_the_shared_budget_raises(tiny_llama, draft):
    # 512 tokens need 32 blocks of 16: the budget holds 38 of the target's alone, 31 of both.
    per_block = 8192 + 2048
    with pytest.raises(ValueError, match="max_model_len 512 does not fit"):
        LLM(
            str(tiny_llama),
            dtype="float32",
            max_model_len=512,
            kv_cache_memory=31 * per_block,
            speculative_config=_spec(draft),
        )


def test_start_up_logs_weights_kv_and_budget(tiny_llama, draft, caplog):
    with caplog.at_level(logging.INFO, logger="engine.execution.kv_plan"):
        llm = LLM(
            str(tiny_llama), dtype="float32", kv_cache_memory=MiB, speculative_config=_spec(draft)
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.execution.kv_plan"]
    assert len(lines) == 1
    num_blocks = llm.engine.block_manager.num_blocks
    assert f"{num_blocks} blocks of 16 tokens" in lines[0]
    assert tiny_llama.name in lines[0] and draft.name in lines[0]
    assert "kv_cache_memory" in lines[0]


# ------------------------------------------------------------------------------ CUDA budget


class _MeasuredDevice(Device):
    """A CPU device that reports (free, total) memory as a CUDA device does after loading."""

    memory = (48 * MiB, 64 * MiB)

    def memory_info(self) -> tuple[int, int] | None:
        return self.memory


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr("engine.execution.runner.Device", _MeasuredDevice)
    return _MeasuredDevice


def _reserve(engine) -> int:
    config = engine.config
    rows = min(config.max_num_batched_tokens, config.max_num_seqs * (1 + 3))  # k = 3
    return sum(
        activation_bytes(r.model_config, r.dtype.itemsize, config.max_num_batched_tokens, rows)
        for r in (engine.runner, engine.draft_runner)
    )


@pytest.mark.parametrize("utilization", [0.5, 0.9])
def test_gpu_budget_from_memory_after_weights(tiny_llama, draft, fake_gpu, utilization):
    free, total = fake_gpu.memory
    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        gpu_memory_utilization=utilization,
        speculative_config=_spec(draft, num_speculative_tokens=3),
    )
    engine = llm.engine
    per_block = engine.runner.kv_bytes_per_block + engine.draft_runner.kv_bytes_per_block
    reserve = _reserve(engine)
    # 256 tokens x fp32 x (3*64 + 2*64 + 2*kv + 3*128) + 16 seqs x (1 + 3) rows x 320 x (4 + 12).
    assert reserve == 256 * 4 * (768 + 736) + 2 * 64 * 320 * 16
    budget = int(utilization * total) - (total - free) - reserve
    _check_pools(engine, budget // per_block)
    # The CPU cap (max_num_seqs full-length sequences) does not apply on CUDA.
    assert engine.block_manager.num_blocks > 16 * 512 // 16


def test_gpu_kv_cache_memory_is_an_upper_bound(tiny_llama, draft, fake_gpu):
    llm = LLM(
        str(tiny_llama), dtype="float32", kv_cache_memory=MiB, speculative_config=_spec(draft)
    )
    assert llm.engine.block_manager.num_blocks == MiB // (8192 + 2048)


def test_gpu_budget_too_small_for_one_block_raises(tiny_llama, draft, fake_gpu, monkeypatch):
    monkeypatch.setattr(fake_gpu, "memory", (7 * MiB, 64 * MiB))  # 57 MiB in use after weights
    with pytest.raises(ValueError, match="cannot hold one block") as err:
        LLM(str(tiny_llama), dtype="float32", speculative_config=_spec(draft))
    budget = int(0.9 * 64 * MiB) - 57 * MiB - (256 * 4 * (768 + 736) + 2 * 64 * 320 * 16)
    assert f"{budget} bytes" in str(err.value) and "in use after loading weights" in str(err.value)


def test_a_draft_with_another_vocabulary_is_refused_before_loading(tiny_llama, tmp_path):
    other = build_tiny_model(tmp_path / "other-vocab", "llama", vocab_size=256)
    with pytest.raises(ValueError, match="must share a tokenizer"):
        LLM(str(tiny_llama), dtype="float32", speculative_config=_spec(other))
