"""End to end, speculative decoding under a grammar samples exactly from the masked target.

The law of structured outputs: at every prefix, the target's processed distribution with the
tokens the grammar forbids after that prefix masked out (the mask comes before penalties and
truncation, `engine/sampling/sampler.py`), renormalised. The first 3 generated tokens of 16,000
continuations under a JSON schema follow it (chi-square p > 0.001, tested node by node along the
prefix tree with the helpers of test_spec_distribution.py, tests/token_distribution.py), with
every draft source a grammar request meets: the grammar's own forced text (one-hot drafts, first
in every chain), then a draft model (drafts with a distribution q, itself masked by the state
its drafts reach, so it drafts only what the grammar allows) or n-gram lookup (one-hot, cut where
the grammar forbids a token). Each source verified drafts, kept some and rejected some. Deliberately
broken rules are caught (p < 1e-6, by the chi-square itself, not only by samples outside the
support): verify rows masked with the state before the drafts, and forced text kept without
verification.

The vocabulary is 32 hand-built JSON pieces (tests/tiny_tokenizers.py `json_pieces`), saved
beside the tiny models so the engine loads it; the schema is an object with one enum field.
'{"k": "' is forced, and written as one token, or '{"k"' + ': "', or '{"' + 'k"' + ..., so the
first token has 4 choices and the grammar drafts the rest whenever it was not the whole; the
enum then allows 5 tokens, and after them 1 to 3. The target puts over half its unmasked mass
on tokens the grammar forbids.

Default run (about 2 minutes of one core): temperature 1.0, top_k, top_p and two penalties
spread over the three proposers (7 cases), and the broken rules.

    SPECSERVE_FULL_DIST=1 pytest tests/integration/test_spec_distribution_grammar.py

runs every option with every proposer (15 cases).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import engine.verification.verifier as verifier
from engine import LLM, SamplingParams
from engine.engine import LLMEngine
from engine.structured import StructuredOutput
from engine.structured.masks import TokenMasks, new_masks, unpack_masks
from engine.structured.state import GrammarState
from tests.conftest import build_tiny_model
from tests.integration.test_spec_distribution import (  # the shared run and test settings
    ALPHA,
    ARCH,
    BLOCK_SIZE,
    BROKEN_ALPHA,
    DEPTH,
    FULL,
    GROUP_SIZE,
    MAX_NUM_SEQS,
    NUM_SPEC_TOKENS,
    VOCAB,
    _keep_one_hot_drafts,
    one_thread,  # noqa: F401 (autouse)
)
from tests.tiny_tokenizers import json_pieces
from tests.token_distribution import (
    Prefix,
    TreeTest,
    edit_lm_head,
    prefix_logits,
    processed_probs,
    sample_first_tokens,
    tree_chisquare,
)

NUM_SAMPLES = 16_000
BROKEN_NUM_SAMPLES = 4_000
LM_HEAD_SCALE = 3.0
DRAFT_NOISE = 2.0
SCHEMA = {
    "type": "object",
    "properties": {"k": {"enum": ["a", "ab", "b", "ba", "bb"]}},
    "required": ["k"],
    "additionalProperties": False,
}
STRUCTURED = StructuredOutput.json_schema(SCHEMA)
# Earlier documents: n-gram lookup finds '{"k": "' and drafts the value and the close after it.
PROMPT_TEXT = '{"k": "ab"}, {"k": "b"}, '

OPTIONS = {
    "temperature_1.0": dict(temperature=1.0),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "presence_penalty": dict(temperature=1.0, presence_penalty=1.5),
    "repetition_penalty": dict(temperature=1.0, repetition_penalty=1.8),
}
METHODS = ("draft_model", "ngram", "grammar")
DEFAULT = {
    "draft_model": ("temperature_1.0", "top_k", "repetition_penalty"),
    "ngram": ("top_p", "presence_penalty"),
    "grammar": ("top_k", "repetition_penalty"),
}
CASES = [
    (option, method)
    for method in METHODS
    for option in OPTIONS
    if FULL or option in DEFAULT[method]
]


@dataclass(frozen=True)
class Setup:
    """The models (the tokenizer saved beside each), the prompt, and the target's raw logits
    after the prompt + every prefix."""

    target: Path
    draft: Path
    prompt: list[int]
    raw_logits: dict[Prefix, torch.Tensor]


def _build(path: Path, noise: float = 0.0) -> Path:
    """The tiny model, its LM head sharpened (and noisy for a draft); the tokenizer beside it."""
    build_tiny_model(path, "llama", seed=11, **ARCH)
    edit_lm_head(path, LM_HEAD_SCALE, noise, seed=12)
    json_pieces().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    from transformers import AutoModelForCausalLM

    target = _build(tmp_path_factory.mktemp("grammar-dist-target"))
    # The draft is the target with a noisy head. It drafts under the grammar too (its q is masked
    # by the state its drafts reach), so it is the noise that makes drafts it allows get kept or
    # rejected by min(1, p/q) against the masked target, both often.
    draft = _build(tmp_path_factory.mktemp("grammar-dist-draft"), noise=DRAFT_NOISE)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompt = [1, *json_pieces().encode(PROMPT_TEXT, add_special_tokens=False)]
    assert len(prompt) + DEPTH + 1 <= BLOCK_SIZE
    return Setup(target, draft, prompt, prefix_logits(model, prompt, VOCAB, DEPTH))


def grammar_allowed(engine: LLMEngine, prefixes: Any) -> dict[Prefix, torch.Tensor | None]:
    """prefix -> [VOCAB] bool: the tokens the grammar allows after it, from a fresh state of the
    engine's own compiled grammar that accepted the prefix (None: the grammar forbids it)."""
    compiled = engine.grammars.compile(STRUCTURED)
    allowed: dict[Prefix, torch.Tensor | None] = {}
    for prefix in prefixes:
        state = GrammarState(compiled, VOCAB)
        if not all(state.accept(t) for t in prefix):
            allowed[prefix] = None
            continue
        packed = new_masks(1, VOCAB)
        state.fill_mask(packed, 0)
        allowed[prefix] = unpack_masks(packed, VOCAB)[0]
    return allowed


def _engine(setup: Setup, method: str) -> LLMEngine:
    # "grammar": no speculative config; requests under a grammar still draft its forced text.
    spec: dict[str, object] | None = None
    if method == "draft_model":
        spec = dict(model=str(setup.draft))
    elif method == "ngram":
        spec = dict(prompt_lookup_min=1, prompt_lookup_max=2)
    if spec is not None:
        spec.update(method=method, mode="always", num_speculative_tokens=NUM_SPEC_TOKENS)
    llm = LLM(
        str(setup.target),
        dtype="float32",
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_SEQS * len(setup.prompt),
        max_model_len=2 * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        num_kv_blocks=2 * MAX_NUM_SEQS,
        speculative_config=spec,
    )
    return llm.engine


def _count_by_source(engine: LLMEngine) -> dict[str, list[int]]:
    """source -> [drafts verified, drafts accepted], kept up to date as the engine records."""
    counts: dict[str, list[int]] = {}
    record = engine.spec_stats.record

    def counting(num_draft_tokens: int, num_accepted: int, source: str, num_cut: int = 0):
        if num_draft_tokens:
            count = counts.setdefault(source, [0, 0])
            count[0] += num_draft_tokens
            count[1] += num_accepted
        record(num_draft_tokens, num_accepted, source, num_cut)

    engine.spec_stats.record = counting  # type: ignore[method-assign]
    return counts


def _run_case(
    setup: Setup, option: str, method: str, num_samples: int, first_seed: int
) -> tuple[TreeTest, dict[str, list[int]]]:
    """Sample under the grammar with speculation and test the samples against the masked law.
    An output the grammar ended early (it rejected an emitted token) counts as outside the
    support: the schema's documents are longer than DEPTH tokens."""
    engine = _engine(setup, method)
    counts = _count_by_source(engine)
    params = SamplingParams(**OPTIONS[option], structured=STRUCTURED)
    allowed = grammar_allowed(engine, setup.raw_logits)
    probs = processed_probs(
        setup.raw_logits, setup.prompt, params, engine.eos_token_ids, allowed=allowed
    )
    samples = sample_first_tokens(
        engine,
        params,
        setup.prompt,
        [None],
        num_samples,
        first_seed,
        depth=DEPTH,
        group_size=GROUP_SIZE,
    )
    full = [s for s in samples if len(s) == DEPTH]
    result = tree_chisquare(full, probs)
    num_outside = result.num_outside_support + len(samples) - len(full)
    return replace(result, num_outside_support=num_outside), counts


def _first_seed(option: str, method: str) -> int:
    return (list(OPTIONS).index(option) * len(METHODS) + METHODS.index(method)) * 10**6


def test_the_grammar_shapes_the_law(setup) -> None:
    """The masked law is not trivial: several tokens allowed at most reachable nodes, some
    forbidden at every one, and the unmasked target puts real mass on forbidden tokens."""
    engine = _engine(setup, "grammar")
    allowed = grammar_allowed(engine, setup.raw_logits)
    reachable = [mask for mask in allowed.values() if mask is not None]
    num_allowed = [int(mask.sum()) for mask in reachable]
    assert num_allowed[0] == 4 and len(reachable) > 12  # the root: '{', '{"', '{"k"', '{"k": "'
    assert sum(n >= 2 for n in num_allowed) > len(num_allowed) // 2
    assert max(num_allowed) < VOCAB // 4
    p = setup.raw_logits[()].softmax(dim=0)
    assert float(p[~allowed[()]].sum()) > 0.5


@pytest.mark.parametrize(("option", "method"), CASES)
def test_first_tokens_follow_masked_target_distribution(setup, option, method) -> None:
    result, counts = _run_case(setup, option, method, NUM_SAMPLES, _first_seed(option, method))
    # The grammar drafts its forced text in every case; the configured proposer drafts the rest.
    assert set(counts) == {"grammar", method}, counts
    for source, (num_drafted, num_accepted) in counts.items():
        assert num_drafted >= NUM_SAMPLES // 10, (source, counts)
        assert min(num_accepted, num_drafted - num_accepted) >= num_drafted // 20, counts
    assert result.pvalue > ALPHA, result.describe()


# ----------------------------------------------------------------------- broken rules are caught


def _mask_before_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mask every verify row of a request with its grammar state before the drafts (rows after
    the first then allow what the grammar forbids there, and forbid what it allows)."""
    masks_of = verifier.grammar_masks

    def broken(requests, drafts, starts, vocab_size):
        first = masks_of(requests, [[] for _ in drafts], range(len(drafts)), vocab_size)
        if first is None:
            return None
        row_ids = [starts[i] + j for i in first.row_ids for j in range(len(drafts[i]) + 1)]
        repeats = torch.tensor([len(drafts[i]) + 1 for i in first.row_ids])
        return TokenMasks(row_ids, first.packed.repeat_interleave(repeats, dim=0))

    monkeypatch.setattr(verifier, "grammar_masks", broken)


@pytest.mark.parametrize(
    ("breakage", "option", "method"),
    [
        (_mask_before_drafts, "temperature_1.0", "draft_model"),
        (_mask_before_drafts, "top_p", "ngram"),
        (_keep_one_hot_drafts, "temperature_1.0", "grammar"),
    ],
)
def test_broken_verification_is_caught(monkeypatch, setup, breakage, option, method) -> None:
    """The same test, on a quarter of the samples, rejects each broken rule outright."""
    breakage(monkeypatch)
    first_seed = 10**9 + _first_seed(option, method)
    result, counts = _run_case(setup, option, method, BROKEN_NUM_SAMPLES, first_seed)
    assert counts["grammar"][1] > 0
    assert result.total.pvalue < BROKEN_ALPHA, result.describe()  # the chi-square alone
