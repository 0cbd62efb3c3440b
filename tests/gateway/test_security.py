"""Security with keys configured, against a real gateway process: every route but the probes needs a
key, /metrics an admin one; a key sees only its own usage and uses only its models; no secret reaches a
log or a trace; the limits that protect the process (header, body, messages, max_tokens, slow clients, streams per key);
TLS 1.2 at least."""
from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys

import aiohttp
import trustme

from gateway.api import routes
from tests.gateway.conftest import gateway_config
from tests.support.raw_http import raw_post
from tests.support.wait import await_until, wait_until

SECRET_A, SECRET_B, SECRET_OPS = "sk-a-7f3c1e", "sk-b-91d2aa", "sk-ops-5e8b0c"
UPSTREAM_SECRET = "sk-upstream-44c0d9"
WRONG_SECRET = "sk-wrong-0b6e2f"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def keyed(fake_url: str, **extra) -> dict:
    config = gateway_config({"p": [fake_url]}, api_keys=[
        {"key_id": "team-a", "key": SECRET_A, "max_concurrent_requests": 2},
        {"key_id": "team-b", "key": SECRET_B},
        {"key_id": "ops", "key": SECRET_OPS, "admin": True},
    ], **extra)
    config["providers"]["p"]["api_key"] = UPSTREAM_SECRET
    return config


def bearer(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


async def fetch(client: aiohttp.ClientSession, method: str, url: str, secret: str | None,
                **kwargs) -> tuple[int, dict]:
    """Status and JSON body (a stream's body: {"stream": text})."""
    async with client.request(method, url, headers=bearer(secret), **kwargs) as response:
        if response.content_type == "text/event-stream":
            return response.status, {"stream": await response.text()}
        return response.status, await response.json(content_type=None)


def assert_openai_error(body: dict, status: int, got: int) -> None:
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body


async def test_every_route_but_the_probes_needs_a_key(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(keyed(fake.url))
    table = [(r.method, r.path) for r in routes()] + [("GET", "/admin"), ("POST", "/v1/embeddings")]
    assert ("GET", "/metrics") in table and ("GET", "/v1/usage") in table
    async with aiohttp.ClientSession() as client:
        for method, path in table:
            open_route = path in ("/health", "/ready")
            for secret in (None, WRONG_SECRET, SECRET_A.upper()):
                status, body = await fetch(client, method, gateway.url + path, secret, json=CHAT)
                if open_route:
                    assert status == 200, (path, body)
                elif path.startswith("/v1/messages"):    # Anthropic's API, Anthropic's error shape
                    assert status == 401 and body["error"]["type"] == "authentication_error", body
                else:
                    assert_openai_error(body, 401, status)
        status, body = await fetch(client, "GET", gateway.url + "/metrics", SECRET_A)
        assert_openai_error(body, 403, status)
        async with client.get(gateway.url + "/metrics", headers=bearer(SECRET_OPS)) as response:
            assert response.status == 200 and "switchyard_requests_total" in await response.text()
        status, body = await fetch(client, "GET", gateway.url + "/v1/models", SECRET_B)
        assert status == 200 and [m["id"] for m in body["data"]] == ["m"]
        async with client.get(gateway.url + "/v1/models", headers={"x-api-key": SECRET_B}) as response:
            assert response.status == 200   # x-api-key (as Anthropic's SDK sends keys) is a key too
        async with client.get(gateway.url + "/v1/models", headers={"x-api-key": WRONG_SECRET}) as response:
            assert response.status == 401


async def test_a_key_uses_only_its_models(start_fakes, start_gateway) -> None:
    """A key with `models` sees and reaches those alone, on every surface; another model is answered as one that
    does not exist (404 model_not_found, the same words), and nothing reaches an upstream for it."""
    (fake,) = start_fakes("a")
    config = gateway_config({"p": [fake.url]}, api_keys=[{"key_id": "team-a", "key": SECRET_A, "models": ["m"]},
                                                         {"key_id": "team-b", "key": SECRET_B}])
    config["models"]["m2"] = {"providers": ["p"]}
    gateway = start_gateway(config)
    url = gateway.url
    anthropic = {"model": "m2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as client:
        assert (await fetch(client, "POST", url + "/v1/chat/completions", SECRET_A, json=CHAT))[0] == 200
        _, absent = await fetch(client, "POST", url + "/v1/chat/completions", SECRET_A, json={**CHAT, "model": "m3"})
        for path, body in (("/v1/chat/completions", {**CHAT, "model": "m2"}),
                           ("/v1/chat/completions", {**CHAT, "model": "m2", "stream": True}),
                           ("/v1/completions", {"model": "m2", "prompt": "hi", "max_tokens": 4}),
                           ("/v1/responses", {"model": "m2", "input": "hi"})):
            status, refused = await fetch(client, "POST", url + path, SECRET_A, json=body)
            assert_openai_error(refused, 404, status)
            assert refused["error"]["code"] == absent["error"]["code"] == "model_not_found"
            assert refused["error"]["message"] == absent["error"]["message"].replace("m3", "m2"), refused
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            status, refused = await fetch(client, "POST", url + path, SECRET_A, json=anthropic)
            assert status == 404 and refused["error"]["type"] == "not_found_error", (path, refused)
        status, refused = await fetch(client, "GET", url + "/v1/models/m2", SECRET_A)
        assert_openai_error(refused, 404, status)
        assert (await fetch(client, "GET", url + "/v1/models/m", SECRET_A))[0] == 200
        for secret, listed in ((SECRET_A, ["m"]), (SECRET_B, ["m", "m2"])):
            _, models = await fetch(client, "GET", url + "/v1/models", secret)
            assert [m["id"] for m in models["data"]] == listed
        assert (await fetch(client, "POST", url + "/v1/chat/completions", SECRET_B, json={**CHAT, "model": "m2"}))[0] \
            == 200
    assert fake.stats()["num_requests"] == 2


async def test_metrics_can_be_made_public(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(keyed(fake.url, limits={"metrics_public": True}))
    async with aiohttp.ClientSession() as client:
        async with client.get(gateway.url + "/metrics") as response:
            assert response.status == 200
        status, body = await fetch(client, "GET", gateway.url + "/v1/usage", None)
        assert_openai_error(body, 401, status)


async def test_a_key_sees_only_its_own_usage(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(keyed(fake.url))
    url = gateway.url
    async with aiohttp.ClientSession() as client:
        for secret, times in ((SECRET_A, 3), (SECRET_B, 2)):
            for _ in range(times):
                assert (await fetch(client, "POST", url + "/v1/chat/completions", secret, json=CHAT))[0] == 200
        _, own_a = await fetch(client, "GET", url + "/v1/usage", SECRET_A)
        _, own_b = await fetch(client, "GET", url + "/v1/usage", SECRET_B)
        assert (own_a["key_id"], own_a["num_requests"]) == ("team-a", 3)
        assert (own_b["key_id"], own_b["num_requests"]) == ("team-b", 2)
        for secret, other in ((SECRET_A, "team-b"), (SECRET_B, "team-a"), (SECRET_B, "ops")):
            status, body = await fetch(client, "GET", url + f"/v1/usage?key_id={other}", secret)
            assert_openai_error(body, 403, status)
        _, seen_by_admin = await fetch(client, "GET", url + "/v1/usage?key_id=team-b", SECRET_OPS)
        assert seen_by_admin["num_requests"] == 2


async def test_no_secret_in_logs_or_traces(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(keyed(fake.url, log_level="DEBUG", tracing={"exporter": "console"}))
    async with aiohttp.ClientSession() as client:
        for secret in (SECRET_A, SECRET_B, SECRET_OPS, WRONG_SECRET):
            await fetch(client, "POST", gateway.url + "/v1/chat/completions", secret, json=CHAT)
            await fetch(client, "POST", gateway.url + "/v1/completions", secret,
                        json={"model": "m", "prompt": "hi", "stream": True, "fake": {"chunks": 2}})
            await fetch(client, "GET", gateway.url + "/v1/usage", secret)
            await fetch(client, "POST", gateway.url + "/v1/chat/completions", secret, data=b"{not json")
    assert fake.stats()["last_headers"]["Authorization"] == f"Bearer {UPSTREAM_SECRET}"  # it was used
    gateway.stop()
    log = gateway.log()
    assert '"name": "upstream_attempt"' in log  # traces were exported into this log
    for secret in (SECRET_A, SECRET_B, SECRET_OPS, WRONG_SECRET, UPSTREAM_SECRET):
        assert secret not in log
        assert secret[3:] not in log  # not even without its prefix


async def test_limits_answer_with_openai_errors(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    limits = {"max_header_bytes": 1024, "max_headers": 20, "max_messages": 4, "max_output_tokens": 64}
    gateway = start_gateway(gateway_config({"p": [fake.url]}, limits=limits, max_body_bytes=4096))
    url = gateway.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as client:
        cases = [
            ({"messages": [{"role": "user", "content": "x"}] * 5}, 400, "messages"),
            ({"max_tokens": 65}, 400, "max_tokens"),
            ({"max_completion_tokens": 10_000}, 400, "max_completion_tokens"),
            ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, None),
        ]
        for change, status, param in cases:
            got, body = await fetch(client, "POST", url, None, json={**CHAT, **change})
            assert_openai_error(body, status, got)
            assert body["error"]["param"] == param
        assert (await fetch(client, "POST", url, None, json={**CHAT, "max_tokens": 64}))[0] == 200
        assert (await fetch(client, "POST", url, None, json={**CHAT, "messages": CHAT["messages"] * 4}))[0] == 200
    # What aiohttp's HTTP parser refuses before any middleware runs is answered in OpenAI's shape too.
    for name, extra in [("a header line over max_header_bytes", ["x-big: " + "v" * 2000]),
                        ("more than max_headers fields", [f"x-h{i}: v" for i in range(30)]),
                        ("a control character in a value", ["x-note: a\x01b"]),
                        ("a header line without a colon", ["no colon here"])]:
        reply = raw_post(gateway.url, "/v1/chat/completions", CHAT, extra)
        assert reply.content_type == "application/json", (name, reply)
        assert_openai_error(reply.json(), 400, reply.status)
    assert raw_post(gateway.url, "/v1/chat/completions", CHAT, ["x-fine: " + "v" * 500]).status == 200
    assert fake.stats()["num_requests"] == 3  # only the three requests within the limits went upstream


async def test_fields_between_the_gateway_and_its_workers_are_refused_from_clients(start_fakes, start_gateway) -> None:
    """The body goes upstream as it came. A client's `kv_transfer_params` would have a worker connect to the host
    and port they name (a KV pull: any address the workers can reach) or hold a prompt's KV blocks for a decode
    that never comes; its `resume_token_ids` would be taken as output already generated. Both are 400s, with or
    without keys, streaming or not, on both generation routes, and nothing reaches the upstream."""
    (fake,) = start_fakes("a")
    gateway = start_gateway(gateway_config({"p": [fake.url]}))
    pull = {"do_remote_prefill": True, "remote_host": "10.0.0.1", "remote_port": 6379, "remote_request_id": "x",
            "num_prompt_tokens": 8, "first_token_ids": [1]}
    completion = {"model": "m", "prompt": "hello", "max_tokens": 4}
    async with aiohttp.ClientSession() as client:
        for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", completion)]:
            for name, value in [("kv_transfer_params", pull), ("kv_transfer_params", {"do_remote_decode": True}),
                                ("resume_token_ids", [1, 2, 3])]:
                for stream in (False, True):
                    got, error = await fetch(client, "POST", gateway.url + path, None,
                                             json={**body, name: value, "stream": stream})
                    assert_openai_error(error, 400, got)
                    assert error["error"]["param"] == name and "not accepted from clients" in error["error"]["message"]
            assert (await fetch(client, "POST", gateway.url + path, None, json=body))[0] == 200
    assert fake.stats()["num_requests"] == 2   # only the two plain requests went upstream


async def test_slow_clients_cannot_hold_a_connection(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(gateway_config({"p": [fake.url]}, limits={"idle_timeout_s": 1.0, "body_timeout_s": 1.0}))
    host, port = gateway.url.removeprefix("http://").split(":")
    # Slowloris: a header a few bytes at a time, never finished. The gateway closes the connection.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")

    async def closed_by_server() -> bool:
        if reader.at_eof():
            return True
        try:
            writer.write(b"X-Slow: a\r\n")  # keeps sending, as a slowloris client does
            await writer.drain()
        except ConnectionError:
            return True
        try:
            return await asyncio.wait_for(reader.read(1), 0.2) == b""
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    await await_until(closed_by_server, "the gateway to close a connection that never finishes its header")
    writer.close()

    # A body that trickles: headers promise 100 bytes, 10 arrive. The answer is a 408 in OpenAI's shape.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\":")
    await writer.drain()
    response = await asyncio.wait_for(reader.read(4096), 30)
    writer.close()
    assert response.startswith(b"HTTP/1.1 408"), response
    assert b'"code":"request_timeout"' in response
    assert fake.stats()["num_requests"] == 0
    assert gateway.alive


async def test_concurrent_requests_per_key(start_fakes, start_gateway) -> None:
    (fake,) = start_fakes("a")
    gateway = start_gateway(keyed(fake.url))
    url = gateway.url + "/v1/chat/completions"
    release = asyncio.Event()
    slow = {**CHAT, "stream": True, "fake": {"chunks": 400, "chunk_delay_s": 0.05}}

    async with aiohttp.ClientSession() as client:
        async def stream(secret: str) -> int:
            async with client.post(url, json=slow, headers=bearer(secret)) as response:
                await response.content.readline()  # the stream is open
                await release.wait()
                return response.status

        streams = [asyncio.create_task(stream(SECRET_A)) for _ in range(2)]
        await await_until(lambda: fake.stats()["num_requests"] == 2, "two streams of team-a upstream")
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/responses", {"model": "m", "input": "hi"}),
                           ("/v1/embeddings", {"model": "m", "input": "hi"})):   # every route sent upstream
            status, body = await fetch(client, "POST", gateway.url + path, SECRET_A, json=body)
            assert_openai_error(body, 429, status)
            assert body["error"]["code"] == "concurrency_limit_exceeded", path
        assert (await fetch(client, "POST", url, SECRET_B, json=CHAT))[0] == 200  # other keys unaffected
        release.set()
        assert await asyncio.gather(*streams) == [200, 200]
        # Both streams closed (the client left): the slots are free again.
        async def admitted() -> bool:
            return (await fetch(client, "POST", url, SECRET_A, json=CHAT))[0] == 200
        await await_until(admitted, "team-a admitted again once its streams ended")


def _tls_files(tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(paths[0]))
    cert.private_key_and_cert_chain_pem.write_to_path(str(paths[1]))
    cert.private_key_pem.write_to_path(str(paths[2]))
    return [str(p) for p in paths]


def test_tls_1_2_at_least(start_fakes, start_gateway, tmp_path) -> None:
    from gateway.app import ssl_context
    from gateway.config.gateway_config import parse_config

    ca_path, cert_path, key_path = _tls_files(tmp_path)
    (fake,) = start_fakes("a")
    config = gateway_config({"p": [fake.url]}, listen={"tls": {"cert_file": cert_path, "key_file": key_path}})
    import yaml
    assert ssl_context(parse_config(yaml.safe_dump(config), {})).minimum_version is ssl.TLSVersion.TLSv1_2
    gateway = start_gateway(config, ca_file=ca_path)
    host, port = gateway.url.removeprefix("https://").split(":")
    # The client runs in its own interpreter with OpenSSL's security level 0, so the offer of TLS 1.0
    # (or 1.1) is really sent; the gateway must refuse it. TLS 1.2 and 1.3 are accepted.
    offers = {"TLSv1": False, "TLSv1_1": False, "TLSv1_2": True, "TLSv1_3": True}
    for version, accepted in offers.items():
        result = subprocess.run([sys.executable, "-c", _TLS_CLIENT, host, port, ca_path, version],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        outcome = result.stdout.strip()
        assert outcome == (f"ok {version}" if accepted else "refused"), (version, outcome)
    wait_until(lambda: gateway.alive, "the gateway to still run")


_TLS_CLIENT = """
import socket, ssl, sys
host, port, ca, version = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.load_verify_locations(ca)
ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
ctx.minimum_version = ctx.maximum_version = getattr(ssl.TLSVersion, version)
try:
    with socket.create_connection((host, port), timeout=20) as raw, ctx.wrap_socket(raw, server_hostname=host) as tls:
        print("ok", tls.version().replace(".", "_").replace("TLSv1_0", "TLSv1"))
except ssl.SSLError as exc:
    print("refused")
"""

