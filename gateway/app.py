"""The app factory: one middleware list, one route table, and cleanup contexts that build the
runtime parts inside the running loop (client session, state store, pollers) and tear them down.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import ssl
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from cache.prefix_index import PrefixIndex
from gateway import api
from gateway.api import messages, status
from gateway.config.gateway_config import ConfigError, GatewayConfig, load_config, models_by_name
from gateway.routing.endpoints import CircuitState, UpstreamRegistry
from gateway.routing.load import LoadTracker, OutputLengthEstimator
from gateway.routing.load_share import LoadSharer
from gateway.routing.prefix_feed import configure_prefix_index
from gateway.routing.prefix_share import PrefixSharer
from gateway.routing.response_cache import ResponseCache
from gateway.routing.token_count import TokenCounter
from gateway.routing.vllm_kv_events import KvEventConsumer
from gateway.server.access_log import AccessLog
from gateway.server.key_auth import Authenticator
from gateway.server.lean_http import LeanSite
from gateway.server.middlewares import (
    DRAIN,
    KEYS,
    Drain,
    Keys,
    answer_protocol_errors_in_json,
    make_access_middleware,
    make_cors_middleware,
    make_error_middleware,
)
from gateway.services import SERVICES, BackgroundTasks, Services
from gateway.state import StateStore, StoreMisconfigured, open_store
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import RequestIds, Tracing
from gateway.upstream.dispatch import Dispatcher, Retrier, RetryBudget
from gateway.upstream.legs import Legs
from gateway.upstream.providers import make_provider
from policies.registry import PolicyName, make_policy

log = logging.getLogger(__name__)

CONFIG: web.AppKey[GatewayConfig] = web.AppKey("switchyard_config", GatewayConfig)


def create_app(config: GatewayConfig) -> web.Application:
    """Build the gateway app; nothing touches the network until the app starts."""
    _check_policies(config)
    for provider in config.providers.values():  # a kind's own checks (e.g. a missing pool) fail here too
        make_provider(provider)
    keys = Keys(Authenticator.from_config(config.api_keys))
    access = make_access_middleware(keys, config.limits)
    drain = Drain()
    anthropic_errors = {route: messages.error_response for route in (messages.ROUTE, messages.COUNT_TOKENS_ROUTE)}
    error_middleware = make_error_middleware(RequestIds(), anthropic_errors)
    access_log = AccessLog(config.access_log) if config.access_log else None
    cors = [make_cors_middleware(config.cors)] if config.cors.allow_origins else []
    app = web.Application(middlewares=[*cors, error_middleware, *([access_log.middleware()] if access_log else []),
                                       drain.middleware(), access],
                          client_max_size=config.max_body_bytes)
    if access_log is not None:
        app.on_startup.append(lambda _: _open(access_log))
        app.on_cleanup.append(lambda _: _close(access_log))
    app[CONFIG] = config
    app[DRAIN] = drain
    app[KEYS] = keys
    app.add_routes(api.routes())
    app.add_routes(status.routes())
    app.cleanup_ctx.append(_services_ctx)
    return app


def reload_keys(app: web.Application, config_path: str) -> None:
    """SIGHUP: the config file's `api_keys` replace the running ones, for the requests that start from now on
    (rotating a secret, adding or revoking a key, changing its limits). A file that does not load changes
    nothing and says why; the other sections need a restart, and a change to them is logged, not applied."""
    try:
        new = load_config(config_path)
        auth = Authenticator.from_config(new.api_keys)
    except (ConfigError, ValueError) as exc:
        log.error("SIGHUP: %s does not load, the API keys stay as they were: %s", config_path, exc)
        return
    app[KEYS].auth = auth
    log.warning("SIGHUP: %d API keys loaded from %s", len(new.api_keys), config_path)
    if dataclasses.replace(new, api_keys=()) != dataclasses.replace(app[CONFIG], api_keys=()):
        log.warning("SIGHUP: %s changes more than api_keys; the rest takes a restart", config_path)


async def _open(access_log: AccessLog) -> None:
    access_log.open()


async def _close(access_log: AccessLog) -> None:
    access_log.close()


def _check_policies(config: GatewayConfig) -> None:
    """Fail at start-up (not on the first request) on a bad policy name or option, naming the field."""
    for model in config.models.values():
        try:
            make_policy(PolicyName(model.policy.name), model.policy.options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"models.{model.name}.policy: {exc}") from None


async def _services_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    try:
        store: StateStore = await open_store(config.redis_url,
                                             max_response_bytes=config.response_cache.max_memory_bytes)
    except StoreMisconfigured as exc:
        raise ConfigError(f"redis_url: {exc}") from None
    tracing = Tracing(config.tracing)
    tracker = LoadTracker()
    prefix_index = PrefixIndex()
    configure_prefix_index(prefix_index, config)
    kv_events = KvEventConsumer(config, prefix_index)
    registry = UpstreamRegistry(config, tracker, prefix_index, on_circuit_change=_log_circuit_change)
    metrics = Metrics(registry.rows, registry.poll_failure_rows, kv_events.rows)
    # One pooled session for every upstream call; bodies are relayed as they come (no decompression),
    # and upstream cookies are never kept or sent (a dummy jar skips the per-request cookie filtering).
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                                    auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
    retrier = Retrier(config.retries, RetryBudget(config.retries))
    # Peer processes' leases and approximate routing decisions through the store (with Redis: other
    # `--workers` and replicas).
    sharing = config.redis_url is not None and config.pollers.share_interval_s > 0
    load_sharer = LoadSharer(tracker, store, lambda: registry.endpoints, config.pollers.share_interval_s)
    prefix_sharer = PrefixSharer(prefix_index, store, config.pollers.share_interval_s, metrics.on_shared_decisions)
    shares_prefixes = sharing and any(prefix_index.is_approximate(url) for url in registry.endpoints)
    legs = Legs(session, registry, tracker, prefix_index, store, metrics, tracing, config.retries.max_retry_after_s,
                on_routed=prefix_sharer.note if shares_prefixes else None)
    dispatcher = Dispatcher(
        legs,
        providers={name: make_provider(p) for name, p in config.providers.items()},
        policies={name: make_policy(PolicyName(m.policy.name), m.policy.options) for name, m in config.models.items()},
        retrier=retrier, metrics=metrics, keepalive_s=config.keepalive_s)
    background = BackgroundTasks()
    response_cache = ResponseCache(config.response_cache, store)
    caches_any = any(response_cache.enabled_for(m) for m in config.models.values())
    app[SERVICES] = Services(
        config=config, dispatcher=dispatcher, registry=registry, store=store,
        counter=TokenCounter({name: m.tokenizer for name, m in config.models.items()}),
        estimator=OutputLengthEstimator(), metrics=metrics, tracing=tracing, background=background,
        response_cache=response_cache if caches_any else None, models_by_name=models_by_name(config.models),
        prefix_index=prefix_index)
    registry.start(session)
    kv_events.start()
    if sharing:
        load_sharer.start()
    if shares_prefixes:
        prefix_sharer.start()
    try:
        yield
    finally:
        await prefix_sharer.stop()
        await load_sharer.stop()
        await kv_events.stop()
        await registry.stop()
        await background.drain()
        legs.close()
        await session.close()
        await store.close()
        tracing.shutdown()


def _log_circuit_change(endpoint_id: str, state: CircuitState) -> None:
    log.warning("circuit of %s is now %s", endpoint_id, state.name.lower())


def _tune_gc() -> None:
    """Start-up objects (modules, config, pools) move to a permanent generation that collections
    skip, and young collections run less often: per-request garbage is mostly freed by refcount."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    tls = config.listen.tls
    if tls is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # whatever the system's OpenSSL policy allows
    context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return context


def make_site(runner: web.AppRunner, config: GatewayConfig, reuse_port: bool = False) -> web.BaseSite:
    """The listening socket: generation requests through the lean server unless `listen.lean_http` is off."""
    listen, limits, tls = config.listen, config.limits, ssl_context(config)
    if not listen.lean_http:
        return web.TCPSite(runner, listen.host, listen.port, ssl_context=tls, backlog=1024, reuse_address=True,
                           reuse_port=reuse_port or None)
    return LeanSite(runner, api.lean_routes(), listen.host, listen.port, max_head_bytes=limits.max_header_bytes,
                    max_headers=limits.max_headers, max_body_bytes=config.max_body_bytes,
                    idle_timeout_s=limits.idle_timeout_s, ssl_context=tls, backlog=1024, reuse_port=reuse_port or None)


async def serve(config: GatewayConfig, reuse_port: bool = False, config_path: str | None = None) -> None:
    """Run the gateway until cancelled (the CLI runs this on uvloop). `reuse_port`: one of several
    processes on the same port (SO_REUSEPORT; the kernel spreads connections among them). `config_path`:
    where SIGHUP reads the API keys again (`reload_keys`)."""
    # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream leg.
    # idle_timeout_s bounds a connection that never completes a request header (aiohttp's keep-alive
    # timer runs from the connection's start and is not reset by partial data): no slowloris.
    limits = config.limits
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5.0,
                           keepalive_timeout=limits.idle_timeout_s, max_line_size=limits.max_header_bytes,
                           max_field_size=limits.max_header_bytes, max_headers=limits.max_headers)
    await runner.setup()
    answer_protocol_errors_in_json(runner)
    await make_site(runner, config, reuse_port).start()
    _tune_gc()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if config_path is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_keys, app, config_path)
    log.warning("switchyard gateway listening on %s://%s:%d", "https" if config.listen.tls else "http",
                config.listen.host, config.listen.port)   # last: from here on the signals are handled
    try:
        await stop.wait()
        app[DRAIN].start()
        log.warning("draining: %d requests in flight", app[DRAIN].num_in_flight)
        if not await app[DRAIN].wait_idle(config.drain_timeout_s):
            log.warning("drain timeout after %.0f s: %d requests cut", config.drain_timeout_s,
                        app[DRAIN].num_in_flight)
    finally:
        await runner.cleanup()
