"""bench/policy/workload.py: the workloads' prompts, distinct, and the code each one carries."""

from __future__ import annotations

from bench.policy import workload as W


def test_workloads_are_distinct_and_code_edits_carry_their_code():
    code, mixed = W.code_edit_prompts(), W.mixed_prompts()
    assert len(code) == len(W.FUNCTIONS) * len(W.EDITS) == len(set(code))
    for source, old, new in W.FUNCTIONS:
        assert old in source and new not in source
        assert sum(source in p for p in code) == len(W.EDITS)
        assert any(f"`{old}` to `{new}`" in p and source in p for p in code)
    assert mixed[0::2] == code and mixed[1::2][: len(W.OPEN_CHAT)] == list(W.OPEN_CHAT)


def test_open_chat_and_code_gen_are_workloads_of_their_own():
    assert list(W.WORKLOADS) == ["mixed", "code_edit", "open_chat", "code_gen"]
    chat, gen = W.WORKLOADS["open_chat"](), W.WORKLOADS["code_gen"]()
    assert chat == list(W.OPEN_CHAT) and len(chat) == len(set(chat)) > 0
    assert len(gen) == len(W.CODE_GEN) == len(set(gen)) >= 10
    assert not set(gen) & set(W.mixed_prompts())  # new prompts, not in mixed
    names = set()
    for code, prompt in zip(W.CODE_GEN, gen, strict=True):
        assert prompt == W.complete_function_prompt(code)
        assert prompt.endswith(f"```python\n{code}```") and code.startswith("def ")
        assert code.rstrip().endswith('"""') and ">>> " in code  # a docstring with an example
        names.add(code[4 : code.index("(")])
        compile(code + "    pass\n", "<code_gen>", "exec")  # a signature Python accepts
    assert len(names) == len(W.CODE_GEN)  # every function a different one
