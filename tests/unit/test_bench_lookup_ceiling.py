"""bench/policy/lookup_ceiling.py's replay: steps, drafts and prices counted as the engine
would."""

from __future__ import annotations

import pytest

from bench.policy import lookup_ceiling as LC
from engine.drafters.ngram import NgramProposer


def _by_tokens(n: int, cached: int) -> float:
    return float(n)  # a step costs its tokens: drafts that fail are paid for


ANSWERS = [([1, 2, 3, 4, 5], [1, 2, 3, 9, 8, 7, 6])]


def test_a_replay_takes_the_matching_prefix_and_one_token_more():
    # (4, 5) and (5, 1) occur nowhere earlier: two plain steps; then (1, 2) drafts 3, 4, 5, of
    # which 3 matches, and the step takes 3 and the answer's 9; (3, 9), (9, 8) are new again and
    # the last token has no room for a draft.
    r = LC.replay(ANSWERS, lambda: NgramProposer(4, 2), 3, _by_tokens)
    assert (r.steps, r.tokens, r.drafted, r.accepted, r.unmatched) == (6, 7, 3, 1, 4)
    assert r.seconds == pytest.approx(1 + 1 + 4 + 1 + 1 + 1)
    assert r.plain_seconds == pytest.approx(7)
    assert r.speedup == pytest.approx(7 / 9)


def test_the_oracle_pays_only_for_what_is_accepted():
    r = LC.replay(ANSWERS, lambda: NgramProposer(4, 2), 8, _by_tokens, oracle=True)
    assert (r.steps, r.drafted, r.accepted) == (6, 1, 1)
    assert r.speedup == pytest.approx(7 / 7)
    # an answer that copies its prompt: two plain steps until (7, 8) recurs, then the rest in one
    copy = [([7, 8, 1, 2, 3, 4, 5, 6], [7, 8, 1, 2, 3, 4, 5, 6])]
    r = LC.replay(copy, lambda: NgramProposer(4, 2), 8, _by_tokens, oracle=True)
    assert (r.steps, r.tokens, r.accepted) == (3, 8, 5)
    assert r.speedup == pytest.approx(8 / (1 + 1 + 6))


def test_a_proposer_gets_the_context_priced_as_cached_tokens():
    seen = []

    def price(n: int, cached: int) -> float:
        seen.append((n, cached))
        return 1.0

    LC.replay(ANSWERS, lambda: NgramProposer(4, 2), 1, price)
    assert (2, 7) in seen  # the third step: a draft of 1 on 7 cached tokens
    assert (1, 8) in seen  # its second token, priced plain on the 8 before it


def test_unreachable_share_counts_tokens_lookup_has_no_draft_for():
    # contexts ending (4, 5), (5, 1), (3, 9), (9, 8), (8, 7) have no earlier copy; (1, 2), (2, 3) do
    assert LC.lookup_unreachable(ANSWERS, 2) == pytest.approx(5 / 7)
    assert LC.lookup_unreachable([([1, 2], [])], 2) == 0.0


def _policy(price, max_k: int):
    return LC.timed_policy({n: price(n, 0) for n in range(1, max_k + 2)}, max_k)


# An answer that copies its 60-token prompt: after two plain steps every lookup draft is right.
COPY = [(list(range(100, 160)), list(range(100, 160)))]


def test_the_policy_grants_every_draft_when_drafts_cost_nothing():
    def flat(n: int, cached: int) -> float:
        return 1.0

    for answers in (ANSWERS, COPY):
        fixed = LC.replay(answers, lambda: NgramProposer(4, 2), 5, flat)
        ruled = LC.replay(answers, lambda: NgramProposer(4, 2), 5, flat, policy=_policy(flat, 5))
        assert ruled.to_dict() == fixed.to_dict()


def test_the_policy_drafts_nothing_when_every_token_costs_a_step():
    policy = _policy(_by_tokens, 5)
    ruled = LC.replay(COPY, lambda: NgramProposer(4, 2), 5, _by_tokens, policy=policy)
    assert (ruled.drafted, ruled.accepted, ruled.steps) == (0, 0, 60)
    assert ruled.speedup == pytest.approx(1.0)


def test_the_policy_learns_from_withheld_drafts_and_then_drafts():
    # A draft token costs 0.6 of a step: at the prior's acceptance (0.5) no draft pays, at 0.9 one
    # does. The copy's withheld drafts are right (shadows), so the policy comes to draft.
    def dear(n: int, cached: int) -> float:
        return 1.0 + 0.6 * (n - 1)

    policy = _policy(dear, 5)
    request = LC._Replayed("fresh", [1, 2, 3])
    assert LC.policy_decision(policy, request, 5).num_draft_tokens == 0
    ruled = LC.replay(COPY, lambda: NgramProposer(4, 2), 5, dear, policy=policy)
    assert ruled.drafted > 0 and ruled.accepted == ruled.drafted
    assert ruled.steps < 60 and ruled.speedup > 1.0
    with pytest.raises(ValueError, match="not both"):
        LC.replay(COPY, lambda: NgramProposer(4, 2), 5, dear, oracle=True, policy=policy)
