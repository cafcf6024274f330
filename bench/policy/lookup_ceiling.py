"""The most n-gram (prompt lookup) drafting can give a workload at one request on this host: the
ceiling the policy's lookup drafts work under.

The workload's requests run greedy through the engine with speculation off, one at a time; every
mode gives these answers (greedy output is lossless, tests/integration prove it). Each answer is
then replayed through the config's n-gram proposer as the engine calls it: at every step the
proposer drafts up to k tokens from the prompt and the answer so far, the draft's prefix that
matches the answer is accepted, and the step appends it and one token more. Every replayed step
is priced at what a verify step of its 1 + k tokens costs on this engine, timed here after the
answers: steps of 1 to K + 1 tokens (a logits row each, as verify steps score them) on a context
of the answers' mean length, the sizes interleaved over --rounds and the median of each taken.
The answer's price at one-token steps over the replay's is the speed-up of drafting k tokens at
every step where lookup finds a match, prefill left out. Two bounds beside the fixed k's:
`oracle`, each step drafting exactly the tokens the answer will accept, up to K (no draft that
fails, which no policy can know), and the share of the answer's tokens that lookup could not have
drafted at all (no earlier occurrence of the last n tokens: a drafter that costs nothing would
still decode those one step each). And `policy`: the engine's own speculation policy in auto
(engine/policy/policy.py: its acceptance estimates, shadow drafts and goodput allocation)
deciding each step's draft length up to K, on a step-time model that holds the timed prices, so
its steps are priced as the fixed k's are and nothing else differs: where the policy stands
between the best fixed k and the oracle on this host's prices.

    python -m bench.policy.lookup_ceiling [--config configs/default.yaml]
        [--workloads code_edit,code_gen] [--max-tokens 96] [--requests 12] [--rounds 15]
        [--num-speculative-tokens K]
        [--out bench/results/lookup-ceiling.json]

--num-speculative-tokens replays up to K drafts a step instead of the config's.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench.common.processes import cpu_isa, host
from bench.policy.offline import WORKLOADS
from engine.core.drafts import Draft, DraftOffer
from engine.core.schedule import Candidate, ScheduledRequest, StepShape
from engine.core.stats import Decision, StepStats, VerifyResult
from engine.drafters.ngram import NgramProposer
from engine.drafters.speculator import shadow_result
from engine.engine import LLMEngine
from engine.policy.calibration import time_step
from engine.policy.policy import SpeculationPolicy
from engine.policy.step_time import StepTimeModel
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

logger = logging.getLogger("bench.policy.lookup_ceiling")
Price = Callable[[int, int], float]  # (tokens in the step, tokens already cached) -> seconds


@dataclass
class _Replayed:
    """What the proposer and the policy read of a request: its id, its tokens so far and its
    sampling parameters (greedy, drafting allowed)."""

    request_id: str
    all_token_ids: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))


@dataclass
class Replay:
    """One drafting rule over a set of answers: engine steps, drafted and accepted tokens, the
    predicted seconds of the steps, and those of the same tokens at one-token steps."""

    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    plain_seconds: float = 0.0
    unmatched: int = 0  # steps where lookup had no draft

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "unmatched_steps": self.unmatched,
            "predicted_speedup": self.speedup,
        }


def replay(
    answers: Sequence[tuple[Sequence[int], Sequence[int]]],
    proposer_factory: Callable[[], NgramProposer],
    k: int,
    price: Price,
    oracle: bool = False,
    policy: SpeculationPolicy | None = None,
) -> Replay:
    """Replay (prompt, answer) pairs through a fresh proposer drafting up to k tokens a step; an
    `oracle` keeps only the draft's prefix that matches, as if it had drafted exactly that; a
    `policy` grants each step's draft length as the engine's does (`policy_decision`). No step
    drafts past the answer's last token."""
    if oracle and policy is not None:
        raise ValueError("a replay follows the oracle or a policy, not both")
    proposer = proposer_factory()
    out = Replay()
    for n, (prompt, answer) in enumerate(answers):
        request = _Replayed(f"replay-{n}", list(prompt))
        done = 0
        while done < len(answer):
            cached = len(request.all_token_ids)
            out.plain_seconds += price(1, cached)
            # no draft past the answer's end: its last token is the step's own
            room = len(answer) - done - 1
            (draft,) = proposer.propose([request], [min(k, room)])  # type: ignore[list-item]
            drafted = list(draft.token_ids) if draft is not None else []
            decision = None
            if policy is not None and drafted:
                decision = policy_decision(policy, request, len(drafted))
                drafted = drafted[: decision.num_draft_tokens]
            accepted = 0
            while (
                accepted < len(drafted)
                and done + accepted < len(answer)
                and drafted[accepted] == answer[done + accepted]
            ):
                accepted += 1
            if oracle:
                drafted = drafted[:accepted]  # nothing drafted that fails
            taken = min(accepted + 1, len(answer) - done)
            out.steps += 1
            out.unmatched += draft is None and room > 0
            out.drafted += len(drafted)
            out.accepted += accepted
            out.tokens += taken
            seconds = price(1 + len(drafted), cached)
            out.seconds += seconds
            if decision is not None:
                assert policy is not None
                assert draft is not None
                step = replayed_step(request, decision, draft, answer[done], accepted, seconds)
                policy.observe(step)
            request.all_token_ids += answer[done : done + taken]
            done += taken
            # the plain price of the tokens taken past the first (one step each)
            for extra in range(1, taken):
                out.plain_seconds += price(1, cached + extra)
        proposer.free(request)  # type: ignore[arg-type]
        if policy is not None:
            policy.forget(request.request_id)
    return out


def policy_decision(policy: SpeculationPolicy, request: _Replayed, num_offered: int) -> Decision:
    """The policy's decision for one step of one request whose lookup offers num_offered tokens:
    a one-sequence decode step, the draft's length its room and the step's budget."""
    candidate = Candidate(request, num_offered, "ngram")  # type: ignore[arg-type]
    (decision,) = policy.decide([candidate], StepShape(1, 1, 0, num_offered, 1))
    return decision


def replayed_step(
    request: _Replayed,
    decision: Decision,
    offered: Draft,
    emitted: int,
    num_accepted: int,
    seconds: float,
) -> StepStats:
    """What the engine feeds the policy after the step: the decision, the verify of its drafts
    (for a draft withheld, the engine's shadow of it against the token the step emits) and the
    forward's seconds, nothing for drafting or overhead (the replay prices neither)."""
    k = decision.num_draft_tokens
    offer = DraftOffer(decision.source, len(offered.token_ids), draft=offered)
    scheduled = ScheduledRequest(request, 1, k, offer)  # type: ignore[arg-type]
    verify = shadow_result(scheduled, emitted) or VerifyResult(
        decision.request_id, decision.source, k, num_accepted
    )
    return StepStats((decision,), (verify,), 1 + k, 1 + k, 0, seconds, 0.0, 0.0)


def timed_policy(measured: dict[int, float], max_k: int) -> SpeculationPolicy:
    """The engine's policy in auto on a step-time model that holds the timed step prices (one
    grid point per step size, learning nothing more), so it decides on what the replay charges."""
    sizes = sorted(measured)
    model = StepTimeModel(sizes, [measured[n] for n in sizes], rate=0.0)
    return SpeculationPolicy("auto", max_k, model)


def lookup_unreachable(answers: Sequence[tuple[Sequence[int], Sequence[int]]], min_n: int) -> float:
    """The share of answer tokens at which the context's last min_n tokens occur nowhere earlier:
    lookup has no draft for them however it drafts."""
    missing = total = 0
    for prompt, answer in answers:
        context = list(prompt)
        seen = {tuple(context[e - min_n : e]) for e in range(min_n, len(context))}
        for token in answer:
            total += 1
            missing += tuple(context[-min_n:]) not in seen
            seen.add(tuple(context[-min_n:]))
            context.append(token)
    return missing / total if total else 0.0


def step_seconds(
    engine: LLMEngine, sizes: Sequence[int], context: int, rounds: int
) -> dict[int, float]:
    """The median over `rounds` of one timed verify-shaped step of each size after `context`
    cached positions, the sizes taking turns within a round (the host's drift falls on all)."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            seconds = time_step(
                engine.runner, engine.block_manager, [n], context, 1, every_row=True
            )
            times[n].append(seconds)
    return {n: statistics.median(values) for n, values in times.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.policy.lookup_ceiling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--workloads", default="code_edit,code_gen")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, default=12, help="per workload, at most")
    parser.add_argument("--rounds", type=int, default=15, help="timings of each step size")
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="the most drafts a step replays"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "lookup-ceiling.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from engine import LLM, SamplingParams
    from engine.text.tokenizer import apply_chat_template

    config = yaml.safe_load(Path(args.config).read_text())["engine"]
    engine_args = dict(config)
    spec = {**engine_args.pop("speculative_config"), "mode": "off"}
    llm = LLM(**engine_args, speculative_config=spec)
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    lookup_max = int(spec.get("prompt_lookup_max", 4))
    lookup_min = int(spec.get("prompt_lookup_min", 2))
    max_k = args.num_speculative_tokens or int(spec.get("num_speculative_tokens", 3))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {}
    for workload in args.workloads.split(","):
        texts = WORKLOADS[workload]()[: args.requests]
        answers = []
        for text in texts:  # one at a time: the answers of one request alone
            prompt = apply_chat_template(tokenizer, [{"role": "user", "content": text}])
            result = llm.generate([prompt], params)[0]
            answers.append((list(result.prompt_token_ids), list(result.outputs[0].token_ids)))
        workloads[workload] = answers
    lengths = [len(p) + len(a) // 2 for answers in workloads.values() for p, a in answers]
    context = sum(lengths) // len(lengths)
    measured = step_seconds(engine, range(1, max_k + 2), context, args.rounds)

    def price(n: int, cached: int) -> float:
        return measured[n]

    def factory() -> NgramProposer:
        return NgramProposer(lookup_max, lookup_min)

    report: dict[str, Any] = {
        "host": host(),
        "cpu_isa": cpu_isa(),
        "config": args.config,
        "num_speculative_tokens": max_k,
        "max_tokens": args.max_tokens,
        "step_context": context,
        "step_seconds": {str(n): seconds for n, seconds in measured.items()},
        "workloads": {},
    }
    for workload, answers in workloads.items():
        fixed = {k: replay(answers, factory, k, price) for k in range(1, max_k + 1)}
        best = max(fixed, key=lambda k: fixed[k].speedup)
        oracle = replay(answers, factory, max_k, price, oracle=True)
        policy = replay(answers, factory, max_k, price, policy=timed_policy(measured, max_k))
        report["workloads"][workload] = {
            "requests": len(answers),
            "answer_tokens": sum(len(a) for _, a in answers),
            "fixed_k": {str(k): r.to_dict() for k, r in fixed.items()},
            "best_fixed_k": best,
            "oracle": oracle.to_dict(),
            "policy": policy.to_dict(),
            "unreachable_share": lookup_unreachable(answers, lookup_min),
        }
        logger.info(
            "%s: best fixed k %d: %.2fx; the policy %.2fx; oracle %.2fx; %.0f%% of tokens beyond "
            "lookup",
            workload,
            best,
            fixed[best].speedup,
            policy.speedup,
            oracle.speedup,
            100 * report["workloads"][workload]["unreachable_share"],
        )
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
