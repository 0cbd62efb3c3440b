"""Precise prefix routing in front of vLLM: subscribe to each endpoint's KV event stream (ZMQ PUB/SUB,
msgpack; vLLM's `--kv-events-config`) and apply it to the prefix index, vLLM's block hashes mapped onto
ours by `cache.vllm_events.VllmBlockMap`, each in its medium (the GPU cache, an offload tier). It only
observes; each socket's loop logs its own errors.

Who binds: vLLM binds when its endpoint is a wildcard (`tcp://*:5557`) or ipc/inproc, so we connect
(to the HTTP endpoint's host); for `tcp://HOST:PORT` its publisher connects, so we bind that address and
several engines may share it, told apart by their `topic`. Frames: topic, 8-byte big-endian sequence
number, payload. pyzmq and msgpack come with the `kv-events` extra, imported only when configured.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from cache.prefix_index import PrefixIndex
from gateway.config.gateway_config import GatewayConfig, KvEventSource
from gateway.routing.prefix_feed import index_block_size

if TYPE_CHECKING:
    import zmq.asyncio

    from cache.vllm_events import VllmBlockMap

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SocketPlan:
    address: str                         # the ZMQ address our SUB socket binds or connects to
    bind: bool                           # True: we bind (vLLM's publisher connects to us)
    topics: Mapping[str, str]            # exact topic -> endpoint id (base URL)


def plan_sockets(config: GatewayConfig) -> list[SocketPlan]:
    """One SUB socket per distinct address, with the endpoints (by topic) it carries."""
    by_address: dict[tuple[str, bool], dict[str, str]] = {}
    for provider in config.providers.values():
        for endpoint_id, source in provider.kv_event_sources.items():
            address, bind = subscriber_address(source, endpoint_id)
            topics = by_address.setdefault((address, bind), {})
            if topics.get(source.topic, endpoint_id) != endpoint_id:
                raise ValueError(f"KV event socket {address}: topic {source.topic!r} names both "
                                 f"{topics[source.topic]} and {endpoint_id}; give each engine its own topic")
            topics[source.topic] = endpoint_id
    return [SocketPlan(address, bind, topics) for (address, bind), topics in by_address.items()]


def subscriber_address(source: KvEventSource, endpoint_id: str) -> tuple[str, bool]:
    """(address, bind) of our side for vLLM's configured `endpoint` string, as vLLM decides."""
    endpoint = source.endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint, False
    if "*" in endpoint or "::" in endpoint:  # vLLM binds every interface: reach it at the endpoint's host
        port = endpoint.rsplit(":", 1)[1]
        host = urlsplit(endpoint_id).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{port}", False
    return endpoint, True


class EngineStream:
    """One engine's events: its block map, the last sequence number seen, and the batches applied."""
    __slots__ = ("block_map", "endpoint_id", "last_seq", "num_batches")

    def __init__(self, endpoint_id: str, block_map: VllmBlockMap) -> None:
        self.endpoint_id = endpoint_id
        self.block_map = block_map
        self.last_seq = -1
        self.num_batches = 0


class KvEventConsumer:
    """Owns the SUB sockets and their tasks; `start` in the running loop, `stop` at shutdown."""

    def __init__(self, config: GatewayConfig, index: PrefixIndex) -> None:
        self._plans = plan_sockets(config)
        self._index = index
        self._block_size = index_block_size(config)  # vLLM's block size must be a multiple of it
        self._tasks: list[asyncio.Task[None]] = []
        self._context: zmq.asyncio.Context | None = None
        self._streams: list[EngineStream] = []

    def start(self) -> None:
        if not self._plans:
            return
        try:  # the kv-events extra; only needed when a provider names event sources
            import zmq.asyncio

            from cache.vllm_events import VllmBlockMap
        except ImportError as exc:
            raise RuntimeError(f"kv_event_sources need pyzmq and msgpack: pip install 'switchyard[kv-events]' "
                               f"({exc})") from exc
        self._context = zmq.asyncio.Context()
        for plan in self._plans:
            socket = self._context.socket(zmq.SUB)
            socket.setsockopt(zmq.LINGER, 0)
            for topic in plan.topics:
                socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
            if plan.bind:
                try:
                    socket.bind(plan.address)
                except zmq.ZMQError as exc:
                    raise RuntimeError(
                        f"cannot bind the KV event socket {plan.address} ({exc}): vLLM's publisher connects to one "
                        "address, so only one gateway process can receive it; with several (--workers N, "
                        "replicas) let vLLM bind (endpoint tcp://*:PORT) and every process connects") from exc
            else:
                socket.connect(plan.address)
            streams = {topic.encode(): EngineStream(endpoint_id, VllmBlockMap(self._block_size))
                       for topic, endpoint_id in plan.topics.items()}
            self._streams.extend(streams.values())
            self._tasks.append(asyncio.create_task(self._consume(plan, socket, streams)))
        log.info("consuming KV events on %d socket(s)", len(self._plans))

    def rows(self) -> list[tuple[str, int]]:
        """(endpoint, event batches applied to the index) per engine, for /metrics."""
        return [(stream.endpoint_id, stream.num_batches) for stream in self._streams]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    async def _consume(self, plan: SocketPlan, socket: zmq.asyncio.Socket,
                       streams: Mapping[bytes, EngineStream]) -> None:
        import zmq  # present: start() imported it
        while True:
            try:
                frames = await socket.recv_multipart()
            except zmq.ZMQError as exc:  # the socket is gone (shutdown): nothing more will come
                log.warning("KV event socket %s closed: %r", plan.address, exc)
                return
            try:
                self.apply_frames(frames, streams)
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the stream
                log.warning("KV event on %s skipped: %r", plan.address, exc)

    def apply_frames(self, frames: list[bytes], streams: Mapping[bytes, EngineStream]) -> None:
        """Apply one multipart message (topic, sequence, payload) to the index."""
        if len(frames) != 3 or len(frames[1]) != 8:
            raise ValueError(f"expected 3 frames (topic, 8-byte seq, payload), got {len(frames)}")
        stream = streams.get(frames[0])
        if stream is None:  # a topic that is a prefix of another's subscription, or one nobody named
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if seq <= stream.last_seq:  # the publisher restarted (numbering from 0): its cache is new
            log.info("KV events of %s restarted at %d: forgetting its blocks", stream.endpoint_id, seq)
            self._clear(stream)
        elif stream.last_seq >= 0 and seq != stream.last_seq + 1:
            log.debug("KV events of %s: %d batches missed", stream.endpoint_id, seq - stream.last_seq - 1)
        stream.last_seq = seq
        apply_batch(self._index, stream.endpoint_id, stream.block_map, frames[2])
        stream.num_batches += 1

    def _clear(self, stream: EngineStream) -> None:
        self._index.reset(stream.endpoint_id)
        stream.block_map.clear()


def apply_batch(index: PrefixIndex, endpoint_id: str, block_map: VllmBlockMap, payload: bytes) -> None:
    """Decode one vLLM event batch and apply it to `endpoint_id`'s blocks, in order."""
    from cache.vllm_events import VllmEventType, decode_batch, medium_of
    _, events = decode_batch(payload)
    for event in events:
        if event.type is VllmEventType.CLEARED:  # its tiers' blocks are forgotten too: that only costs hits
            index.reset(endpoint_id)
            block_map.clear()
        elif (medium := medium_of(event)) is None:  # a medium we cannot rank
            continue
        elif event.type is VllmEventType.STORED:
            index.store(endpoint_id, block_map.stored(event, medium), medium)
        else:
            index.remove(endpoint_id, block_map.removed(event.block_hashes, medium), medium)
