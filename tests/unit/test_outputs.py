"""OutputAccumulator adds a request's deltas up into its whole output; an aborted request's last
output carries nothing new."""

from __future__ import annotations

from engine.core.counters import SpecStats
from engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput, TokenLogprob


def _delta(
    request_id: str, pieces: list[tuple[str, list[int], str | None]], finished: bool = False
) -> RequestOutput:
    """One output: per completion (text, token ids, finish reason)."""
    completions = [
        CompletionOutput(
            index=i,
            text=text,
            token_ids=ids,
            logprobs=[TokenLogprob(t, -0.5) for t in ids],
            finish_reason=reason,
            num_output_tokens=10 * (i + 1),
            spec_stats=SpecStats(num_drafts=i + 1) if reason else None,
        )
        for i, (text, ids, reason) in enumerate(pieces)
    ]
    return RequestOutput(request_id, "p", [1, 2], completions, finished)


def test_accumulator_adds_deltas_up_once_finished():
    accumulator = OutputAccumulator()
    steps = [
        _delta("a", [("Hel", [5, 6], None), ("", [7], None)]),
        _delta("b", [("other", [9], None)]),
        _delta("a", [("lo", [8], None), ("Yes", [3, 4], "stop")]),
        _delta("a", [("!", [1], "length"), ("", [], "stop")], finished=True),
    ]
    wholes = [accumulator.add(step) for step in steps]
    assert wholes[:3] == [None, None, None]
    whole = wholes[3]
    assert whole is not None and whole.finished and whole.request_id == "a"
    first, second = whole.outputs
    assert (first.text, first.token_ids, first.finish_reason) == ("Hello!", [5, 6, 8, 1], "length")
    assert [e.token_id for e in first.logprobs] == first.token_ids
    assert (second.text, second.token_ids, second.finish_reason) == ("Yes", [7, 3, 4], "stop")
    # The counts and counters come from the finishing output.
    assert (first.num_output_tokens, second.num_output_tokens) == (10, 20)
    assert (first.spec_stats.num_drafts, second.spec_stats.num_drafts) == (1, 2)
    # A finished request is forgotten: its id may come again.
    again = accumulator.add(_delta("a", [("x", [2], "stop"), ("", [], "stop")], finished=True))
    assert again is not None and again.outputs[0].token_ids == [2]
    (other,) = accumulator.add_step([_delta("b", [("", [], "stop")], finished=True)])
    assert (other.request_id, other.outputs[0].text) == ("b", "other")


def test_aborted_output_adds_nothing_and_keeps_earlier_finishes():
    last = _delta("a", [("Hi", [5], None), ("Yes", [3], "stop")])
    ending = last.aborted()
    assert ending.finished and not last.finished
    assert [c.finish_reason for c in ending.outputs] == ["abort", "stop"]
    assert all(c.text == "" and c.token_ids == [] and c.logprobs == [] for c in ending.outputs)
    assert [c.num_output_tokens for c in ending.outputs] == [10, 20]
