"""One sequence's speculative-decoding acceptance history, kept on the `Sequence`.

The policy that reads it to choose each step's drafts is `SpecPolicy` (backends/speculative/adaptive.py);
this record sits below it so that the sequence does not import the speculative package.
"""
from __future__ import annotations

from dataclasses import dataclass

_DECAY = 0.8          # weight of the past per verification (about the last 5 steps count)
_PRIOR_CHECKED = 2.0  # a new sequence starts as if 2 drafts were checked ...
_PRIOR_ACCEPTED = 1.4  # ... and 1.4 accepted (rate 0.7): optimistic, so speculation is tried


@dataclass(slots=True)
class SpecState:
    """One sequence's acceptance history (engine thread only)."""
    checked: float = _PRIOR_CHECKED      # decayed count of drafts the target judged
    accepted: float = _PRIOR_ACCEPTED    # decayed count of those it accepted
    idle_steps: int = 0                  # steps since it last drafted
    probe_misses: int = 0                # probes in a row that the target rejected
    probing: bool = False                # its last draft was a probe

    @property
    def rate(self) -> float:
        return self.accepted / self.checked if self.checked > 0 else 0.0

    def idle(self, probe_every: int, tick: bool) -> bool:
        """A step in which the policy gave it no drafts; whether to probe (k = 1) in it instead: on a
        probe tick, once idle for probe_every steps, twice that after each rejected probe in a row (at
        most 8 times), so prose that never repeats itself probes ever more rarely."""
        self.idle_steps += 1
        if not tick or self.idle_steps < probe_every << min(self.probe_misses, 3):
            return False
        self.idle_steps, self.probing = 0, True
        return True

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """A verification: drafts are checked in order until the first rejection."""
        if num_proposed <= 0:
            return
        judged = num_accepted + (1 if num_accepted < num_proposed else 0)
        self.checked = self.checked * _DECAY + judged
        self.accepted = self.accepted * _DECAY + num_accepted
        self.idle_steps = 0
        if self.probing:
            self.probe_misses, self.probing = (self.probe_misses + 1 if num_accepted == 0 else 0), False
