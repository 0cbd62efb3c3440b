"""How many tokens to draft for one sequence next step: chosen from its own recent acceptance.

Each sequence keeps decayed counts of draft tokens that the target checked and accepted. With a
per-token acceptance rate a, drafting K tokens yields (1 - a^(K+1)) / (1 - a) tokens for a step
that costs 1 + K * (draft cost + verify cost) of the sequence's share of a plain step; K is the value
that maximises tokens per cost (0: plain decoding).

The verify cost is not a constant: it is what one more row adds to a step, against one sequence's
share of that step. `StepCost` fits the engine's own step times as fixed + per_row * rows, so at batch
1 on a CPU a row costs 0.04-0.06 of a step (the step reads the weights; rows ride along), while in an
8-sequence step it costs a quarter to a half of a sequence's share, and only high acceptance pays.

A sequence whose K fell to 0 tries again (K = 1) after `probe_every` steps, so speculation comes back
when the text turns repetitive, unless drafting would gain less than 10% even at an acceptance rate
of 0.9 (a draft model nearly as costly as the target, or a batch so big that rows are dear): then it
is not probed, since each probe would also pay for the draft's catch-up.
"""
from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.8          # weight of the past per verification (about the last 5 steps count)
_PRIOR_CHECKED = 2.0  # a new sequence starts as if 2 drafts were checked ...
_PRIOR_ACCEPTED = 1.4  # ... and 1.4 accepted (rate 0.7): optimistic, so speculation is tried
_HIGH_RATE = 0.9       # a proposer that would not pay off at this acceptance is never probed


@dataclass(frozen=True, slots=True)
class SpecPolicy:
    max_tokens: int            # K at most (--num-speculative-tokens)
    draft_cost: float          # one drafted token, in target decode steps (the proposer's cost_per_token)
    probe_every: int = 16      # steps between retries once K fell to 0
    adaptive: bool = True      # False: always K = max_tokens

    def can_pay_off(self, verify_cost: float) -> bool:
        """Whether drafting would gain at least 10% even at a 0.9 acceptance rate."""
        return not self.adaptive or self._best(_HIGH_RATE, verify_cost)[1] >= 1.1

    def best_k(self, rate: float, verify_cost: float) -> int:
        return self.max_tokens if not self.adaptive else self._best(rate, verify_cost)[0]

    def _best(self, rate: float, verify_cost: float) -> tuple[int, float]:
        """The K with the most tokens per cost at this acceptance rate, and that ratio (K = 0: 1)."""
        best_k, best_value = 0, 1.0
        per_token = self.draft_cost + verify_cost
        for k in range(1, self.max_tokens + 1):
            expected = k + 1.0 if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)
            value = expected / (1.0 + k * per_token)
            if value > best_value * 1.02:     # a K must beat the one below it clearly
                best_k, best_value = k, value
        return best_k, best_value


@dataclass(slots=True)
class SpecState:
    """One sequence's acceptance history (engine thread only)."""
    checked: float = _PRIOR_CHECKED      # decayed count of drafts the target judged
    accepted: float = _PRIOR_ACCEPTED    # decayed count of those it accepted
    idle_steps: int = 0                  # steps since K last was > 0

    @property
    def rate(self) -> float:
        return self.accepted / self.checked if self.checked > 0 else 0.0

    def next_k(self, policy: SpecPolicy, verify_cost: float) -> int:
        """K for the next step; `verify_cost` from StepCost.verify_cost at the step's size."""
        k = policy.best_k(self.rate, verify_cost)
        if k > 0 or not policy.adaptive or not policy.can_pay_off(verify_cost):
            return k
        self.idle_steps += 1
        if self.idle_steps >= policy.probe_every:
            self.idle_steps = 0
            return 1
        return 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """A verification: drafts are checked in order until the first rejection."""
        if num_proposed <= 0:
            return
        judged = num_accepted + (1 if num_accepted < num_proposed else 0)
        self.checked = self.checked * _DECAY + judged
        self.accepted = self.accepted * _DECAY + num_accepted
        self.idle_steps = 0


class StepCost:
    """The engine's step time as fixed + per_row * rows, fitted online by decayed least squares.

    `verify_cost(rows)` is what one more row adds to a step of `rows` rows, in units of one row's share
    of it: per_row * rows / (fixed + per_row * rows). Until the steps seen vary enough in size to fit
    the slope, the ratio per_row / fixed is the prior (0.06: SmolLM2 in fp32 on a 2-core CPU at batch 1,
    docs/benchmarks.md).
    """

    def __init__(self, prior_row_ratio: float = 0.06, decay: float = 0.99) -> None:
        self.prior_row_ratio = prior_row_ratio
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def fit(self) -> tuple[float, float]:
        """(fixed, per_row) seconds; the prior's shape scaled to the mean step when the slope is unknown."""
        if self._w == 0.0:
            return 1.0, self.prior_row_ratio
        line = self._line(min_variance=1.0)
        if line is not None:
            return line
        mean_x, mean_y = self._x / self._w, self._y / self._w
        fixed = mean_y / (1.0 + self.prior_row_ratio * mean_x)
        return fixed, fixed * self.prior_row_ratio

    def per_row_seconds(self, min_variance: float = 16.0) -> float | None:
        """The fitted seconds one more row adds to a step, when the steps seen spread their row counts
        (variance at least `min_variance`) and the fit is sound; None otherwise (never the prior)."""
        line = self._line(max(1.0, min_variance))
        return None if line is None else line[1]

    def _line(self, min_variance: float) -> tuple[float, float] | None:
        """(fixed, per_row) by least squares, when the row counts' variance is at least `min_variance` and
        both come out positive; None otherwise."""
        if self._w == 0.0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < min_variance:
            return None
        per_row = (self._xy / self._w - mean_x * mean_y) / var_x
        fixed = mean_y - per_row * mean_x
        return (fixed, per_row) if per_row > 0.0 and fixed > 0.0 else None

    def verify_cost(self, rows: int) -> float:
        fixed, per_row = self.fit()
        rows = max(1, rows)
        return per_row * rows / (fixed + per_row * rows)
