"""Batch invariance of the whole CPU forward, on tiny random models in every form the engine
serves on a CPU (float32 and bfloat16 dense weights, GGUF blocks with float32 and with int8
activations): the logits of every position of a request are bit-identical whether it is computed
in one prompt chunk, in chunks of other sizes, token by token, in verify chunks of 1 + k, alone or
beside other requests' decode rows and prompt chunks; and greedy answers given to requests
running together, in mixed steps, with or without speculation, equal each one asked alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams, kernels
from engine.core.chunks import SeqChunk
from tests.conftest import TINY_VOCAB
from tests.gguf_models import build_tiny_gguf_model

pytestmark = pytest.mark.skipif(
    kernels.unavailable_reason() is not None, reason=str(kernels.unavailable_reason())
)

BLOCK = 4
SEQ_LEN = 40  # one request's tokens: a prompt and what it "generated"


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    return build_tiny_gguf_model(tmp_path_factory.mktemp("gguf-invariance"), "llama", seed=3)


# name -> (model fixture, LLM settings)
FORMS = {
    "float32": ("tiny_llama", dict(dtype="float32", quantization="none")),
    "bfloat16": ("tiny_qwen2", dict(dtype="bfloat16", quantization="none")),
    "gguf float32 activations": (
        "gguf_llama",
        dict(dtype="float32", quantization="gguf", gguf_activations="float32"),
    ),
    "gguf int8 activations": (
        "gguf_llama",
        dict(dtype="float32", quantization="gguf", gguf_activations="int8"),
    ),
    "gguf int8 activations, bfloat16": (
        "gguf_llama",
        dict(dtype="bfloat16", quantization="gguf", gguf_activations="int8"),
    ),
}


@pytest.fixture(scope="module", params=list(FORMS))
def llm(request):
    fixture, settings = FORMS[request.param]
    model_dir = request.getfixturevalue(fixture)
    return LLM(str(model_dir), block_size=BLOCK, num_kv_blocks=96, max_model_len=256, **settings)


class _Seq:
    """A sequence of tokens with blocks of its own (scattered: every third block)."""

    def __init__(self, seed: int, first_block: int, block_size: int = BLOCK) -> None:
        rng = random.Random(seed)
        self.token_ids = [rng.randrange(3, TINY_VOCAB) for _ in range(SEQ_LEN)]
        self.table = [first_block + 3 * i for i in range(-(-SEQ_LEN // block_size))]

    def chunk(self, start: int, end: int) -> SeqChunk:
        return SeqChunk(self.token_ids[start:end], start, self.table, num_logits=end - start)


def _logits(llm: LLM, steps: list[list[tuple[_Seq, int, int]]], seq: _Seq) -> torch.Tensor:
    """Run `steps` (each a list of (sequence, start, end) chunks) through the runner, every
    token asking for its logits -> seq's logits [SEQ_LEN, vocab], position by position."""
    runner = llm.engine.runner
    rows: dict[int, torch.Tensor] = {}
    for step in steps:
        logits = runner.forward([s.chunk(start, end) for s, start, end in step])
        row = 0
        for s, start, end in step:
            for position in range(start, end):
                if s is seq:
                    rows[position] = logits[row]
                row += 1
    return torch.stack([rows[p] for p in range(SEQ_LEN)])


def _alone(seq: _Seq, sizes: list[int]) -> list[list[tuple[_Seq, int, int]]]:
    steps, start = [], 0
    for size in sizes:
        steps.append([(seq, start, start + size)])
        start += size
    assert start == SEQ_LEN
    return steps


def test_every_positions_logits_are_the_same_in_every_step_shape(llm):
    check_step_shapes(llm)


def check_step_shapes(llm: LLM, token_by_token: bool = True) -> None:
    """One sequence's logits, every position, through many step shapes: bit-equal to the
    sequence computed in one chunk. The LLM must be idle, with at least 3 * ceil(40 / block
    size) KV blocks. `token_by_token` False leaves out the 40 one-token steps (one-token rows
    are in the other shapes too) where a forward is dear (Triton's interpreter)."""
    assert llm.engine.block_manager.num_used_blocks == 0  # the runner's blocks are ours here
    block_size = llm.engine.config.block_size
    a, b, c = (_Seq(i, i, block_size) for i in range(3))
    reference = _logits(llm, _alone(a, [SEQ_LEN]), a)  # the whole sequence in one chunk
    shapes = {
        "token by token": _alone(a, [1] * SEQ_LEN),
        "chunked prefill": _alone(a, [7, 16, 17]),
        "prefill then verify chunks of 1 + k": _alone(a, [21, 4, 2, 5, 1, 3, 4]),
        # Beside b decoding (its prompt first) and c's prompt arriving in chunks.
        "beside other requests": [
            [(a, 0, 9), (b, 0, 25)],
            [(b, 25, 26), (a, 9, 10), (c, 0, 13)],
            [(c, 13, 30), (a, 10, 14), (b, 26, 27)],
            [(b, 27, 28), (a, 14, 15)],
            [(a, 15, 33), (c, 30, 40), (b, 28, 32)],
            [(b, 32, 33), (a, 33, 40)],
        ],
    }
    if not token_by_token:
        del shapes["token by token"]
    for what, steps in shapes.items():
        assert torch.equal(_logits(llm, steps, a), reference), what


PROMPT_LENS = (3, 11, 26, 9, 17)
MAX_TOKENS = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    # Repetitive prompts, so that n-gram lookup finds drafts.
    return [[rng.randrange(3, 40) for _ in range(n)] for n in PROMPT_LENS]


def _answer(output) -> list[tuple]:
    return [
        (lp.token_id, lp.logprob, lp.top_token_ids, lp.top_logprobs)
        for lp in output.outputs[0].logprobs
    ]


@pytest.mark.parametrize("form", ["float32", "gguf int8 activations"])
def test_greedy_answers_together_equal_each_asked_alone(request, form):
    """Five requests at once, a 6-token step budget forcing steps that mix prompt chunks with
    decode rows, with n-gram speculation or without: each answer equals that request's answer
    when asked alone without speculation, token for token, and so do the logprobs reported
    (bit for bit: they are the logits' own, so a rounding apart would show)."""
    fixture, settings = FORMS[form]
    model_dir = str(request.getfixturevalue(fixture))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    common = dict(block_size=BLOCK, num_kv_blocks=128, max_model_len=256, **settings)
    alone = LLM(model_dir, max_num_seqs=1, **common)
    expected = [_answer(o) for o in alone.generate(_prompts(), params)]
    speculation = {
        "method": "ngram",
        "mode": "always",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
    }
    for extra in (dict(), dict(speculative_config=speculation)):
        together = LLM(model_dir, max_num_batched_tokens=6, **common, **extra)
        got = [_answer(o) for o in together.generate(_prompts(), params)]
        assert got == expected, extra
