"""The gateway's configuration: YAML with `${ENV}` / `${ENV:-default}` expansion into frozen records.

The ONLY module of the gateway that reads files or the environment; everything else receives a
`GatewayConfig`. Validation errors name the offending field path.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from gateway.config.api_keys import ApiKeyConfig as ApiKeyConfig, build_keys
from gateway.config.discovery import DnsName
from gateway.config.model_entries import (
    ModelConfig as ModelConfig,
    PolicyConfig as PolicyConfig,
    build_model,
    models_by_name as models_by_name,
)
from gateway.config.vllm_sources import (
    KvBootstrap as KvBootstrap,
    KvEventSource as KvEventSource,
    kv_bootstraps,
    kv_event_sources,
)
from gateway.config.yaml_fields import (
    ConfigError as ConfigError,
    as_mapping,
    check_known,
    enum_value,
    expand_env as expand_env,
    expand_tree,
    quote_hint,
    simple_record,
    typed_field,
)


class ProviderKind(str, Enum):
    """The provider kinds, each with where its class lives ("module:attribute", imported by
    gateway/upstream/providers/__init__.py, since this layer must not import that one): the enum is the
    registry, and adding a kind is one file in gateway/upstream/providers/ and one member here."""
    target: str

    def __new__(cls, value: str, *target: str) -> ProviderKind:
        """A member, `NAME = "name", "module:attribute"`; a lookup by value, `ProviderKind("name")`, never comes
        here (the enum's machinery answers it), though mypy checks it against this signature."""
        member = str.__new__(cls, value)
        member._value_ = value
        member.target = target[0]
        return member

    # any OpenAI-compatible server: our workers, vLLM, SGLang, hosted APIs
    OPENAI = "openai", "gateway.upstream.providers.openai:OpenAIProvider"
    # disaggregated: a prefill pool then a decode pool (docs/disaggregation.md)
    SWITCHYARD_PD = "switchyard-pd", "gateway.upstream.providers.switchyard_pd:SwitchyardPdProvider"
    # an Anthropic-compatible Messages API (chat requests translated both ways)
    ANTHROPIC = "anthropic", "gateway.upstream.providers.anthropic:AnthropicProvider"
    # disaggregated over vLLM's KV connectors: vLLM prefill then decode pools
    VLLM_PD = "vllm-pd", "gateway.upstream.providers.vllm_pd:vllm_pd_provider"


class Pool(str, Enum):
    MAIN = "endpoints"                   # a provider's endpoints (a disaggregated provider's decode pool)
    PREFILL = "prefill_endpoints"        # a disaggregated provider's prefill pool


class TracingExporter(str, Enum):
    NONE = "none"
    CONSOLE = "console"
    OTLP = "otlp"              # OTLP over HTTP (protobuf)


class ReadyRequirement(str, Enum):
    EACH_MODEL = "each_model"  # every model has at least one healthy endpoint in its chain
    ANY_MODEL = "any_model"    # at least one model does
    NONE = "none"              # ready as soon as the server listens


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert_file: Path            # PEM certificate chain served to clients
    key_file: Path             # PEM private key for cert_file


@dataclass(frozen=True, slots=True)
class ListenConfig:
    host: str = "127.0.0.1"    # interface to bind
    port: int = 8080           # TCP port (0: any free port)
    tls: TlsConfig | None = None  # serve HTTPS when set
    lean_http: bool = True     # generation requests through the lean server (server/lean_http.py); false: aiohttp's


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """What protects the process from one client: every limit answers with an OpenAI-style error."""
    max_header_bytes: int = 8190         # one header line (the request line too); longer: 400
    max_headers: int = 100               # header fields per request; more: 400
    max_messages: int = 2048             # chat messages per request; more: 400
    max_output_tokens: int = 32768       # ceiling on max_tokens / max_completion_tokens; higher: 400
    idle_timeout_s: float = 60.0         # a connection without a complete request header is closed (slowloris)
    body_timeout_s: float = 30.0         # reading one request body; slower: 408
    metrics_public: bool = False         # /metrics without a key even when keys are configured


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    connect_s: float = 5.0               # TCP/TLS connect to an endpoint
    first_byte_s: float = 60.0           # request sent -> first body byte (prefill time included)
    total_s: float = 600.0               # the whole upstream leg
    quiet_s: float = 30.0                # after the first body byte, the longest silence (a hung upstream: a
                                         # stream fails over); plain http endpoints


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    name: str                            # referenced by models' provider chains
    kind: ProviderKind                   # picks the implementation in gateway.upstream.providers
    endpoints: tuple[str, ...]           # base URLs (scheme://host:port, no /v1); the decode pool for *-pd kinds
    upstream_model: str | None = None    # the model name sent upstream; None: the client's name
    api_key: str | None = None           # sent as `Authorization: Bearer` upstream (`x-api-key` for anthropic)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    offers_load: bool = False            # endpoints serve GET /load (switchyard workers)
    offers_kv_events: bool = False       # endpoints serve GET /kv_events?since=N
    health_path: str | None = "/health"  # None: no health checks, endpoints assumed healthy
    prefill_endpoints: tuple[str, ...] = ()  # the prefill pool (switchyard-pd and vllm-pd; the kind checks it)
    kv_event_sources: Mapping[str, KvEventSource] = field(default_factory=dict)  # endpoint URL -> vLLM KV events
    kv_bootstrap: Mapping[str, KvBootstrap] = field(default_factory=dict)  # prefill URL -> its connector (vllm-pd)
    offers_vllm_metrics: bool = False    # endpoints are vLLM: GET /metrics (Prometheus) is polled as load
    kv_capacity_tokens: int = 262144     # endpoints without KV events: KV tokens each caches, unless a load report says
    offers_token_ids: bool = False       # endpoints send `token_ids` and take `resume_token_ids` (switchyard workers):
                                         # a stream continued on them goes on from the exact tokens

    def auth_headers(self) -> dict[str, str]:
        """The provider's key as its kind sends it (`x-api-key` to Anthropic's API, else a Bearer token), on its
        legs and on the pollers' requests ({} without a key)."""
        if not self.api_key:
            return {}
        if self.kind is ProviderKind.ANTHROPIC:
            return {"x-api-key": self.api_key}
        return {"Authorization": f"Bearer {self.api_key}"}

    def pools(self) -> dict[Pool, tuple[str, ...]]:
        """The provider's non-empty endpoint pools (pollers and breakers cover every one)."""
        pools = {Pool.MAIN: self.endpoints, Pool.PREFILL: self.prefill_endpoints}
        return {pool: urls for pool, urls in pools.items() if urls}


@dataclass(frozen=True, slots=True)
class RetryConfig:
    max_attempts: int = 4                # upstream legs per request, all providers together
    backoff_initial_s: float = 0.02      # first backoff (exponential, with jitter)
    backoff_max_s: float = 1.0           # backoff cap
    backoff_jitter_s: float = 0.02       # random extra per wait
    max_retry_after_s: float = 2.0       # an upstream Retry-After is honoured up to this
    budget_ratio: float = 0.2            # retries allowed per request over the window...
    budget_min_retries: int = 10         # ...plus this many regardless
    budget_window_s: float = 10.0        # sliding window of the budget


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5           # consecutive failures that open an endpoint's circuit
    cooldown_s: float = 10.0             # open -> half-open (one probe) after this long


@dataclass(frozen=True, slots=True)
class PollerConfig:
    health_interval_s: float = 5.0       # GET {endpoint}{health_path}
    load_interval_s: float = 1.0         # GET {endpoint}/load when offered
    kv_events_interval_s: float = 0.5    # GET {endpoint}/kv_events?since=N when offered
    timeout_s: float = 2.0               # each poll's total timeout
    share_interval_s: float = 0.25       # with redis_url: publish our leases and approximate routing (0: off)
    discovery_interval_s: float = 5.0    # resolve each dns+http:// endpoint entry again (gateway/config/discovery.py)


@dataclass(frozen=True, slots=True)
class ResponseCacheConfig:
    """Whole (not streamed) answers served again to identical requests (gateway/routing/response_cache.py)."""
    ttl_s: float = 0.0                   # how long an answer is kept; 0: no cache
    max_entry_bytes: int = 262144        # larger answers are not kept
    max_memory_bytes: int = 64 << 20     # the in-process store's bound (with Redis: its maxmemory)
    cache_sampled: bool = False          # also requests sampled without a seed (a repeat then gets the same draw)
    shared_across_keys: bool = False     # one API key's answers serve another key's identical request


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """Browsers' cross-origin requests (gateway/server/middlewares.py); none allowed unless origins are named."""
    allow_origins: tuple[str, ...] = ()  # e.g. https://app.example.com; "*": any origin
    max_age_s: int = 600                 # how long a browser may keep a preflight's answer


@dataclass(frozen=True, slots=True)
class TracingConfig:
    exporter: TracingExporter = TracingExporter.NONE
    otlp_endpoint: str | None = None     # e.g. http://collector:4318/v1/traces (otlp only)
    service_name: str = "switchyard-gateway"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    listen: ListenConfig = field(default_factory=ListenConfig)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)        # by client-facing name
    providers: Mapping[str, ProviderConfig] = field(default_factory=dict)  # by provider name
    api_keys: tuple[ApiKeyConfig, ...] = ()   # empty: no authentication
    redis_url: str | None = None         # shared state across replicas (one server or a cluster); None: in-process
    max_body_bytes: int = 1 << 20        # larger request bodies get 413
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    keepalive_s: float = 5.0             # SSE comment interval while the first token is awaited
    drain_timeout_s: float = 30.0        # on SIGTERM: how long requests in flight may take to finish
    retries: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    pollers: PollerConfig = field(default_factory=PollerConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    response_cache: ResponseCacheConfig = field(default_factory=ResponseCacheConfig)
    ready: ReadyRequirement = ReadyRequirement.EACH_MODEL
    log_level: str = "WARNING"
    access_log: str | None = None        # a file each API request's JSON line is appended to; "-": stdout
    log_format: str = "text"             # text | json (one JSON object a line)
    cors: CorsConfig = field(default_factory=CorsConfig)


def load_config(path: str | os.PathLike[str], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read, expand and validate a YAML config file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    return parse_config(text, os.environ if environ is None else environ, base_dir=Path(path).parent)


def parse_config(text: str, environ: Mapping[str, str], base_dir: Path = Path(".")) -> GatewayConfig:
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}{quote_hint(text, exc)}") from exc
    # Expanded after parsing, in string values only: comments are left alone and an environment
    # value can never change the YAML's structure.
    return _build_gateway(as_mapping(expand_tree(raw, environ), "config"), base_dir)


# redis:// and rediss:// name one server (a cluster node is found out and used as the cluster); the +cluster
# forms name a Redis Cluster by one or more comma-separated host:port start-up nodes, the +sentinel forms the
# sentinels that watch a master, and its name (gateway/state/redis_client.py).
_REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")


def _redis_url(url: str | None) -> str | None:
    scheme = url.partition("://")[0] if url and "://" in url else None
    if url is not None and scheme not in _REDIS_SCHEMES:
        raise ConfigError(f"redis_url: expected one of {', '.join(s + '://' for s in _REDIS_SCHEMES)}, got {url!r}")
    return url


def _build_gateway(raw: Mapping[str, Any], base_dir: Path) -> GatewayConfig:
    check_known(raw, set(GatewayConfig.__dataclass_fields__), "config")
    providers = {name: _build_provider(name, body)
                 for name, body in as_mapping(raw.get("providers"), "providers").items()}
    models = {name: build_model(name, body, base_dir)
              for name, body in as_mapping(raw.get("models"), "models").items()}
    named = models_by_name(models)   # no alias names two models
    for model in models.values():
        for provider in model.providers:
            if provider not in providers:
                raise ConfigError(f"models.{model.name}.providers: unknown provider {provider!r}")
    keys = build_keys(raw.get("api_keys") or None, {name: model.name for name, model in named.items()})
    redis_url = _redis_url(typed_field(raw, "redis_url", str, None, "config") or None)
    tracing_raw = dict(as_mapping(raw.get("tracing"), "tracing"))
    exporter = enum_value(TracingExporter, tracing_raw.pop("exporter", "none"), "tracing.exporter")
    tracing = simple_record(TracingConfig, tracing_raw, "tracing")
    max_body = typed_field(raw, "max_body_bytes", int, 1 << 20, "config")
    if max_body <= 0:
        raise ConfigError("max_body_bytes: must be positive")
    return GatewayConfig(
        listen=_build_listen(as_mapping(raw.get("listen"), "listen"), base_dir),
        models=models, providers=providers, api_keys=keys, redis_url=redis_url,
        max_body_bytes=max_body,
        limits=_limits(raw.get("limits")),
        keepalive_s=typed_field(raw, "keepalive_s", float, 5.0, "config"),
        drain_timeout_s=typed_field(raw, "drain_timeout_s", float, 30.0, "config"),
        retries=simple_record(RetryConfig, raw.get("retries"), "retries"),
        breaker=simple_record(BreakerConfig, raw.get("breaker"), "breaker"),
        pollers=simple_record(PollerConfig, raw.get("pollers"), "pollers"),
        response_cache=_response_cache(raw.get("response_cache")),
        tracing=TracingConfig(exporter=exporter, otlp_endpoint=tracing.otlp_endpoint,
                              service_name=tracing.service_name),
        ready=enum_value(ReadyRequirement, raw.get("ready", "each_model"), "ready"),
        log_level=str(raw.get("log_level", "WARNING")).upper(),
        access_log=_access_log(typed_field(raw, "access_log", str, None, "config"), base_dir),
        log_format=_one_of(raw, "log_format", ("text", "json")),
        cors=_cors(as_mapping(raw.get("cors"), "cors")),
    )


def _response_cache(raw: Any) -> ResponseCacheConfig:
    cache = simple_record(ResponseCacheConfig, raw, "response_cache")
    if cache.ttl_s < 0 or cache.max_entry_bytes <= 0 or cache.max_memory_bytes <= 0:
        raise ConfigError("response_cache: ttl_s must be >= 0, max_entry_bytes and max_memory_bytes positive")
    return cache


def _limits(raw: Any) -> LimitsConfig:
    limits = simple_record(LimitsConfig, raw, "limits")
    for name in LimitsConfig.__dataclass_fields__:
        value = getattr(limits, name)
        if not isinstance(value, bool) and value <= 0:
            raise ConfigError(f"limits.{name}: must be positive")
    return limits


def _build_listen(raw: Mapping[str, Any], base_dir: Path) -> ListenConfig:
    check_known(raw, {"host", "port", "tls", "lean_http"}, "listen")
    tls_raw = raw.get("tls")
    tls = None
    if tls_raw:
        tls_raw = as_mapping(tls_raw, "listen.tls")
        check_known(tls_raw, {"cert_file", "key_file"}, "listen.tls")
        if not tls_raw.get("cert_file") or not tls_raw.get("key_file"):
            raise ConfigError("listen.tls: cert_file and key_file are both required")
        tls = TlsConfig(cert_file=base_dir / str(tls_raw["cert_file"]), key_file=base_dir / str(tls_raw["key_file"]))
    port = typed_field(raw, "port", int, 8080, "listen")
    if not 0 <= port <= 65535:
        raise ConfigError("listen.port: out of range")
    return ListenConfig(host=typed_field(raw, "host", str, "127.0.0.1", "listen"), port=port, tls=tls,
                        lean_http=typed_field(raw, "lean_http", bool, True, "listen"))


def _build_provider(name: str, raw: Any) -> ProviderConfig:
    where = f"providers.{name}"
    raw = as_mapping(raw, where)
    check_known(raw, set(ProviderConfig.__dataclass_fields__) - {"name"}, where)
    endpoints = _urls(raw.get("endpoints"), f"{where}.endpoints")
    prefill = _urls(raw["prefill_endpoints"], f"{where}.prefill_endpoints") if "prefill_endpoints" in raw else ()
    return ProviderConfig(
        name=name, kind=enum_value(ProviderKind, raw.get("kind", "openai"), f"{where}.kind"),
        endpoints=endpoints, prefill_endpoints=prefill,
        upstream_model=typed_field(raw, "upstream_model", str, None, where),
        api_key=typed_field(raw, "api_key", str, None, where) or None,
        timeouts=simple_record(TimeoutsConfig, raw.get("timeouts"), f"{where}.timeouts"),
        offers_load=typed_field(raw, "offers_load", bool, False, where),
        offers_kv_events=typed_field(raw, "offers_kv_events", bool, False, where),
        health_path=raw.get("health_path", "/health") or None,
        kv_event_sources=kv_event_sources(raw.get("kv_event_sources"), endpoints + prefill, where),
        kv_bootstrap=kv_bootstraps(raw.get("kv_bootstrap"), prefill, where),
        offers_vllm_metrics=typed_field(raw, "offers_vllm_metrics", bool, False, where),
        kv_capacity_tokens=_positive(raw, "kv_capacity_tokens", 262144, where),
        offers_token_ids=typed_field(raw, "offers_token_ids", bool, False, where),
    )


def _positive(raw: Mapping[str, Any], name: str, default: int, where: str) -> int:
    value: int = typed_field(raw, name, int, default, where)
    if value <= 0:
        raise ConfigError(f"{where}.{name}: must be positive")
    return value


def _urls(value: Any, where: str) -> tuple[str, ...]:
    """Base URLs, and `dns+http://NAME:PORT` entries (one endpoint per address NAME resolves to)."""
    if not isinstance(value, list) or not value or not all(isinstance(e, str) and e for e in value):
        raise ConfigError(f"{where}: expected a non-empty list of URLs")
    for url in value:
        if url.startswith("dns+"):
            try:
                DnsName.parse(url)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
    return tuple(e.rstrip("/") for e in value)


def _cors(raw: Mapping[str, Any]) -> CorsConfig:
    check_known(raw, set(CorsConfig.__dataclass_fields__), "cors")
    origins = raw.get("allow_origins") or []
    if not isinstance(origins, list) or not all(isinstance(o, str) and (o == "*" or "://" in o) for o in origins):
        raise ConfigError("cors.allow_origins: expected a list of origins like https://app.example.com, or '*'")
    max_age_s = typed_field(raw, "max_age_s", int, 600, "cors")
    if max_age_s < 0:
        raise ConfigError("cors.max_age_s: must be >= 0")
    return CorsConfig(tuple(o.rstrip("/") for o in origins), max_age_s)


def _one_of(raw: Mapping[str, Any], name: str, choices: tuple[str, ...]) -> str:
    value = str(raw.get(name, choices[0]))
    if value not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _access_log(target: str | None, base_dir: Path) -> str | None:
    """None (no access log), "-" (standard output) or a path, relative ones under the config file's folder."""
    if not target or target == "-":
        return target or None
    return str(base_dir / target)
