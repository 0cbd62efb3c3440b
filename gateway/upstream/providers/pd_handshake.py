"""What a disaggregated provider's two legs say about the KV (`kv_transfer_params`), per kind of pool: ours here,
vLLM's in providers/vllm_pd.py. The legs themselves are providers/switchyard_pd.py's.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class KvHandshake(Protocol):
    # True: the decode server answers from the first token (it samples it again, as vLLM's does), so the prefill's
    # token is not sent to the client; False: the decode answer follows the prefill's first token.
    decode_answers_whole: bool

    def prefill_params(self) -> dict[str, Any]:
        """The prefill leg's `kv_transfer_params`."""
        ...

    def decode_params(self, prefill_endpoint_id: str, sent: Mapping[str, Any],
                      returned: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """The decode leg's, from what the prefill leg sent and answered; None: the prefill holds nothing."""
        ...


class SwitchyardHandshake:
    """Our workers name their held blocks in the prefill's answer, and the decode leg sends that back."""

    decode_answers_whole = False

    def prefill_params(self) -> dict[str, Any]:
        return {"do_remote_decode": True}

    def decode_params(self, prefill_endpoint_id: str, sent: Mapping[str, Any],
                      returned: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        return returned
