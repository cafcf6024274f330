"""Exact distributions of the first generated tokens of a tiny model, and a chi-square test of
sampled continuations against them, and the sampling loop that draws the continuations from an
engine. Used by the end-to-end speculative decoding distribution tests
(tests/integration/test_spec_distribution.py, and test_spec_distribution_grammar.py under a
grammar).

The exact law of the first `depth` tokens is a tree: P(t_1) P(t_2 | t_1) ... Every node's
distribution comes from transformers (the HF model run on prompt + prefix) processed by
`engine.sampling.reference.process_reference` with the prefix as the row's output, so penalties
advance token by token exactly as the engine's contract says (and, under a grammar, with the
tokens the grammar allows after the prefix as the row's mask).

The test is Pearson's chi-square taken node by node (a "sequential" chi-square): for position i
and every observed prefix c of length i - 1, the next-token counts of the n_c samples with that
prefix are, given n_c, multinomial(n_c, P(. | c)). Cells expected below 5 are pooled (smallest
first) so that every bin expects at least 5; a node whose samples fit one bin adds nothing. Given
the prefix counts the nodes are independent, so the summed statistic is asymptotically chi-square
with the summed degrees of freedom. This is the joint test of the whole tree with sparse cells
merged along the tree, which keeps the frequent deep prefixes as separate cells instead of
lumping the whole sparse tail of the joint into one.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2

from engine.outputs import OutputAccumulator
from engine.sampling.reference import process_reference
from engine.sampling.rows import SamplingRow
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.engine import LLMEngine

MIN_EXPECTED = 5.0

Prefix = tuple[int, ...]


def edit_lm_head(path: Path, scale: float, noise: float = 0.0, seed: int = 0) -> None:
    """Rewrite a saved LM head W as scale * (W + noise * std(W) * N(0, 1)). scale > 1 sharpens
    the next-token distributions, so that the first tokens concentrate on fewer prefixes and the
    deep nodes get samples; noise > 0 makes a draft that is close to, but not, the target."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    weight = tensors["lm_head.weight"]
    generator = torch.Generator().manual_seed(seed)
    perturbation = torch.randn(weight.shape, generator=generator) * (noise * float(weight.std()))
    tensors["lm_head.weight"] = scale * (weight + perturbation)
    save_file(tensors, file, metadata={"format": "pt"})


@torch.inference_mode()
def prefix_logits(
    model: torch.nn.Module, prompt_ids: Sequence[int], vocab_size: int, depth: int
) -> dict[Prefix, torch.Tensor]:
    """Raw float32 logits [vocab] of the token after prompt + prefix, for every prefix of length
    < depth, from ONE batched forward over prompt + every prefix of length depth - 1."""
    tails = list(itertools.product(range(vocab_size), repeat=depth - 1))
    ids = torch.tensor([[*prompt_ids, *tail] for tail in tails])  # [num_tails, seq_len]
    logits = model(ids).logits.float()  # [num_tails, seq_len, vocab_size]
    last_prompt = len(prompt_ids) - 1
    out: dict[Prefix, torch.Tensor] = {}
    for row, tail in enumerate(tails):
        for i in range(depth):
            out.setdefault(tail[:i], logits[row, last_prompt + i])
    return out


def processed_probs(
    logits: Mapping[Prefix, torch.Tensor],
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    allowed: Mapping[Prefix, torch.Tensor | None] | None = None,
) -> dict[Prefix, torch.Tensor]:
    """prefix -> float64 [vocab] distribution of the next token after processing with params,
    the prefix being the row's output so far. `allowed` (prefix -> [vocab] bool, a grammar's
    mask; None: no grammar): a prefix mapped to None is one the grammar never lets out, and gets
    all zeros (any sample that reaches it fell outside the support one token earlier)."""
    probs = {}
    for prefix, row_logits in logits.items():
        mask = allowed[prefix] if allowed is not None else None
        if allowed is not None and mask is None:
            probs[prefix] = torch.zeros(row_logits.shape, dtype=torch.float64)
            continue
        row = SamplingRow(params, list(prompt_ids), list(prefix), None)
        processed = process_reference(row_logits, row, eos_token_ids=eos_token_ids, allowed=mask)
        probs[prefix] = processed.double().softmax(dim=0)
    return probs


def sample_first_tokens(
    engine: LLMEngine,
    params: SamplingParams,
    prompt: Sequence[int],
    predictions: Sequence[Sequence[int] | None],
    num_samples: int,
    first_seed: int,
    *,
    depth: int,
    group_size: int,
) -> list[list[int]]:
    """The first `depth` tokens (fewer where an output ended sooner) of num_samples
    continuations: requests of group_size sequences (SamplingParams.n, sequence i of group g
    seeded first_seed + g * group_size + i), in waves of max_num_seqs in flight together. A
    wave steps in lockstep, so most steps have one query length, which the torch attention
    backend runs as one batched call instead of one call per request. Group g predicts
    predictions[g % len(predictions)]; alternate waves stop at depth and at depth + 1 tokens,
    so that the last positions are verified both with a bonus token and with one more draft."""
    assert num_samples % group_size == 0
    samples: list[list[int]] = []
    whole = OutputAccumulator()
    groups_per_wave = engine.config.max_num_seqs // group_size
    num_groups = num_samples // group_size
    for g in range(num_groups):
        group_params = replace(
            params,
            n=group_size,
            seed=first_seed + g * group_size,  # sequence i of the group gets seed + i
            max_tokens=depth + (g // groups_per_wave) % 2,
            ignore_eos=True,
        )
        engine.add_request(
            str(g), list(prompt), group_params, prediction=predictions[g % len(predictions)]
        )
        if (g + 1) % groups_per_wave == 0 or g + 1 == num_groups:
            while engine.has_unfinished_requests():
                for output in whole.add_step(engine.step()):
                    samples.extend(list(c.token_ids[:depth]) for c in output.outputs)
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks == 0
    assert len(samples) == num_samples
    return samples


@dataclass(frozen=True)
class ChiSquare:
    """A chi-square statistic with its degrees of freedom."""

    statistic: float
    dof: int

    @property
    def pvalue(self) -> float:
        return float(chi2.sf(self.statistic, self.dof)) if self.dof > 0 else 1.0

    def __add__(self, other: ChiSquare) -> ChiSquare:
        return ChiSquare(self.statistic + other.statistic, self.dof + other.dof)


@dataclass(frozen=True)
class TreeTest:
    """The sequential chi-square of samples against an exact prefix tree."""

    per_position: tuple[ChiSquare, ...]
    num_outside_support: int  # samples that drew a token of probability 0: an outright failure

    @property
    def total(self) -> ChiSquare:
        return sum(self.per_position, ChiSquare(0.0, 0))

    @property
    def pvalue(self) -> float:
        return 0.0 if self.num_outside_support else self.total.pvalue

    def describe(self) -> str:
        parts = [
            f"t{i + 1}: p={c.pvalue:.3g} (dof {c.dof})" for i, c in enumerate(self.per_position)
        ]
        outside = f"{self.num_outside_support} samples outside the support"
        return f"p={self.pvalue:.3g}; " + ", ".join(parts) + f"; {outside}"


def tree_chisquare(
    samples: Sequence[Sequence[int]], probs: Mapping[Prefix, torch.Tensor]
) -> TreeTest:
    """Test samples (each at least depth tokens long) against probs (every prefix shorter than
    depth -> next-token distribution)."""
    depth = max(len(prefix) for prefix in probs) + 1
    per_position, outside = [], 0
    for i in range(depth):
        by_prefix: dict[Prefix, Counter[int]] = defaultdict(Counter)
        for sample in samples:
            by_prefix[tuple(sample[:i])][sample[i]] += 1
        position = ChiSquare(0.0, 0)
        for prefix, counts in by_prefix.items():
            node, num_outside = _node_chisquare(counts, probs[prefix])
            position, outside = position + node, outside + num_outside
        per_position.append(position)
    return TreeTest(tuple(per_position), outside)


def _node_chisquare(counts: Counter[int], probs: torch.Tensor) -> tuple[ChiSquare, int]:
    """One node: observed next-token counts against n * probs, sparse cells pooled."""
    total = sum(counts.values())
    p = probs.tolist()
    num_outside = sum(c for t, c in counts.items() if p[t] == 0.0)
    cells = sorted((total * q, counts.get(t, 0)) for t, q in enumerate(p) if q > 0.0)
    bins: list[list[float]] = []  # [expected, observed], pooled smallest first
    pending = [0.0, 0.0]
    for expected, observed in cells:
        pending = [pending[0] + expected, pending[1] + observed]
        if pending[0] >= MIN_EXPECTED:
            bins.append(pending)
            pending = [0.0, 0.0]
    if bins:
        bins[-1] = [bins[-1][0] + pending[0], bins[-1][1] + pending[1]]
    statistic = sum((o - e) ** 2 / e for e, o in bins)
    return ChiSquare(statistic, max(len(bins) - 1, 0)), num_outside
