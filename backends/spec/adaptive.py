"""How many tokens to draft for one sequence next step: chosen from its own recent acceptance.

Each sequence keeps decayed counts of draft tokens that the target checked and accepted. With a
per-token acceptance rate a, drafting K tokens yields (1 - a^(K+1)) / (1 - a) tokens for a step
that costs 1 + K * (draft cost + verify cost) target steps; K is the value that maximises tokens
per cost (0: plain decoding). A sequence whose K fell to 0 tries again (K = 1) after `probe_every`
steps, so speculation comes back when the text turns repetitive, unless drafting would gain less
than 10% even at an acceptance rate of 0.9 (a draft model nearly as costly as the target): such a
proposer is never probed, since each probe would also pay for the draft's catch-up.
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
    verify_cost: float = 0.06  # one more token in the target's forward, in decode steps (CPU, batch 1)
    probe_every: int = 16      # steps between retries once K fell to 0
    adaptive: bool = True      # False: always K = max_tokens

    @property
    def can_pay_off(self) -> bool:
        """Whether drafting would gain at least 10% even at a 0.9 acceptance rate."""
        return not self.adaptive or self._best(_HIGH_RATE)[1] >= 1.1

    def best_k(self, rate: float) -> int:
        return self.max_tokens if not self.adaptive else self._best(rate)[0]

    def _best(self, rate: float) -> tuple[int, float]:
        """The K with the most tokens per cost at this acceptance rate, and that ratio (K = 0: 1)."""
        best_k, best_value = 0, 1.0
        per_token = self.draft_cost + self.verify_cost
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

    def next_k(self, policy: SpecPolicy) -> int:
        k = policy.best_k(self.rate)
        if k > 0 or not policy.adaptive or not policy.can_pay_off:
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
