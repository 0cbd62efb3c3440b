"""What a request carries into a KV transfer: the server parses it from `kv_transfer_params`, the
sequence holds it, the connectors and transports read it. Records only: no sockets, no engine.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """Where a decode worker finds a prompt's KV: the prefill side of `kv_transfer_params`."""
    host: str                 # prefill worker's KV listener host
    port: int                 # and port
    transfer_id: str          # the id the blocks are held under (vLLM: remote_request_id)
    num_blocks: int | None    # how many blocks are held, if the prefill worker said so
    engine_id: str = ""       # prefill worker's engine id, for logs

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteBlocks:
        """From a decode request's `kv_transfer_params` (vLLM's field names).

        Raises ValueError whose first word is the offending field, for a 400 with that `param`.
        """
        host, port, transfer_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        block_ids, engine_id = params.get("remote_block_ids"), params.get("remote_engine_id", "")
        if not isinstance(host, str) or not host:
            raise ValueError("remote_host must be a non-empty string")
        if type(port) is not int or not 0 < port < 65536:
            raise ValueError("remote_port must be an integer in 1..65535")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ValueError("remote_request_id must be a non-empty string")
        if block_ids is not None and not (isinstance(block_ids, list) and all(type(b) is int for b in block_ids)):
            raise ValueError("remote_block_ids must be a list of integers")
        if not isinstance(engine_id, str):
            raise ValueError("remote_engine_id must be a string")
        return cls(host=host, port=port, transfer_id=transfer_id,
                   num_blocks=None if block_ids is None else len(block_ids), engine_id=engine_id)


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """A request's part in a KV transfer, parsed from `kv_transfer_params` by the server."""
    do_remote_decode: bool = False           # prefill leg: keep the prompt's blocks for a decode worker's pull
    remote: RemoteBlocks | None = None       # decode leg: where the prompt's KV is held (do_remote_prefill)
    first_token_ids: tuple[int, ...] = ()    # decode leg: tokens the prefill worker sampled (decoding follows them)
