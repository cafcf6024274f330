"""Tests for the cheap draft sources: n-gram prompt lookup and OpenAI predicted outputs."""

from __future__ import annotations

import random

import pytest

from engine.core.drafts import Draft
from engine.core.request import Request
from engine.drafters.ngram import NgramProposer, index_positions
from engine.drafters.prediction import PredictionProposer
from engine.drafters.registry import PROPOSERS, DrafterContext, make_proposer
from engine.sampling_params import SamplingParams
from engine.speculative_config import METHODS, SpeculativeConfig


def _request(prompt: list[int], output: list[int] = (), request_id: str = "r") -> Request:
    request = Request(request_id, prompt, SamplingParams(), max_tokens=100)
    for token_id in output:
        request.append_token(token_id)
    return request


def _ids(draft: Draft | None) -> list[int] | None:
    return None if draft is None else list(draft.token_ids)


def _propose_one(proposer, request: Request, max_length: int) -> list[int] | None:
    (draft,) = proposer.propose([request], [max_length])
    if draft is not None:
        assert draft.source == proposer.name and draft.probs is None
        assert 1 <= len(draft.token_ids) <= max_length
    return _ids(draft)


def _reference_ngram(token_ids: list[int], max_length: int, max_n: int, min_n: int):
    """Brute force: longest n first, earliest earlier occurrence of the last n tokens."""
    if max_length <= 0:
        return None
    num_tokens = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if n >= num_tokens:
            continue
        suffix = token_ids[-n:]
        for start in range(num_tokens - n):  # excludes the suffix itself
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + max_length]
    return None


# ---------------------------------------------------------------- ngram


def test_registered_by_name() -> None:
    assert {"ngram", "prediction", "draft_model"} <= set(PROPOSERS)
    spec = SpeculativeConfig(method="ngram", prompt_lookup_max=3, prompt_lookup_min=1)
    proposer = make_proposer("ngram", DrafterContext(spec, vocab_size=100))
    assert isinstance(proposer, NgramProposer)
    assert (proposer.prompt_lookup_max, proposer.prompt_lookup_min) == (3, 1)
    prediction = make_proposer("prediction", DrafterContext(None, vocab_size=100))
    assert isinstance(prediction, PredictionProposer)


def test_every_method_a_config_may_name_has_a_factory() -> None:
    # The config checks names against METHODS; the registry builds them: the two agree.
    assert set(METHODS) == set(PROPOSERS)
    with pytest.raises(ValueError, match="unknown speculative method 'suffix'"):
        make_proposer("suffix", DrafterContext(None, vocab_size=100))


@pytest.mark.parametrize("max_n,min_n", [(4, 0), (2, 3), (0, 0)])
def test_ngram_rejects_bad_sizes(max_n: int, min_n: int) -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_max=max_n, prompt_lookup_min=min_n)


def test_ngram_longest_match_wins() -> None:
    # Suffix [3, 4, 5]: the 2-gram [4, 5] first occurs at 0 (-> 90), the 3-gram [3, 4, 5] at 4.
    request = _request([4, 5, 90, 91, 3, 4, 5, 70, 71, 72, 3, 4, 5])
    proposer = NgramProposer(prompt_lookup_max=3, prompt_lookup_min=2)
    assert _propose_one(proposer, request, 3) == [70, 71, 72]
    # With only bigrams allowed the earliest [4, 5] wins.
    assert _propose_one(NgramProposer(2, 2), request, 3) == [90, 91, 3]


def test_ngram_prefers_earliest_occurrence() -> None:
    request = _request([7, 8, 1, 2, 9, 7, 8, 3, 4, 7, 8])
    assert _propose_one(NgramProposer(), request, 2) == [1, 2]


def test_ngram_truncates_at_max_length_and_context_end() -> None:
    request = _request([1, 2, 3, 4, 5, 6, 1, 2])
    proposer = NgramProposer()
    assert _propose_one(proposer, request, 3) == [3, 4, 5]
    assert _propose_one(proposer, request, 1) == [3]
    # [1, 2, 3, 4, 5, 6, 1, 2] + up to 10 tokens: only 6 follow the earlier [1, 2].
    assert _propose_one(proposer, request, 10) == [3, 4, 5, 6, 1, 2]
    # An overlapping occurrence: [5, 5] last seen at 1..2, followed by the suffix's own tokens.
    assert _propose_one(NgramProposer(), _request([5, 5, 5]), 4) == [5]


def test_ngram_matches_inside_generated_part() -> None:
    request = _request([10, 11, 12], output=[20, 21, 22, 23, 30, 20, 21])
    assert _propose_one(NgramProposer(), request, 3) == [22, 23, 30]


def test_ngram_respects_min_and_max() -> None:
    # Only a unigram repeats: nothing with min 2, a draft with min 1.
    request = _request([1, 2, 3, 9, 4, 5, 9])
    assert _propose_one(NgramProposer(4, 2), request, 3) is None
    assert _propose_one(NgramProposer(4, 1), request, 3) == [4, 5, 9]
    # Only a bigram repeats: min 3 finds nothing.
    request = _request([1, 2, 7, 8, 1, 2])
    assert _propose_one(NgramProposer(4, 3), request, 2) is None
    assert _propose_one(NgramProposer(4, 2), request, 2) == [7, 8]
    # The 5-gram [1..5] first occurs before 70, the 4-gram [2..5] already before 60.
    seq = [9, 2, 3, 4, 5, 60, 1, 2, 3, 4, 5, 70, 1, 2, 3, 4, 5]
    assert _propose_one(NgramProposer(5, 2), _request(seq), 1) == [70]
    assert _propose_one(NgramProposer(4, 2), _request(seq), 1) == [60]


def test_ngram_nothing_when_no_match_or_zero_length() -> None:
    proposer = NgramProposer()
    assert _propose_one(proposer, _request(list(range(50))), 4) is None
    assert _propose_one(proposer, _request([1]), 4) is None
    assert _propose_one(proposer, _request([1, 2, 1, 2]), 0) is None
    assert proposer.propose([], []) == []


def test_ngram_batch_keeps_requests_apart() -> None:
    proposer = NgramProposer()
    a = _request([1, 2, 3, 1, 2], request_id="a")
    b = _request([1, 2, 4, 1, 2], request_id="b")
    drafts = proposer.propose([a, b, a], [2, 2, 0])
    assert [_ids(d) for d in drafts] == [[3, 1], [4, 1], None]


@pytest.mark.parametrize("seed", range(6))
def test_ngram_incremental_equals_reference(seed: int) -> None:
    rng = random.Random(seed)
    max_n, min_n = rng.choice([(4, 2), (3, 1), (5, 3), (2, 2)])
    proposer = NgramProposer(max_n, min_n)
    vocab = rng.randint(3, 6)
    request = _request([rng.randrange(vocab) for _ in range(rng.randint(1, 20))])
    num_checked = 0
    while request.num_tokens < 400:
        for _ in range(rng.randint(1, 9)):
            request.append_token(rng.randrange(vocab))
        if rng.random() < 0.1 and request.num_output_tokens:
            # A stop string cut the text; sometimes the same number of different tokens follow.
            num_cut = rng.randint(1, min(12, request.num_output_tokens))
            request.truncate_output(request.num_output_tokens - num_cut)
            for _ in range(rng.choice([0, num_cut])):
                request.append_token(rng.randrange(vocab))
        max_length = rng.randint(0, 7)
        expected = _reference_ngram(request.all_token_ids, max_length, max_n, min_n)
        assert _propose_one(proposer, request, max_length) == expected
        num_checked += expected is not None
    assert num_checked > 20  # the tiny vocabulary makes most steps match


@pytest.mark.parametrize("seed", range(4))
def test_ngram_positions_are_the_same_however_the_tokens_arrive(seed: int) -> None:
    """A prompt at once or a step's few tokens at a time: every n-gram maps to the ends of all
    its copies, in increasing order (a token id itself is the key of a 1-gram)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(300)]
    for n in (1, 2, 4):
        expected: dict = {}
        for end in range(n, len(tokens) + 1):
            key = tokens[end - 1] if n == 1 else tuple(tokens[end - n : end])
            expected.setdefault(key, []).append(end)
        positions: dict = {}
        done = 0
        while done < len(tokens):
            step = rng.choice([1, 2, 5, 16, 40])
            index_positions(positions, tokens, n, done + 1, min(done + step, len(tokens)))
            done = min(done + step, len(tokens))
        assert positions == expected


def test_ngram_rebuilds_after_preemption_style_shortening() -> None:
    proposer = NgramProposer(3, 2)
    request = _request([1, 2, 3, 4], output=[1, 2, 7, 8, 1, 2])
    assert _propose_one(proposer, request, 2) == [3, 4]
    # The output is regenerated differently to the same length: a stale index has no [5, 6].
    request.truncate_output(0)
    for token_id in [5, 6, 1, 2, 5, 6]:
        request.append_token(token_id)
    assert _propose_one(proposer, request, 2) == [1, 2]
    # Only the last token changes (same length again): [2, 5] -> [6] follows, [2, 9] never did.
    request.truncate_output(5)
    request.append_token(9)
    assert _reference_ngram(request.all_token_ids, 2, 3, 2) is None
    assert _propose_one(proposer, request, 2) is None
    # Shorter than before: [1, 2, 3, 4, 5, 6, 1, 2] matches the prompt's [1, 2] again.
    request.truncate_output(4)
    assert _propose_one(proposer, request, 2) == [3, 4]


def test_ngram_free_drops_state() -> None:
    proposer = NgramProposer()
    a, b = _request([1, 2, 1, 2], request_id="a"), _request([3, 4, 3, 4], request_id="b")
    proposer.propose([a, b], [2, 2])
    assert proposer.num_tracked_requests == 2
    proposer.free(a)
    assert proposer.num_tracked_requests == 1
    proposer.free(a)  # freeing twice (or a request never seen) is harmless
    assert proposer.num_tracked_requests == 1
    # A new request reusing the id starts from scratch.
    a2 = _request([5, 6, 7, 5, 6], request_id="a")
    assert _propose_one(proposer, a2, 2) == [7, 5]


# ---------------------------------------------------------------- prediction

PROMPT = [900, 901, 902]


def _predicted_request(prediction: list[int], request_id: str = "p") -> Request:
    request = _request(PROMPT, request_id=request_id)
    request.prediction_token_ids = tuple(prediction)
    return request


def _walk(proposer, request: Request, output: list[int], max_length: int) -> list:
    """Append output one token per step; the draft proposed after each token."""
    drafts = []
    for token_id in output:
        request.append_token(token_id)
        drafts.append(_propose_one(proposer, request, max_length))
    return drafts


def test_prediction_follows_the_prediction() -> None:
    prediction = list(range(100, 120))
    proposer = PredictionProposer()
    request = _predicted_request(prediction)
    assert _propose_one(proposer, request, 4) == [100, 101, 102, 103]
    drafts = _walk(proposer, request, prediction[:18], 4)
    assert drafts[0] == [101, 102, 103, 104]
    assert drafts[15] == [116, 117, 118, 119]
    assert drafts[17] == [118, 119]  # cut at the end of the prediction
    request.append_token(118)
    assert _propose_one(proposer, request, 4) == [119]
    request.append_token(119)
    assert _propose_one(proposer, request, 4) is None  # prediction used up
    assert proposer.pointer(request) == 20


def test_prediction_several_tokens_per_step() -> None:
    prediction = list(range(100, 130))
    proposer = PredictionProposer()
    request = _predicted_request(prediction)
    for token_id in prediction[:7]:  # an accepted draft appends several tokens at once
        request.append_token(token_id)
    assert _propose_one(proposer, request, 5) == [107, 108, 109, 110, 111]


def test_prediction_resyncs_after_replaced_word() -> None:
    prediction = list(range(100, 130))
    output = prediction[:10] + [555] + prediction[11:]  # token 110 replaced
    proposer = PredictionProposer()
    request = _predicted_request(prediction)
    drafts = _walk(proposer, request, output, 3)
    assert drafts[9] == [110, 111, 112]
    assert drafts[10] is None  # [.., 109, 555]: no bigram of the prediction
    assert drafts[11] is None  # [555, 111]: still none
    assert drafts[12] == [113, 114, 115]  # [111, 112] found: re-locked
    assert drafts[20] == [121, 122, 123]


def test_prediction_resyncs_after_inserted_span() -> None:
    prediction = list(range(100, 130))
    output = prediction[:10] + [555, 556, 557] + prediction[10:]
    proposer = PredictionProposer()
    request = _predicted_request(prediction)
    drafts = _walk(proposer, request, output[:15], 3)
    assert drafts[12] is None and drafts[13] is None
    assert drafts[14] == [112, 113, 114]  # [110, 111] found after the insertion
    assert proposer.pointer(request) == 12  # index of 112 in the prediction
    assert _walk(proposer, request, output[15:], 3)[-2] == [129]


def test_prediction_resyncs_after_deleted_span() -> None:
    prediction = list(range(100, 130))
    output = prediction[:10] + prediction[15:]
    proposer = PredictionProposer()
    request = _predicted_request(prediction)
    drafts = _walk(proposer, request, output, 3)
    assert drafts[10] is None  # [109, 115] does not occur
    assert drafts[11] == [117, 118, 119]  # [115, 116] found, skipping the deleted span


def test_prediction_prefers_occurrence_after_pointer_and_longer_matches() -> None:
    # [1, 2] occurs at 0..2 (before the pointer) and at 7..9 (after it).
    prediction = [1, 2, 10, 11, 12, 13, 14, 1, 2, 20, 21]
    proposer = PredictionProposer()
    request = _predicted_request(prediction)
    _walk(proposer, request, [1, 2, 10, 11, 99, 1, 2], 2)
    assert proposer.pointer(request) == 9
    assert _propose_one(proposer, request, 2) == [20, 21]
    # [5, 1, 2] only matches the earlier copy: the longer match wins over the position.
    prediction = [5, 1, 2, 10, 11, 12, 13, 1, 2, 20, 21]
    request = _predicted_request(prediction, request_id="q")
    _walk(proposer, request, [5, 1, 2, 10, 11, 99, 5, 1, 2], 2)
    assert _propose_one(proposer, request, 2) == [10, 11]
    # Nothing after the pointer: the closest occurrence before it wins.
    prediction = [1, 2, 30, 1, 2, 40, 50, 60, 70]
    request = _predicted_request(prediction, request_id="s")
    _walk(proposer, request, [1, 2, 30, 1, 2, 40, 50, 99, 1, 2], 2)
    assert _propose_one(proposer, request, 2) == [40, 50]


def test_prediction_nothing_when_output_diverges_completely() -> None:
    proposer = PredictionProposer()
    request = _predicted_request(list(range(100, 140)))
    drafts = _walk(proposer, request, list(range(500, 530)), 4)
    assert drafts == [None] * 30
    assert proposer.pointer(request) is None


def test_prediction_ignores_prompt_tokens_when_resyncing() -> None:
    # The prompt's last token and the first output token form a prediction bigram [902, 7];
    # only output tokens count, so a single diverged output token cannot re-lock.
    proposer = PredictionProposer()
    request = _predicted_request([1, 902, 7, 8, 9])
    assert _walk(proposer, request, [7], 2) == [None]


def test_prediction_empty_or_zero_length() -> None:
    proposer = PredictionProposer()
    request = _request(PROMPT, output=[1, 2])
    assert _propose_one(proposer, request, 4) is None
    assert proposer.num_tracked_requests == 0
    request = _predicted_request([1, 2, 3])
    assert _propose_one(proposer, request, 0) is None


@pytest.mark.parametrize("seed", range(4))
def test_prediction_incremental_equals_from_scratch(seed: int) -> None:
    rng = random.Random(seed)
    prediction = [rng.randrange(8) for _ in range(200)]
    proposer = PredictionProposer()
    request = _predicted_request(prediction)
    # An output that copies spans of the prediction with edits, skips and repeats between them.
    num_synced = 0
    while request.num_output_tokens < 200:
        start = rng.randrange(len(prediction))
        span = prediction[start : start + rng.randint(1, 15)] + [rng.randrange(8)]
        for i in range(0, len(span), 9):
            for token_id in span[i : i + rng.randint(1, 9)]:
                request.append_token(token_id)
            if rng.random() < 0.1:
                request.truncate_output(max(0, request.num_output_tokens - rng.randint(1, 5)))
            max_length = rng.randint(1, 6)
            draft = _propose_one(proposer, request, max_length)
            fresh = _predicted_request(prediction, request_id="fresh")
            for token_id in request.output_token_ids:
                fresh.append_token(token_id)
            assert _propose_one(PredictionProposer(), fresh, max_length) == draft
            num_synced += draft is not None
    assert num_synced > 10


def test_prediction_free_drops_state() -> None:
    proposer = PredictionProposer()
    request = _predicted_request([1, 2, 3, 4])
    request.append_token(1)
    assert _propose_one(proposer, request, 2) == [2, 3]
    proposer.free(request)
    assert proposer.num_tracked_requests == 0
    assert proposer.pointer(request) is None
