"""bench/policy/run.py and its flags (settings.py) without a server: the levels a run measures,
the per-mode server config, the order of the modes in a round, and bench_all's windows and
slices over fakes of the server and the clients."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools

import pytest

from bench.policy import clients as C
from bench.policy import run as P
from bench.policy import settings as S
from bench.policy import workload as W


def test_workloads_option_measures_each_workload_at_each_concurrency():
    settings, _ = S.parse_args([])
    assert settings.workloads == ("mixed",)  # as before the option
    assert P.levels_of(settings) == [("mixed", c) for c in (1, 2, 4, 8, 16, 32)] + [
        ("code_edit", 1)
    ]
    both, _ = S.parse_args(["--workloads", "code_gen, mixed,code_gen", "--concurrency", "1,4"])
    assert both.workloads == ("code_gen", "mixed")  # in the order given, once each
    assert P.levels_of(both) == [
        ("code_gen", 1),
        ("code_gen", 4),
        ("mixed", 1),
        ("mixed", 4),
        ("code_edit", 1),
    ]
    edits, _ = S.parse_args(["--workloads", "code_edit", "--concurrency", "1,2"])
    assert P.levels_of(edits) == [("code_edit", 1), ("code_edit", 2)]  # c = 1 not twice
    none, _ = S.parse_args(["--workloads", "open_chat", "--concurrency", "2", "--no-code-edit-c1"])
    assert P.levels_of(none) == [("open_chat", 2)]
    for wrong in ("chat", ""):
        with pytest.raises(SystemExit):
            S.parse_args(["--workloads", wrong])


def test_bench_all_fills_the_cache_with_every_workload_and_measures_each(monkeypatch):
    """Every prompt of every level's workload is cached once before the first level; each
    workload is measured at each concurrency, then code edit at c = 1."""
    filled, measured = [], []

    @contextlib.contextmanager
    def server(config, timeout):
        yield "http://x"

    class Models:
        def json(self):
            return {"data": [{"id": "m"}]}

    async def fill(url, headers, model, prompts):
        filled.extend(prompts)

    async def level(url, headers, model, prompts, c, settings, offset):
        measured.append((tuple(prompts), c))
        return [], (0.0, 1.0), None

    monkeypatch.setattr(P, "running_server", server)
    monkeypatch.setattr(P.httpx, "get", lambda *a, **kw: Models())
    monkeypatch.setattr(P, "operate", lambda *a, **kw: None)
    monkeypatch.setattr(P, "fill_prefix_cache", fill)
    monkeypatch.setattr(P, "warm_up", lambda *a: None)
    monkeypatch.setattr(P, "run_level", level)
    config = {"engine": {"speculative_config": {"method": "ngram"}}}
    settings = S.BenchSettings(
        config, ("off",), (2,), 1.0, 8, True, 0.001, 5.0, workloads=("open_chat", "code_gen")
    )
    results = P.bench_all(settings)
    assert sorted(filled) == sorted(
        {*W.open_chat_prompts(), *W.code_gen_prompts(), *W.code_edit_prompts()}
    )
    assert measured == [
        (tuple(W.open_chat_prompts()), 2),
        (tuple(W.code_gen_prompts()), 2),
        (tuple(W.code_edit_prompts()), 1),
    ]
    assert [(r.workload, r.concurrency) for r in results] == [
        ("open_chat", 2),
        ("code_gen", 2),
        ("code_edit", 1),
    ]


def test_server_config_starts_in_auto_with_a_key_and_admits_every_client(monkeypatch):
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    base = {
        "engine": {"model": "m", "max_num_seqs": 16, "speculative_config": {"method": "ngram"}},
        "server": {"port": 8000},
    }
    config = P.server_config(base, 32)
    assert config["engine"]["speculative_config"] == {"method": "ngram", "mode": "auto"}
    assert config["engine"]["max_num_seqs"] == 32 and config["engine"]["model"] == "m"
    assert config["server"]["stream_one_token_per_chunk"] is True
    key = config["server"]["api_key"]
    assert key.startswith("sk-bench-") and P.auth_headers(config) == {
        "Authorization": f"Bearer {key}"
    }
    assert P.server_config(base, 32)["server"]["api_key"] != key  # a new one each time
    assert base["engine"]["speculative_config"] == {"method": "ngram"}  # the base is untouched
    assert "api_key" not in base["server"]
    assert P.server_config(base, 4)["engine"]["max_num_seqs"] == 16
    assert "kv_cache_memory" not in config["engine"]
    assert P.server_config(base, 4, 2**30)["engine"]["kv_cache_memory"] == 2**30
    keyed = {**base, "server": {"api_key": "sk-own"}}
    assert P.server_config(keyed, 1)["server"]["api_key"] == "sk-own"
    monkeypatch.setenv("SPECSERVE_API_KEY", "sk-env")  # what the server itself would use
    assert P.server_config(keyed, 1)["server"]["api_key"] == "sk-env"
    with pytest.raises(SystemExit):
        P.server_config({"engine": {"model": "m"}}, 1)


def test_every_mode_leads_a_round_as_often_as_the_others():
    modes = ("off", "always", "auto")
    orders = [P.window_order(modes, r) for r in range(6)]
    assert orders[:3] == [
        ["off", "always", "auto"],
        ["always", "auto", "off"],
        ["auto", "off", "always"],
    ]
    assert orders[3:] == [  # then reversed: each mode follows each other one as often
        ["auto", "always", "off"],
        ["always", "off", "auto"],
        ["off", "auto", "always"],
    ]
    for position in range(3):
        assert sorted(o[position] for o in orders[:3]) == sorted(modes)
        assert sorted(o[position] for o in orders[3:]) == sorted(modes)
    follows = collections.Counter(pair for o in orders for pair in itertools.pairwise(o))
    assert set(follows.values()) == {2} and len(follows) == 6  # every ordered pair, twice
    assert P.window_order(modes, 6) == orders[0]
    assert [P.window_order(("off", "auto"), r) for r in range(4)] == [
        ["off", "auto"],
        ["auto", "off"],
        ["auto", "off"],
        ["off", "auto"],
    ]


def test_bench_all_interleaves_the_modes_within_each_level(monkeypatch):
    """One server; each mode warmed up once; per level, rounds of every mode back to back, each
    window after a switch and a cache reset, each result tagged with its round."""
    calls, offsets = [], []

    @contextlib.contextmanager
    def server(config, timeout):
        calls.append(("start", config["engine"]["speculative_config"]["mode"]))
        yield "http://x"

    class Models:
        def json(self):
            return {"data": [{"id": "m"}]}

    async def level(url, headers, model, prompts, c, settings, offset):
        calls.append(("window", c))
        offsets.append(offset)
        return [], (0.0, 1.0), None

    monkeypatch.setattr(P, "running_server", server)
    monkeypatch.setattr(P.httpx, "get", lambda *a, **kw: Models())
    monkeypatch.setattr(
        P, "operate", lambda url, headers, mode, is_cold: calls.append(("mode", mode, is_cold))
    )

    async def fill(url, headers, model, prompts):
        calls.append(("fill", len(prompts)))

    monkeypatch.setattr(P, "fill_prefix_cache", fill)
    monkeypatch.setattr(P, "warm_up", lambda *a: calls.append(("warm",)))
    monkeypatch.setattr(P, "run_level", level)
    config = {"engine": {"speculative_config": {"method": "ngram"}}}
    settings = S.BenchSettings(config, ("off", "auto"), (1, 4), 1.0, 8, True, 0.001, 5.0, rounds=2)
    results = P.bench_all(settings)
    warm = [("mode", "off", False), ("warm",), ("mode", "auto", False), ("warm",)]
    # every distinct prompt once (the mixed workload holds the code edits)
    assert calls[:6] == [("start", "auto"), *warm, ("fill", len(W.mixed_prompts()))]
    assert all(c[2] is False for c in calls[6:] if c[0] == "mode")  # warm: never emptied
    windows = [(a[1], b[1]) for a, b in itertools.pairwise(calls[6:]) if a[0] == "mode"]
    assert windows == [("off", 1), ("auto", 1), ("auto", 1), ("off", 1)] + [
        ("off", 4),
        ("auto", 4),
        ("auto", 4),
        ("off", 4),
    ] + [("off", 1), ("auto", 1), ("auto", 1), ("off", 1)]
    tagged = [(r.mode, r.workload, r.concurrency, r.round) for r in results]
    assert tagged[:4] == [
        ("off", "mixed", 1, 0),
        ("auto", "mixed", 1, 0),
        ("auto", "mixed", 1, 1),
        ("off", "mixed", 1, 1),
    ]
    assert tagged[-1] == ("off", "code_edit", 1, 1) and len(tagged) == 12
    # the rounds start half the workload apart (24 mixed prompts, 12 code edits), both modes alike
    assert offsets == [0, 0, 12, 12] * 2 + [0, 0, 6, 6]
    assert [P.prompt_offset(24, r, 3) for r in range(3)] == [0, 8, 16]
    assert [P.prompt_offset(12, r, 5) for r in range(5)] == [0, 2, 4, 6, 8]

    calls.clear()
    P.bench_all(dataclasses.replace(settings, is_cold=True))
    assert not any(c[0] == "fill" for c in calls)
    assert calls[:5] == [("start", "auto"), *warm]
    assert all(c[2] is True for c in calls[5:] if c[0] == "mode")  # emptied before each window


def test_a_sliced_level_is_one_load_and_reads_each_slice_from_the_server(monkeypatch):
    """bench_all with slices: per level one run_sliced over every (round, mode) in rotated
    order, no window of its own per mode; each result's tokens/s is the slice's server count."""
    schedules = []

    @contextlib.contextmanager
    def server(config, timeout):
        yield "http://x"

    class Models:
        def json(self):
            return {"data": [{"id": "m"}]}

    async def sliced(url, headers, model, prompts, c, settings, schedule):
        schedules.append((c, list(schedule)))
        # round r of mode m: 10 * (r + 1) tokens over 2 s (off) or 4 s (auto)
        return [], [
            C.Slice(r, m, (float(i), i + 1.0), 10.0 * (r + 1), 2.0 if m == "off" else 4.0, None)
            for i, (r, m) in enumerate(schedule)
        ]

    monkeypatch.setattr(P, "running_server", server)
    monkeypatch.setattr(P.httpx, "get", lambda *a, **kw: Models())
    monkeypatch.setattr(P, "operate", lambda *a, **kw: None)
    monkeypatch.setattr(P, "warm_up", lambda *a: None)

    async def fill(*a):
        return None

    monkeypatch.setattr(P, "fill_prefix_cache", fill)
    monkeypatch.setattr(P, "run_sliced", sliced)
    monkeypatch.setattr(P, "run_level", None)  # never a window
    config = {"engine": {"speculative_config": {"method": "ngram"}}}
    settings = S.BenchSettings(
        config, ("off", "auto"), (2,), 1.0, 8, False, 0.001, 5.0, rounds=2, slice=3.0
    )
    results = P.bench_all(settings)
    assert schedules == [(2, [(0, "off"), (0, "auto"), (1, "auto"), (1, "off")])]
    got = [(r.round, r.mode, r.num_completion_tokens, r.wall_time, r.tokens_per_s) for r in results]
    assert got == [
        (0, "off", 10, 2.0, 5.0),
        (0, "auto", 10, 4.0, 2.5),
        (1, "auto", 20, 4.0, 5.0),
        (1, "off", 20, 2.0, 10.0),
    ]


def test_levels_are_sliced_unless_windows_are_asked_for():
    settings, _ = S.parse_args([])
    assert (settings.slice, settings.rounds, settings.is_cold) == (10.0, 6, False)
    windows, _ = S.parse_args(["--slice", "0", "--rounds", "3", "--prefix-cache", "cold"])
    assert (windows.slice, windows.rounds, windows.is_cold) == (0.0, 3, True)
    with pytest.raises(SystemExit):  # a cold cache is emptied between windows; slices have none
        S.parse_args(["--prefix-cache", "cold"])
