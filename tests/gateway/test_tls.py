"""HTTPS: the gateway serves TLS from a configured cert/key; the OpenAI SDK talks to it with a private CA."""
from __future__ import annotations

import ssl

import httpx2
import openai
import trustme

from tests.gateway.conftest import gateway_config


def test_openai_sdk_over_tls(start_fakes, start_gateway, tmp_path) -> None:
    (fake,) = start_fakes("a")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_path, cert_path, key_path = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    config = gateway_config({"p": [fake.url]},
                            listen={"tls": {"cert_file": str(cert_path), "key_file": str(key_path)}},
                            tracing={"exporter": "console"})
    gateway = start_gateway(config, ca_file=str(ca_path))
    assert gateway.url.startswith("https://")
    with httpx2.Client(verify=ssl.create_default_context(cafile=str(ca_path))) as http:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", http_client=http, max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "tok0 tok1 tok2 "
        chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok0 tok1 tok2 "
        assert [m.id for m in client.models.list()] == ["m"]
    # Without the CA the certificate is rejected.
    with httpx2.Client() as http:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", http_client=http, max_retries=0)
        try:
            client.models.list()
            raise AssertionError("an untrusted certificate was accepted")
        except openai.APIConnectionError:
            pass
    gateway.stop()
    log = gateway.log()
    # tracing exporter `console`: the request, routing and upstream-attempt spans were exported.
    for span in ("request", "routing_decision", "upstream_attempt"):
        assert f'"name": "{span}"' in log
