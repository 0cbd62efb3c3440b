"""The `vllm-pd` kind's configuration (`kv_bootstrap`) and its handshake: what each leg's `kv_transfer_params` say
(MooncakeConnector's protocol). The legs themselves run against real vLLM servers in tests/vllm/test_vllm_pd.py."""
from __future__ import annotations

import pytest

from gateway.config.gateway_config import ConfigError, KvBootstrap, parse_config
from gateway.upstream.providers import make_provider
from gateway.upstream.providers.vllm_pd import VllmHandshake

PREFILL = "http://127.0.0.1:8001"


def config(bootstrap: str, prefill: str = f"[{PREFILL}]") -> str:
    return (f"models: {{m: {{providers: [p]}}}}\n"
            f"providers: {{p: {{kind: vllm-pd, prefill_endpoints: {prefill}, endpoints: ['http://127.0.0.1:8002'], "
            f"kv_bootstrap: {bootstrap}}}}}\n")


def test_kv_bootstrap_names_each_prefill_endpoints_connector() -> None:
    cfg = parse_config(config(f"{{'{PREFILL}/': {{engine_id: p0, bootstrap_addr: 'http://127.0.0.1:8998/'}}}}"), {})
    provider = cfg.providers["p"]
    assert provider.kv_bootstrap == {PREFILL: KvBootstrap("p0", "http://127.0.0.1:8998")}
    assert make_provider(provider).config is provider


@pytest.mark.parametrize(("bootstrap", "prefill", "message"), [
    ("{'http://127.0.0.1:9999': {engine_id: p0, bootstrap_addr: 'http://h:1'}}", f"[{PREFILL}]",
     "not one of the provider's endpoints"),
    (f"{{'{PREFILL}': {{engine_id: p0}}}}", f"[{PREFILL}]", "engine_id and bootstrap_addr"),
    (f"{{'{PREFILL}': {{engine_id: p0, bootstrap_addr: 'tcp://h:1'}}}}", f"[{PREFILL}]", "http://host:port"),
    (f"{{'{PREFILL}': {{engine_id: p0, bootstrap_addr: 'http://h:1', port: 2}}}}", f"[{PREFILL}]", "unknown field"),
])
def test_bad_kv_bootstrap_fails_at_load(bootstrap: str, prefill: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(config(bootstrap, prefill), {})


def test_each_prefill_endpoint_needs_its_bootstrap() -> None:
    cfg = parse_config(config("{}"), {})
    with pytest.raises(ConfigError, match=f"kv_bootstrap: required .* missing for {PREFILL}"):
        make_provider(cfg.providers["p"])


def test_the_decode_leg_names_the_prefill_legs_transfer_and_the_producer() -> None:
    handshake = VllmHandshake({PREFILL: KvBootstrap("p0", "http://127.0.0.1:8998")})
    sent = handshake.prefill_params()
    assert sent["do_remote_decode"] is True and sent["do_remote_prefill"] is False
    assert sent["transfer_id"] != handshake.prefill_params()["transfer_id"]   # one per request
    assert handshake.decode_params(PREFILL, sent, None) == {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": sent["transfer_id"],
        "remote_engine_id": "p0", "remote_bootstrap_addr": "http://127.0.0.1:8998"}
    named = {"do_remote_prefill": True, "remote_block_ids": [1, 2]}   # a producer that names its blocks
    assert handshake.decode_params(PREFILL, sent, named) == named
    assert handshake.decode_answers_whole
