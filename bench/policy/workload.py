"""The workloads of bench/policy/run.py, kept free of I/O so tests can check them (the
measurements of a level: bench/policy/measurements.py; the server's counters:
bench/policy/counters.py).

Workloads (WORKLOADS, by name): code_edit, a function to rewrite with one small change, full code
back (the answer copies most of the prompt, where n-gram drafts shine); open_chat, free-text
questions (where drafts are often wrong); mixed, the two interleaved (the default); code_gen, a
signature and docstring to complete, as in HumanEval (new code: drafts have less to copy than in a
code edit, more than in chat); copy, a passage to repeat word for word and sum up
(bench/drafters.py uses it; the policy bench does not). Request i of a level gets prompt
i mod len(workload), so every mode sees the same requests in the same order.
"""

from __future__ import annotations

# (function source, a local name in it, the name to rename it to)
FUNCTIONS = (
    (
        "def parse_config(path):\n"
        "    settings = {}\n"
        "    with open(path) as f:\n"
        "        for number, line in enumerate(f, start=1):\n"
        "            line = line.strip()\n"
        '            if not line or line.startswith("#"):\n'
        "                continue\n"
        '            if "=" not in line:\n'
        '                raise ValueError(f"line {number}: expected key = value")\n'
        '            key, value = line.split("=", 1)\n'
        "            settings[key.strip()] = value.strip()\n"
        "    return settings\n",
        "settings",
        "options",
    ),
    (
        "def moving_average(values, window):\n"
        "    if window <= 0:\n"
        '        raise ValueError("window must be positive")\n'
        "    result = []\n"
        "    total = 0.0\n"
        "    for index, value in enumerate(values):\n"
        "        total += value\n"
        "        if index >= window:\n"
        "            total -= values[index - window]\n"
        "        if index >= window - 1:\n"
        "            result.append(total / window)\n"
        "    return result\n",
        "total",
        "running_sum",
    ),
    (
        "def merge_intervals(intervals):\n"
        "    ordered = sorted(intervals, key=lambda pair: pair[0])\n"
        "    merged = []\n"
        "    for start, end in ordered:\n"
        "        if merged and start <= merged[-1][1]:\n"
        "            merged[-1][1] = max(merged[-1][1], end)\n"
        "        else:\n"
        "            merged.append([start, end])\n"
        "    return merged\n",
        "ordered",
        "by_start",
    ),
    (
        "def word_counts(text, stop_words):\n"
        "    counts = {}\n"
        "    for word in text.split():\n"
        '        word = word.strip(".,;:!?").lower()\n'
        "        if not word or word in stop_words:\n"
        "            continue\n"
        "        counts[word] = counts.get(word, 0) + 1\n"
        "    return sorted(counts.items(), key=lambda item: -item[1])\n",
        "counts",
        "frequencies",
    ),
)

EDITS = (
    "Rename the variable `{old}` to `{new}`.",
    "Add a docstring that explains what the function does.",
    "Add type hints to the parameters and the return value.",
)

OPEN_CHAT = (
    "Why do cities build roundabouts instead of traffic lights? Explain the trade-offs.",
    "What are the main differences between a process and a thread?",
    "Give me some advice for preparing a talk at a small conference.",
    "How does a bicycle stay upright while it is moving?",
    "What should I consider when choosing between renting and buying a home?",
    "Explain how vaccines train the immune system, for a curious teenager.",
    "What makes a good code review? List what you would look for.",
    "Describe a relaxing weekend trip to the mountains.",
    "Why is the sky blue during the day and red at sunset?",
    "Compare learning the piano and learning the guitar as an adult.",
    "What are the pros and cons of working from home?",
    "How do noise-cancelling headphones work?",
)

# Passages to repeat word for word and then sum up (the answer copies the prompt nearly whole:
# lookup's best case, and the test of whether a model drafter keeps up with it).
PASSAGES = (
    "The old mill by the river ground wheat for the village for almost two hundred years. Its "
    "wheel was turned by water channelled from a weir upstream, and in dry summers the miller "
    "worked at night, when the farms took less water from the stream. After a flood broke the "
    "weir in 1911 the mill ran on a steam engine, and later on electricity, until it closed in "
    "1968. Volunteers restored the wheel in the 1990s, and on the first Sunday of each month it "
    "turns again and grinds flour that is sold in the shop next door.",
    "Octopuses have three hearts and blue blood. Two of the hearts pump blood through the gills, "
    "and the third pumps it around the rest of the body; that one stops beating while the "
    "animal swims, which is one reason octopuses prefer crawling. Their blood carries oxygen "
    "with a copper-based protein called haemocyanin, which works better than iron-based "
    "haemoglobin in cold water with little oxygen, but less well in warm water.",
    "To reset the router, first unplug it from the wall and wait thirty seconds. Plug it back "
    "in and wait until the power light stops blinking, which takes about two minutes. If the "
    "internet light stays red, press and hold the reset button on the back with a paper clip "
    "for ten seconds; this restores the factory settings, so you will need to set the network "
    "name and password again from the label on the bottom of the router.",
    "The committee met on Tuesday and agreed three things. The library will open an hour "
    "earlier on weekdays from the first of March. The budget for new children's books rises by "
    "ten percent, paid for by closing the photocopying room, which few people use. And the "
    "reading group that meets in the back room will move to Thursday evenings, so that the room "
    "is free for homework clubs after school.",
)

# Functions to complete: a signature and a docstring with an example or two, as in HumanEval (the
# answer writes new code, so n-gram lookup finds less to copy than in a code edit).
CODE_GEN = (
    "def is_balanced(text: str) -> bool:\n"
    '    """Whether every bracket in `text` ((), [] and {}) is closed in the right order;\n'
    "    other characters are ignored.\n"
    '    >>> is_balanced("f(a[1], {b: 2})")\n'
    "    True\n"
    '    >>> is_balanced("(]")\n'
    "    False\n"
    '    """\n',
    "def run_length_encode(text: str) -> str:\n"
    '    """Each run of one repeated character as the character followed by the length of\n'
    "    the run.\n"
    '    >>> run_length_encode("aaabccdddd")\n'
    "    'a3b1c2d4'\n"
    '    """\n',
    "def second_largest(numbers: list[int]) -> int | None:\n"
    '    """The second largest distinct value in `numbers`, or None if there is none.\n'
    "    >>> second_largest([4, 1, 4, 3])\n"
    "    3\n"
    "    >>> second_largest([7, 7])\n"
    '    """\n',
    "def chunked(items: list, size: int) -> list[list]:\n"
    '    """Split `items` into consecutive lists of `size` items; the last may be shorter.\n'
    "    Raise ValueError if `size` is not positive.\n"
    "    >>> chunked([1, 2, 3, 4, 5], 2)\n"
    "    [[1, 2], [3, 4], [5]]\n"
    '    """\n',
    "def invert(mapping: dict[str, int]) -> dict[int, list[str]]:\n"
    '    """Map each value of `mapping` to the sorted list of the keys that have it.\n'
    '    >>> invert({"a": 1, "b": 2, "c": 1})\n'
    "    {1: ['a', 'c'], 2: ['b']}\n"
    '    """\n',
    "def digital_root(n: int) -> int:\n"
    '    """Add up the decimal digits of the non-negative `n`, then the digits of the sum,\n'
    "    until one digit is left.\n"
    "    >>> digital_root(9875)\n"
    "    2\n"
    '    """\n',
    "def primes_below(n: int) -> list[int]:\n"
    '    """Every prime number smaller than `n`, in increasing order.\n'
    "    >>> primes_below(20)\n"
    "    [2, 3, 5, 7, 11, 13, 17, 19]\n"
    "    >>> primes_below(2)\n"
    "    []\n"
    '    """\n',
    "def title_case(sentence: str, minor_words: set[str]) -> str:\n"
    '    """Capitalise every word of `sentence` except those in `minor_words`, which are\n'
    "    lower-cased; the first word is always capitalised.\n"
    '    >>> title_case("the lord OF the rings", {"of", "the"})\n'
    "    'The Lord of the Rings'\n"
    '    """\n',
    "def merge_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:\n"
    '    """The counts of `a` and `b` added key by key; keys whose total is zero are left\n'
    "    out.\n"
    '    >>> merge_counts({"x": 2, "y": 1}, {"y": -1, "z": 4})\n'
    "    {'x': 2, 'z': 4}\n"
    '    """\n',
    "def rotate_clockwise(matrix: list[list[int]]) -> list[list[int]]:\n"
    '    """The matrix turned a quarter turn clockwise; `matrix` is left unchanged.\n'
    "    >>> rotate_clockwise([[1, 2, 3], [4, 5, 6]])\n"
    "    [[4, 1], [5, 2], [6, 3]]\n"
    '    """\n',
    "def common_prefix(words: list[str]) -> str:\n"
    '    """The longest string that every word in `words` starts with ("" for no words).\n'
    '    >>> common_prefix(["interview", "internet", "interval"])\n'
    "    'inter'\n"
    '    """\n',
    'def flatten_keys(nested: dict, separator: str = ".") -> dict:\n'
    '    """A flat dict whose keys join the keys of nested dicts with `separator`.\n'
    '    >>> flatten_keys({"a": 1, "b": {"c": 2, "d": {"e": 3}}})\n'
    "    {'a': 1, 'b.c': 2, 'b.d.e': 3}\n"
    '    """\n',
)


def code_edit_prompts() -> list[str]:
    """Every (function, edit) pair: an instruction, the code, and a request for the full code."""
    prompts = []
    for edit in EDITS:
        for code, old, new in FUNCTIONS:
            instruction = edit.format(old=old, new=new)
            prompts.append(
                f"{instruction} Output the full code of the function and nothing else.\n\n"
                f"```python\n{code}```"
            )
    return prompts


def complete_function_prompt(code: str) -> str:
    """The request to complete one function, its signature and docstring given
    (bench/policy/humaneval.py asks HumanEval's problems the same way)."""
    return (
        "Complete the following Python function. Reply with the complete function in one "
        f"```python code block.\n\n```python\n{code}```"
    )


def code_gen_prompts() -> list[str]:
    """Every function of CODE_GEN to complete."""
    return [complete_function_prompt(code) for code in CODE_GEN]


def open_chat_prompts() -> list[str]:
    """The open chat questions alone."""
    return list(OPEN_CHAT)


def copy_prompts() -> list[str]:
    """Every passage of PASSAGES to repeat word for word, then sum up in one sentence."""
    return [
        f"Repeat the following passage word for word, then summarise it in one sentence.\n\n{p}"
        for p in PASSAGES
    ]


def mixed_prompts() -> list[str]:
    """Code edits and open chat, alternating."""
    code, chat = code_edit_prompts(), list(OPEN_CHAT)
    mixed = []
    for i in range(max(len(code), len(chat))):
        mixed += [code[i % len(code)], chat[i % len(chat)]]
    return mixed


WORKLOADS = {
    "mixed": mixed_prompts,
    "code_edit": code_edit_prompts,
    "open_chat": open_chat_prompts,
    "code_gen": code_gen_prompts,
}
