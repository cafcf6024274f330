"""What the sampler returns: greedy rows' argmax without processing, penalties and min_tokens
changing the greedy choice, a seeded row's tokens alone or in a batch, the logprobs and top
logprobs of the processed distribution, and the shapes it refuses."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import _mix
from engine.sampling.reference import process_reference
from engine.sampling.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.unit.sampler_helpers import EOS, _row

# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_is_argmax_and_skips_processing(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(8, 30).to(torch.bfloat16)
    logits[3, 5] = logits[3, 9] = 100.0  # a tie goes to the lowest id
    sampler = Sampler(30, EOS)

    def fail(*args, **kwargs):
        raise AssertionError("the plain greedy path must not process logits")

    monkeypatch.setattr(sampler, "process", fail)
    # Truncation settings do not touch greedy rows, so they need no processing either.
    rows = [_row(SamplingParams(temperature=0.0, top_k=3, min_p=0.5))] * 8
    out = sampler.sample(logits, rows)
    assert torch.equal(out.token_ids, logits.float().argmax(dim=-1))
    assert out.token_ids[3] == 5
    assert out.logprobs is None and out.top_token_ids is None


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    sampler = Sampler(4, EOS)
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.6),
        SamplingParams(temperature=0.0, presence_penalty=0.6),
    ):
        assert sampler.sample(logits, [_row(params, prompt=(0,), output=(1,))]).token_ids == 2
        assert sampler.sample(logits, [_row(params, prompt=(0,), output=())]).token_ids == 1
    # Repetition counts the prompt too; frequency/presence do not.
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    assert sampler.sample(logits, [_row(rep, prompt=(1,), output=())]).token_ids == 2
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    assert sampler.sample(logits, [_row(freq, prompt=(1,), output=())]).token_ids == 1


def test_min_tokens_bans_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7] = 9.0  # EOS
    logits[0, 4] = 8.0  # a stop token id
    logits[0, 1] = 7.0
    sampler = Sampler(10, EOS)

    def greedy(output: tuple[int, ...], ignore_eos: bool = False) -> int:
        params = SamplingParams(
            temperature=0.0, min_tokens=3, stop_token_ids=(4,), ignore_eos=ignore_eos
        )
        return int(sampler.sample(logits, [_row(params, output=output)]).token_ids)

    assert greedy(output=(1, 1)) == 1
    assert greedy(output=(1, 1, 1)) == 7
    assert greedy(output=(1, 1), ignore_eos=True) == 7
    processed = sampler.process(logits, [_row(SamplingParams(min_tokens=1), output=())])
    assert processed[0, 2] == float("-inf") and processed[0, 7] == float("-inf")


# ---- seeds -----------------------------------------------------------------------------------


def _seeded_tokens(seed: int, batch_extra: int, num_steps: int = 6) -> list[int]:
    """Tokens of one seeded row over several steps (its output positions), with `batch_extra`
    other rows around it."""
    params = SamplingParams(temperature=1.0, seed=seed)
    logits = torch.zeros(1 + batch_extra, 200)  # uniform: every draw depends on the noise
    tokens = []
    for step in range(num_steps):
        others = [
            _row(SamplingParams(seed=100 + j), random_key=_mix(100 + j, step))
            if j % 2
            else _row(SamplingParams(top_p=0.9))
            for j in range(batch_extra)
        ]
        rows = [*others[: batch_extra // 2], _row(params, random_key=_mix(seed, step))]
        rows += others[batch_extra // 2 :]
        out = Sampler(200, EOS).sample(logits, rows)
        tokens.append(int(out.token_ids[batch_extra // 2]))
    return tokens


def test_same_seed_same_tokens_alone_or_in_batch() -> None:
    alone = _seeded_tokens(seed=42, batch_extra=0)
    assert _seeded_tokens(seed=42, batch_extra=5) == alone
    assert _seeded_tokens(seed=42, batch_extra=2) == alone
    assert _seeded_tokens(seed=43, batch_extra=5) != alone


# ---- logprobs --------------------------------------------------------------------------------


def test_logprobs_match_processed_log_softmax() -> None:
    torch.manual_seed(0)
    vocab_size = 40
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.3), output=(5,)),
        _row(SamplingParams(top_k=4, logprobs=6)),
        _row(SamplingParams(temperature=0.7, logprobs=0)),
        _row(SamplingParams(top_p=0.5)),
    ]
    logits = torch.randn(4, vocab_size) * 2
    sampler = Sampler(vocab_size, EOS)
    out = sampler.sample(logits, rows)
    expected = torch.log_softmax(sampler.process(logits, rows), dim=-1)
    assert out.logprobs is not None and out.logprobs.shape == (4,)
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.shape == (4, 6) and out.top_logprobs.shape == (4, 6)
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, expected.gather(1, out.top_token_ids))
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    assert torch.equal(out.top_token_ids[:, 0], expected.argmax(dim=-1))
    # The greedy row reports untempered logits with its penalty; top_k=4 leaves -inf after 4.
    greedy = torch.log_softmax(process_reference(logits[0], rows[0], eos_token_ids=EOS), dim=0)
    torch.testing.assert_close(out.top_logprobs[0], greedy.topk(6).values)
    assert torch.isfinite(out.top_logprobs[1, :4]).all()
    assert torch.isneginf(out.top_logprobs[1, 4:]).all()


def test_logprobs_zero_gives_sampled_logprob_only() -> None:
    logits = torch.randn(2, 16)
    rows = [_row(SamplingParams(temperature=0.0, logprobs=0))] * 2
    out = Sampler(16, EOS).sample(logits, rows)
    assert out.top_token_ids is not None and out.top_token_ids.shape == (2, 0)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, dim=-1).amax(dim=-1))


def test_rejects_mismatched_shapes() -> None:
    sampler = Sampler(16, EOS)
    with pytest.raises(ValueError):
        sampler.sample(torch.randn(2, 15), [_row(SamplingParams())] * 2)
    with pytest.raises(ValueError):
        sampler.sample(torch.randn(2, 16), [_row(SamplingParams())])
