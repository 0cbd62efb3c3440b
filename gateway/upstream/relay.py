"""One upstream's SSE answer relayed to the client as it arrives (`relay_stream`): whole events where the
stream may fail over, each counted into the lease and the usage, up to `data: [DONE]`. Our HTTP client's body
hands its bytes over in its connection's data callback, so no task wakes up per event; aiohttp's (https
upstreams) is read in a loop.

It never chooses endpoints or retries: a failure after the first byte is `StreamBroken` for the dispatcher
(a stream that may fail over), or else an error event to the client.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from gateway.routing.endpoints import Endpoint
from gateway.routing.load import Lease
from gateway.server.client_stream import DONE_EVENT, ClientGone, ClientStream, SseCounter, error_event
from gateway.telemetry.metrics import Metrics
from gateway.upstream.connection import UpstreamBody
from gateway.upstream.mid_stream_resume import StreamBroken, Transcript, without_token_ids
from gateway.upstream.request import Outcome, Progress, RetryableFailure, asks_token_ids

log = logging.getLogger(__name__)

CONNECT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)


class EndedEarly(aiohttp.ClientPayloadError):
    """An upstream's stream ended cleanly but before its `data: [DONE]`: an answer cut short."""


async def relay_stream(metrics: Metrics, progress: Progress, response: aiohttp.ClientResponse, first: bytes,
                       lease: Lease, endpoint: Endpoint, sent_before: bytes = b"") -> Outcome:
    """Relay SSE bytes as they arrive. After the first byte a failure ends the stream with an error event,
    or, where the request may fail over, raises `StreamBroken` for the dispatcher to continue it.
    `sent_before`: whole events of this answer the provider sent itself (a disaggregated first token)."""
    client, model = progress.client, progress.request.facts.model
    assert client is not None
    transcript = Transcript(sent_before) if progress.can_fail_over else None
    if transcript is not None:
        first = await _whole_events(progress, transcript, response, first)
    relay = _Relay(progress, lease, transcript, first)
    client.usage = relay.counter.usage
    is_first_data = not client.data_started
    await client.send_first(first, response.headers.get("Content-Type", "text/event-stream"))
    if is_first_data:
        metrics.observe_ttft(model, time.perf_counter() - progress.request.started_s)
    elif progress.so_far is not None:
        metrics.on_failover(model, "continued")
    try:
        # Up to [DONE]: the answer is whole there, and the client may close at once (the body's end is later).
        await _relay_to_done(relay, client, response.content)
        if transcript is not None and not client.ended and (rest := _outgoing(progress, transcript.flush())):
            await client.send(rest)
            relay.before_last, relay.last = relay.last, rest
        if DONE_EVENT[:12] not in relay.before_last[-32:] + relay.last[-32:]:
            raise EndedEarly("the upstream ended its stream without data: [DONE]")
        client.ended = True
    except ClientGone:
        raise
    except (TimeoutError, *CONNECT_ERRORS) as exc:
        endpoint.breaker.on_failure()
        log.warning("upstream %s failed mid-stream: %r", endpoint.endpoint_id, exc)
        if transcript is not None:
            raise StreamBroken(endpoint.endpoint_id, type(exc).__name__, transcript, relay.counter.usage) from None
        metrics.on_stream_error(model)
        await client.fail(error_event(f"upstream {endpoint.endpoint_id} failed mid-stream: "
                                      f"{type(exc).__name__}"), mid_event=relay.counter.mid_event)
        return Outcome(await client.finish(), endpoint.endpoint_id, relay.counter.usage)
    endpoint.breaker.on_success()
    if is_first_data and relay.num_tokens > 1:    # one figure per response: its mean inter-token latency
        metrics.observe_itl(model, (relay.last_token_s - relay.first_token_s) / (relay.num_tokens - 1))
    await _read_to_end(response)
    return Outcome(await client.finish(), endpoint.endpoint_id, relay.counter.usage)


class _Relay:
    """One stream's relay state: the last two chunks sent (to see that [DONE] came), the tokens counted
    and when the first and the last of them came."""

    __slots__ = ("before_last", "counter", "first_token_s", "last", "last_token_s", "lease", "num_tokens",
                 "progress", "rewrite", "transcript")

    def __init__(self, progress: Progress, lease: Lease, transcript: Transcript | None, first: bytes) -> None:
        self.progress, self.lease, self.transcript = progress, lease, transcript
        self.rewrite = progress.stitch is not None or not asks_token_ids(progress.request.body)
        self.counter = SseCounter()
        if progress.so_far is not None:       # a continuation: its count goes on from what the client has
            self.counter.usage.num_output_tokens = progress.so_far.num_tokens
        self.num_tokens = self.counter.feed(first)
        lease.on_output_tokens(self.num_tokens)
        self.first_token_s = self.last_token_s = time.perf_counter()   # meaningful once num_tokens > 0
        self.before_last, self.last = b"", first

    def take(self, chunk: bytes) -> bytes:
        """An upstream chunk as the client gets it (b"": nothing yet), counted into the lease."""
        if self.transcript is not None:
            chunk = self.transcript.take_whole(chunk)
            if chunk and self.rewrite and (self.progress.stitch is not None or b'"token_ids"' in chunk):
                chunk = _outgoing(self.progress, chunk)
            if not chunk:
                return b""
        self.before_last, self.last = self.last, chunk
        num_new = self.counter.feed(chunk)
        if num_new:
            self.lease.on_output_tokens(num_new)
            self.last_token_s = time.perf_counter()
            if not self.num_tokens:
                self.first_token_s = self.last_token_s
            self.num_tokens += num_new
        return chunk

    @property
    def done(self) -> bool:
        return self.last.endswith(DONE_EVENT)


async def _relay_to_done(relay: _Relay, client: ClientStream, body: aiohttp.StreamReader | UpstreamBody) -> None:
    """Relay until [DONE] (sent through `client.send`) or the body's end. A chunk that is not the last goes
    out in one transport write where the client's response allows it (`fast_writer`)."""
    fast_write = client.fast_writer()
    if isinstance(body, UpstreamBody) and fast_write is not None:
        await _pump_to_done(relay, client, body, fast_write)
        return
    while not relay.done and (chunk := await body.readany()):
        if not (chunk := relay.take(chunk)):
            continue
        if fast_write is None or chunk.endswith(DONE_EVENT):  # re-encoded, or the end of the answer
            await client.send(chunk)
        elif _write(fast_write, chunk):
            await _drain(client)


async def _pump_to_done(relay: _Relay, client: ClientStream, body: UpstreamBody,
                        fast_write: Callable[[bytes], bool]) -> None:
    """`_relay_to_done` in the upstream connection's data callback: the task wakes only for [DONE], a full
    client buffer (then it drains and goes on), the body's end or a failure."""
    def write_now(chunk: bytes) -> bool:
        if not (chunk := relay.take(chunk)):
            return True
        return not chunk.endswith(DONE_EVENT) and not _write(fast_write, chunk)

    while not relay.done:
        try:
            if not await body.pump(write_now):
                return      # the body ended
        finally:
            body.unpump()
        if relay.done:
            await client.send(relay.last)
        else:
            await _drain(client)


def _write(fast_write: Callable[[bytes], bool], chunk: bytes) -> bool:
    """One transport write of `chunk`; True when the client's buffer is full. A client gone is `ClientGone`,
    never a connection error, which would count against the upstream."""
    try:
        return fast_write(chunk)
    except ConnectionError as exc:      # reset, broken pipe, or aiohttp's "Connection lost" on a paused drain
        raise ClientGone() from exc


async def _drain(client: ClientStream) -> None:
    """Wait until the client's buffer is below its high-water mark (`_write`'s errors)."""
    try:
        await client.drain()
    except ConnectionError as exc:      # reset, broken pipe, or aiohttp's "Connection lost" on a paused drain
        raise ClientGone() from exc


async def _whole_events(progress: Progress, transcript: Transcript, response: aiohttp.ClientResponse,
                        first: bytes) -> bytes:
    """The first bytes worth sending: whole events, rewritten for a continuation (one that only repeats
    the role, which is dropped, is not worth sending). Until they come the leg can still be retried."""
    chunk = _outgoing(progress, transcript.take_whole(first))
    while not chunk:
        more = await response.content.readany()
        if not more:
            raise RetryableFailure("empty response: upstream closed before a whole event")
        chunk = _outgoing(progress, transcript.take_whole(more))
    return chunk


async def _read_to_end(response: aiohttp.ClientResponse) -> None:
    """After `data: [DONE]`: the rest of the upstream's body (its chunked end, usually already here), so
    its connection goes back to the pool. The answer is whole: a failure here changes nothing."""
    with contextlib.suppress(TimeoutError, *CONNECT_ERRORS):
        while await response.content.readany():
            pass


def _outgoing(progress: Progress, chunk: bytes) -> bytes:
    """Whole events as the client gets them: a continuation's rewritten, our workers' token ids dropped when
    the gateway asked for them and the client did not."""
    if chunk and progress.stitch is not None:
        chunk = progress.stitch(chunk)
    return without_token_ids(chunk) if chunk and not asks_token_ids(progress.request.body) else chunk
