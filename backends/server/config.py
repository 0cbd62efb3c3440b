"""The worker server's own settings (the engine's are `EngineConfig`): one frozen record from the CLI."""
from __future__ import annotations

import enum
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("served_model_names must not be empty")
        if self.max_request_bytes <= 0:
            raise ValueError("max_request_bytes must be positive")
