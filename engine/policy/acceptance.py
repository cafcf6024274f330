"""Per-request acceptance estimates: how likely a request's next draft token is to be accepted.

alpha is the probability that a drafted token is accepted given every earlier one was; a verify of
k drafts then emits E(alpha, k) tokens (the accepted ones plus the recovered or bonus token).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# Acceptance per draft source before a request has any history: lookups of a prompt's n-grams hit
# about half the time on code and chat, a draft model of the same family more often, and a
# client's prediction (an edit of its own text) most of the time.
DEFAULT_PRIORS: Mapping[str, float] = {
    "ngram": 0.5,
    "draft_model": 0.6,
    "eagle3": 0.6,
    "prediction": 0.8,
    "grammar": 0.9,
}
# Each verify multiplies a request's past evidence by this (an EWMA over about 10 verifies), so a
# request whose text turns predictable, or stops being so, is followed.
ACCEPTANCE_DECAY = 0.9
# Pseudo-trials at the prior: two verifies' worth, so the first real ones move alpha quickly.
PRIOR_WEIGHT = 2.0
# A draft model's requests are judged by alpha plus this many standard errors (optimism under
# uncertainty: they learn only by drafting).
OPTIMISM = 1.0
# A pooled method's (a model drafter's) new request starts from what the method's drafts achieved
# on the engine's recent requests, weighted as POOLED_PRIOR_WEIGHT pseudo-trials (evidence, so
# more than PRIOR_WEIGHT's guess), once the pool holds POOL_MIN_TRIALS trials. The start is a
# start only: each of the request's own verifies halves the pool's weight (POOL_FADE) and hands it
# to the fixed prior, so a request with a few verifies is judged by its own evidence as before.
# The pool fades by POOL_DECAY per engine step: a method left idle for a few hundred steps starts
# its requests from the fixed prior again (and so tries them).
POOLED_PRIOR_WEIGHT = 8.0
POOL_FADE = 0.5
POOL_MIN_TRIALS = 10.0
POOL_DECAY = 0.995


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify of k drafts emits: Σ_{j=0..k} alpha^j = (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class AcceptanceTracker:
    """Per-request acceptance estimate alpha: a decayed maximum-likelihood estimate with a prior.

    A verify of k drafts that accepts a of them is a truncated geometric draw: positions 1..a
    passed, position a+1 failed if a < k, and positions past the first failure were never tested.
    Its likelihood is alpha^a (1 - alpha)^[a < k], so the MLE over many verifies is
    Σ accepted / (Σ accepted + Σ [a < k]). Plain accepted / drafted would count the untested
    positions as failures and read far low (alpha = 0.6 with k = 5 gives 0.28). Both sums decay by
    `decay` per verify (an EWMA, so a request whose text turns predictable is followed), and
    `prior_weight` pseudo-trials at the method's prior keep alpha inside (0, 1) and give a request
    with no history a sensible start.

    A draft model's estimate moves only when its request drafts, so the policy judges it by
    `upper_bound`, alpha plus `optimism` standard errors: judged by alpha alone, a request whose
    prior says "does not pay" would never draft and never learn otherwise (a draft model whose
    code-edit drafts are mostly accepted stayed off for whole answers at a prior of 0.6). The
    bound is wide while a request has few trials, so it is tried on its first steps, and narrows
    as its verifies come in: its width counts every trial the request has had, not the decayed
    sums alpha is read from (those hold about ten verifies' worth whatever the request's age, so
    a width read from them stopped narrowing at about 0.14 and kept a draft model whose drafts
    were kept about 58% of the time judged at 0.72, past its break-even, for whole answers).
    A lookup's estimate also learns while its request is paused (shadow
    drafts, engine/core/stats.py), so the policy judges it by `alpha`.

    The fixed prior plus that bound tries every new request (0.6 with two pseudo-trials reads
    0.95), which costs where a drafter keeps few of its drafts and requests are short: a cell of
    64-token requests at 4 clients was mostly such first tries. So for the methods in `pooled`
    a new request starts from the method's pool, the verifies of the engine's recent requests
    (POOLED_PRIOR_WEIGHT pseudo-trials at their estimate), which fades into the fixed prior as the
    request's own verifies arrive (see POOL_FADE); `tick` fades the pool once per engine step.
    """

    def __init__(
        self,
        priors: Mapping[str, float] = DEFAULT_PRIORS,
        decay: float = ACCEPTANCE_DECAY,
        prior_weight: float = PRIOR_WEIGHT,
        optimism: float = OPTIMISM,
        pooled: frozenset[str] = frozenset(),
    ) -> None:
        if not 0.0 < decay <= 1.0 or prior_weight <= 0.0 or optimism < 0.0:
            raise ValueError("need 0 < decay <= 1, prior_weight > 0 and optimism >= 0")
        self.priors = dict(priors)
        self.decay = decay
        self.prior_weight = prior_weight
        self.optimism = optimism
        # id -> (method, accepted, trials, verifies, every trial undecayed)
        self._state: dict[str, tuple[str, float, float, int, float]] = {}
        # method -> (accepted, trials) over the engine's recent requests, for the pooled methods
        self._pool: dict[str, tuple[float, float]] = {m: (0.0, 0.0) for m in pooled}

    def observe(
        self, request_id: str, method: str, num_draft_tokens: int, num_accepted: int
    ) -> None:
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted} of {num_draft_tokens} drafts")
        if num_draft_tokens == 0:
            return
        _, accepted, trials, verifies, seen = self._state.get(
            request_id, (method, 0.0, 0.0, 0, 0.0)
        )
        is_rejected = num_accepted < num_draft_tokens
        accepted = self.decay * accepted + num_accepted
        trials = self.decay * trials + num_accepted + is_rejected
        seen += num_accepted + is_rejected
        self._state[request_id] = (method, accepted, trials, verifies + 1, seen)
        if method in self._pool:
            pool_accepted, pool_trials = self._pool[method]
            self._pool[method] = (
                pool_accepted + num_accepted,
                pool_trials + num_accepted + is_rejected,
            )

    def tick(self) -> None:
        """One engine step has passed: the pools fade by POOL_DECAY."""
        for method, (accepted, trials) in self._pool.items():
            self._pool[method] = (POOL_DECAY * accepted, POOL_DECAY * trials)

    def _prior(self, method: str, verifies: int) -> tuple[float, float]:
        """(pseudo-accepted, pseudo-trials) a request with `verifies` own verifies starts from:
        the fixed prior's, or while its method's pool holds enough trials, the pool's estimate
        with a weight that halves per own verify and is handed to the fixed prior."""
        fixed = self.priors[method]
        accepted, trials = self._pool.get(method, (0.0, 0.0))
        if trials < POOL_MIN_TRIALS:
            return self.prior_weight * fixed, self.prior_weight
        share = POOL_FADE**verifies  # of the start still the pool's
        pooled = share * POOLED_PRIOR_WEIGHT
        kept = (1.0 - share) * self.prior_weight
        return pooled * accepted / trials + kept * fixed, pooled + kept

    def _estimate(self, request_id: str, method: str) -> tuple[float, float]:
        """(alpha, every trial the request has had, undecayed, plus the prior's pseudo-trials)."""
        _, accepted, trials, verifies, seen = self._state.get(
            request_id, (method, 0.0, 0.0, 0, 0.0)
        )
        pseudo_accepted, pseudo_trials = self._prior(method, verifies)
        return (accepted + pseudo_accepted) / (trials + pseudo_trials), seen + pseudo_trials

    def alpha(self, request_id: str, method: str) -> float:
        """The estimate for a request; its method's prior (or pool) when it has no history yet."""
        return self._estimate(request_id, method)[0]

    def upper_bound(self, request_id: str, method: str) -> float:
        """alpha plus `optimism` standard errors of it over every trial the request has had
        (undecayed) and the prior's: what the policy decides by (see the class docstring)."""
        alpha, seen = self._estimate(request_id, method)
        error = math.sqrt(alpha * (1.0 - alpha) / seen)
        return min(1.0, alpha + self.optimism * error)

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
