"""The worker server's own settings (the engine's are `EngineConfig`): one frozen record from the CLI."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


class WorkerRole(str, enum.Enum):
    BOTH = "both"        # prefill and decode in one worker (unified mode)
    PREFILL = "prefill"  # disaggregated: computes prompt KV, hands it to a decode worker
    DECODE = "decode"    # disaggregated: pulls prompt KV, decodes


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_dir: str                         # HF folder the tokenizer and chat template load from
    served_model_names: tuple[str, ...]    # names clients may ask for; the first is listed first
    role: WorkerRole = WorkerRole.BOTH
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES   # larger bodies get 413
    kv_host: str = "127.0.0.1"             # KV transfer listener interface (prefill and both roles)
    kv_port: int = 0                       # its TCP port; 0: any free port
    kv_advertise_host: str | None = None   # host decode workers dial (behind NAT, in containers); None: derived
    kv_idle_timeout_s: float = 10.0        # a pull (or a send) with no bytes moving this long fails
    debug_endpoints: bool = False          # GET /debug/kv_digest (tests only: exposes KV digests)
    kv_shared_memory: bool = True          # same-host pulls copy from the peer's shared-memory cache
    api_key: str | None = None             # clients must send it as a bearer token (auth.py); None: no check
    kv_key: str | None = field(default=None, repr=False)  # the KV listener's and pulls' shared key; None: open
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP traces URL the worker's spans go to (tracing.py); None: off

    def __post_init__(self) -> None:
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()):
            raise ValueError("api_key must be a non-empty printable string")
        if self.kv_key is not None and not self.kv_key:
            raise ValueError("kv_key must be non-empty (None: no key)")
        if not self.served_model_names:
            raise ValueError("served_model_names must not be empty")
        if self.max_request_bytes <= 0:
            raise ValueError("max_request_bytes must be positive")
        if self.kv_idle_timeout_s <= 0 or not 0 <= self.kv_port < 65536:
            raise ValueError("kv_idle_timeout_s must be positive, kv_port in [0, 65535]")
