"""What a provider kind offers the dispatcher. A provider owns its legs: it chooses endpoints, builds
and sends each leg through `Legs` (gateway/upstream/legs.py), and keeps whatever it must remember between tries
of one request in the run it returns. It does not walk the chain or retry (the dispatcher does).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from gateway.config.gateway_config import ProviderConfig
from gateway.upstream.request import Outcome, Progress

if TYPE_CHECKING:
    from gateway.upstream.legs import Legs

# One try at serving the request; the dispatcher calls it again after a `RetryableFailure`. A run that keeps
# something upstream between tries may also have `abandon()`, which the dispatcher calls when it gives the
# request up with that run current (its retries ran out).
ProviderRun = Callable[[], Awaitable[Outcome]]


class Provider(Protocol):
    config: ProviderConfig

    def start(self, progress: Progress, legs: Legs) -> ProviderRun:
        """Begin serving `progress.request` with this provider. Each call of the returned run raises
        `RetryableFailure` when a leg failed before the client got a byte (the dispatcher retries, here
        or further down the chain) and `ProviderExhausted` when no endpoint is left to try."""
        ...
