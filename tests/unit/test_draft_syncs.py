"""A draft step reads the device once for all its requests (issue 33, F5).

Reading a CUDA tensor's values on the host (`.tolist()`, `.item()`, `int(t)`, ...) waits for the
device, so the draft model's sampling must not read per request: one read per draft step, however
many requests draft in it. Counted on CPU with a torch function mode that sees every host read
made from Python.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from engine.core.request import Request
from engine.drafters.draft_model import DraftModelProposer
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams

VOCAB = 32
# Tensor methods that hand a tensor's values to Python: each one a device sync on CUDA.
HOST_READS = {"tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__"}


class HostReadCounter(TorchFunctionMode):
    """Counts the host reads of tensor values made from Python while active."""

    def __init__(self) -> None:
        super().__init__()
        self.num_reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            self.num_reads += 1
        return func(*args, **(kwargs or {}))


def _requests(num: int) -> list[tuple[Request, int]]:
    """Half greedy, half sampled with a seed, each granted 3 drafts."""
    requests = []
    for i in range(num):
        greedy = i % 2 == 0
        params = SamplingParams(temperature=0.0 if greedy else 1.0, seed=i, max_tokens=8)
        requests.append((Request(f"r{i}", [1, 2, 3], params, 8), 3))
    return requests


def _draft_step(num: int, min_confidence: float) -> tuple[int, list[str], dict, torch.Tensor]:
    """One draft step's sampling for `num` requests -> (host reads, stopped ids, drafted,
    logits)."""
    proposer = DraftModelProposer(
        None,  # type: ignore[arg-type]  # _sample reads no runner
        Sampler(VOCAB, eos_token_ids=[0]),
        None,  # type: ignore[arg-type]
        min_confidence=min_confidence,
        vocab_size=VOCAB,
    )
    active = _requests(num)
    drafted: dict[str, tuple[list[int], list[torch.Tensor]]] = {
        r.request_id: ([], []) for r, _ in active
    }
    logits = torch.randn(num, VOCAB, generator=torch.Generator().manual_seed(num))  # [num, V]
    with HostReadCounter() as counter:
        stopped = proposer._sample(logits, active, drafted)
    return counter.num_reads, stopped, drafted, logits


def test_a_draft_step_reads_the_device_once_whatever_the_number_of_requests():
    reads_2, *_ = _draft_step(2, min_confidence=0.1)
    reads_16, *_ = _draft_step(16, min_confidence=0.1)
    assert reads_16 == reads_2, f"{reads_2} host reads for 2 requests, {reads_16} for 16"
    assert reads_16 == 1  # the sampler reads nothing; _sample reads ids and flags at once


def test_the_single_read_keeps_the_drafts_and_the_early_exits():
    """Greedy rows draft their argmax; every row carries its sampled id; a request stops
    exactly when the draft gives its own token less than min_confidence."""
    _, stopped, drafted, logits = _draft_step(16, min_confidence=0.1)
    probs = logits.softmax(dim=-1)  # [16, V]
    expected_stopped = []
    for i in range(16):
        ids, dists = drafted[f"r{i}"]
        assert len(ids) == 1 and isinstance(ids[0], int)
        if i % 2 == 0:
            assert ids[0] == int(logits[i].argmax()) and dists == []
        else:
            assert len(dists) == 1 and torch.allclose(dists[0], probs[i])
        if probs[i, ids[0]] < 0.1:
            expected_stopped.append(f"r{i}")
    assert stopped == expected_stopped
    assert 0 < len(stopped) < 16, "the case should exercise both outcomes"
