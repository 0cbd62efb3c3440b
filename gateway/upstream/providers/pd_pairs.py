"""Which decode workers take a prefill worker's KV. Halfway through a rolling upgrade the two pools hold two
revisions of a model, and a decode worker refuses KV that other weights (or another KV layout or tokenizer)
computed, with `kv_transfer_mismatch`. Two sources say which pairs would refuse: the weights' fingerprints in
the workers' `/load` reports (`offers_load`), and the refusals themselves, remembered per pair for `ttl_s`
or until either worker reports other weights (a restart on the other revision), whichever comes first.
"""
from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.endpoints import Endpoint

REFUSAL_TTL_S = 60.0   # a refused pair is tried again after this long even if neither worker reports weights


class PdPairs:
    def __init__(self, ttl_s: float = REFUSAL_TTL_S) -> None:
        self._ttl_s = ttl_s
        # (prefill id, decode id) -> (until, prefill weights, decode weights), the weights as reported then
        self._refused: dict[tuple[str, str], tuple[float, str, str]] = {}

    def refuse(self, prefill: Endpoint, decode: Endpoint, now: float) -> bool:
        """Remember that `decode` refused `prefill`'s KV; True when the pair was not already remembered (so the
        caller logs a pair once, not each request it costs)."""
        key = (prefill.endpoint_id, decode.endpoint_id)
        known = self._holds(key, prefill, decode, now)
        self._refused[key] = (now + self._ttl_s, prefill.weights, decode.weights)
        return not known

    def takers(self, prefill: Endpoint, decode_pool: Sequence[Endpoint], now: float) -> list[Endpoint]:
        """The decode workers not known to refuse `prefill`'s KV: the same weights as it or none reported,
        and no refusal remembered."""
        takers = list(decode_pool)
        if prefill.weights:
            takers = [e for e in takers if e.weights in (prefill.weights, "")]
        if self._refused:
            takers = [e for e in takers if not self._holds((prefill.endpoint_id, e.endpoint_id), prefill, e, now)]
        return takers

    def _holds(self, key: tuple[str, str], prefill: Endpoint, decode: Endpoint, now: float) -> bool:
        remembered = self._refused.get(key)
        if remembered is None:
            return False
        until, prefill_weights, decode_weights = remembered
        if now < until and (prefill.weights, decode.weights) == (prefill_weights, decode_weights):
            return True
        del self._refused[key]
        return False
