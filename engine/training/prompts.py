"""Prompts the project can ship for training a head: code tasks over functions of Python's own
standard library (its source is on every machine that runs specserve, under the PSF license) and
open-chat questions written here. The responses are the target's own, generated when the trainer
runs (engine/training/eagle3_data.py).

    python -m engine.training.prompts --out prompts.jsonl [--num 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
import textwrap
from pathlib import Path

# Modules of plain, readable Python whose functions make good code tasks.
MODULES = (
    "bisect", "calendar", "colorsys", "difflib", "fnmatch", "fractions", "heapq", "html",
    "ipaddress", "json.decoder", "json.encoder", "ntpath", "posixpath", "pprint", "quopri",
    "shlex", "statistics", "string", "textwrap", "tokenize", "urllib.parse", "uuid", "base64",
    "csv", "glob", "gzip", "configparser", "dataclasses", "functools", "graphlib", "operator",
)  # fmt: skip

CODE_TASKS = (
    "Explain what this Python function does, step by step:\n\n```python\n{code}\n```",
    "Add type hints and a docstring to this function:\n\n```python\n{code}\n```",
    "Write pytest tests for this function:\n\n```python\n{code}\n```",
    "Rewrite this function to be shorter and clearer, keeping its behaviour:\n\n"
    "```python\n{code}\n```",
    "Find a bug or an edge case this function mishandles, and fix it:\n\n```python\n{code}\n```",
    "Rename the variables of this function to be more descriptive and return the whole "
    "function:\n\n```python\n{code}\n```",
    "Complete the body of this function:\n\n```python\n{signature}\n    {docstring}\n```",
)

CHAT_TOPICS = (
    "how a hash map handles collisions", "what a race condition is", "the CAP theorem",
    "how TCP differs from UDP", "what a B-tree is used for", "how garbage collection works",
    "why floating point sums depend on order", "what a closure is in Python",
    "how HTTPS keeps a connection private", "what dynamic programming is",
    "how a compiler differs from an interpreter", "what a mutex protects",
    "how git stores history", "what Big-O notation measures", "how DNS resolves a name",
    "what a Python generator is", "how recursion can be turned into iteration",
    "what unit tests and integration tests each catch", "how caching can go wrong",
    "what an index does in a database", "how public-key cryptography works",
    "what the GIL is", "how a load balancer decides", "what idempotency means for an API",
    "how regular expressions are matched", "what virtual memory is",
    "how to choose between a list and a set", "what a REST API is",
    "how to profile slow Python code", "what makes code readable",
)  # fmt: skip
CHAT_FORMS = (
    "Explain {topic} to a new programmer.",
    "Give a short example that shows {topic}.",
    "What are the common mistakes around {topic}?",
    "Summarise {topic} in five bullet points.",
)


def code_snippets(max_lines: int = 40) -> list[tuple[str, str, str]]:
    """(source, signature line, docstring line) of stdlib functions of 5 to max_lines lines."""
    found = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in sorted(vars(module).items()):
            if not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            try:
                source = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            lines = source.splitlines()
            if not 5 <= len(lines) <= max_lines or not lines[0].startswith("def "):
                continue
            doc = (inspect.getdoc(obj) or f"{obj.__name__}.").splitlines()[0]
            found.append((source, lines[0], f'"""{doc}"""'))
    return found


def build_prompts(num: int, seed: int = 0) -> list[dict[str, object]]:
    """`num` chat examples, about three code tasks to one open-chat question, in a seeded
    order; each is {"messages": [{"role": "user", "content": ...}]}."""
    rng = random.Random(seed)
    snippets = code_snippets()
    rng.shuffle(snippets)
    chats = [form.format(topic=t) for t in CHAT_TOPICS for form in CHAT_FORMS]
    rng.shuffle(chats)
    prompts: list[str] = []
    for i in range(num):
        if i % 4 == 3 and chats:
            prompts.append(chats[(i // 4) % len(chats)])
        else:
            source, signature, doc = snippets[i % len(snippets)]
            task = CODE_TASKS[rng.randrange(len(CODE_TASKS))]
            prompts.append(task.format(code=source.rstrip(), signature=signature, docstring=doc))
    return [{"messages": [{"role": "user", "content": p}]} for p in prompts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(p) for p in build_prompts(args.num, args.seed)]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
