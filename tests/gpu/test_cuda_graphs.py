"""CUDA graphs against the eager path on a GPU, with each attention backend that captures
(flash-attn where installed, Triton; skipped without them).

Graphs on and `enforce_eager=True` give the same greedy tokens, with and without speculation,
and a replayed decode or verify step gives the eager step's logits within bfloat16 tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.chunks import SeqChunk
from engine.execution.cuda_graphs import NOT_CAPTURED
from tests.gpu.node import FLASH_BF16, TRITON_BF16, Setup, needs_device

CUDA = torch.device("cuda")

pytestmark = [pytest.mark.gpu, needs_device]
SETUPS = pytest.mark.parametrize("setup", [FLASH_BF16, TRITON_BF16], ids=lambda s: s.backend)

PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [11, 12, 13], list(range(20, 90)), [40, 41] * 9]
NGRAM = {
    "method": "ngram",
    "mode": "always",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
}


def _llm(model, setup: Setup, **overrides) -> LLM:
    # A small explicit KV pool (32 pages of 256 tokens): an unsized pool takes ~0.9 of the card,
    # and the second engine of a test could then not hold one block. max_model_len: the tiny
    # model's 512 positions.
    setup.require(CUDA)
    kwargs = setup.engine_kwargs(CUDA, max_model_len=512, **overrides)
    return LLM(str(model), max_num_seqs=4, **kwargs)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@SETUPS
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["decode", "ngram-verify"])
def test_graphs_give_the_eager_greedy_tokens(tiny_llama, setup, spec):
    graphed = _llm(tiny_llama, setup, speculative_config=spec)
    assert graphed.engine.runner.graphs is not None
    eager = _llm(tiny_llama, setup, speculative_config=spec, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert _greedy(graphed) == _greedy(eager)


@SETUPS
def test_replayed_steps_match_eager_logits(tiny_llama, setup):
    runner = _llm(tiny_llama, setup, speculative_config=NGRAM).engine.runner
    graphs = runner.graphs
    assert graphs is not None
    rng = random.Random(0)
    # Three sequences prefilled eagerly in blocks no request owns (the engine is idle); the
    # first one crosses a block boundary as it grows.
    seqs = {"a": (250, [3, 1]), "b": (9, [0]), "c": (40, [2])}
    for start_len, table in seqs.values():
        prompt = [rng.randrange(3, 300) for _ in range(start_len)]
        runner.forward([SeqChunk(prompt, 0, table, 1)])
    lengths = dict.fromkeys(seqs, 0)
    for lens in ({"a": 1, "b": 1, "c": 1}, {"a": 1, "b": 3, "c": 5}, {"a": 5, "c": 2}):
        chunks = []
        for name, n in lens.items():
            ctx_len, table = seqs[name]
            start = ctx_len + lengths[name]
            chunks.append(SeqChunk([rng.randrange(3, 300) for _ in range(n)], start, table, n))
            lengths[name] += n
        assert graphs.bucket(chunks) is not None
        replayed = graphs.forward(chunks)
        assert replayed is not NOT_CAPTURED and isinstance(replayed, torch.Tensor)
        runner.graphs = None
        try:
            expected = runner.forward(chunks)
        finally:
            runner.graphs = graphs
        assert expected is not None and replayed.shape == expected.shape
        torch.testing.assert_close(replayed.float(), expected.float(), atol=3e-2, rtol=3e-2)


@SETUPS
def test_an_eagle3_head_and_its_tapped_target_replay_graphs(tiny_llama, tmp_path, setup):
    """With an EAGLE-3 head, the target's decode/verify steps replay graphs that keep its taps,
    and the head's extend and chained draft steps replay graphs of their own: greedy tokens
    equal the eager engine's, and both runners replayed."""
    from tests.eagle3_heads import build_tiny_eagle3_head

    head = build_tiny_eagle3_head(tmp_path, tiny_llama, seed=3, aux_layer_ids=[0, 1])
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "mode": "always"}
    graphed = _llm(tiny_llama, setup, speculative_config=spec)
    target, drafter = graphed.engine.runner, graphed.engine.draft_runner
    assert target.graphs is not None and drafter is not None and drafter.graphs is not None
    replays = {"target": 0, "head": 0}

    def counting(name, forward):
        def counted(*args):
            out = forward(*args)
            replays[name] += out is not NOT_CAPTURED
            return out

        return counted

    target.graphs.forward = counting("target", target.graphs.forward)
    drafter.graphs.hidden_states = counting("head", drafter.graphs.hidden_states)
    eager = _llm(tiny_llama, setup, speculative_config=spec, enforce_eager=True)
    assert _greedy(graphed) == _greedy(eager)
    assert replays["target"] > 0 and replays["head"] > 0, replays
    assert graphed.engine.spec_stats.num_draft_tokens > 0
