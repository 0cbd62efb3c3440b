"""gateway/cli.py: bad invocations exit with a usage line or the config error."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize(("argv", "message"), [
    ([], "usage: switchyard"),
    (["frobnicate"], "usage: switchyard"),
    (["gateway", "--config", "/nonexistent/gateway.yaml"], "cannot read config"),
])
def test_cli_rejects_bad_invocations(argv: list[str], message: str) -> None:
    from gateway.cli import main

    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_check_validates_a_config_as_start_up_does(tmp_path, capsys) -> None:
    """`switchyard gateway --check`: the loader's checks and those start-up makes when it builds the app (a
    policy's options, a provider kind's pools), without the network; 0 and a summary for a good config."""
    from gateway.cli import main

    good = tmp_path / "good.yaml"
    good.write_text("models: {m: {providers: [p, q]}}\n"
                    "providers: {p: {endpoints: ['http://h:1', 'dns+http://workers:8000']},\n"
                    "            q: {kind: switchyard-pd, prefill_endpoints: ['http://pf:1'], endpoints: ['http://d:1']}}\n")
    main(["gateway", "--config", str(good), "--check"])
    assert "config OK: 1 models, 2 providers, 3 endpoints and 1 DNS names" in capsys.readouterr().out
    providers = "\nproviders: {p: {endpoints: ['http://h:1']}}"
    for text, message in (
            ("models: {m: {providers: [p], policy: {name: least_tokens, options: {bogus: 1}}}}" + providers, "bogus"),
            ("models: {m: {providers: [p]}}\nproviders: {p: {endpoints: ['http://h:1'], prefill_endpoints: "
             "['http://h:2']}}", "only for kind switchyard-pd")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(SystemExit, match=message):
            main(["gateway", "--config", str(bad), "--check"])


def test_json_log_lines(start_fakes, start_gateway) -> None:
    """`log_format: json`: every line the gateway logs is one JSON object with its time, level, logger, request id
    and message (here, among others, an endpoint found unhealthy)."""
    import orjson

    from tests.gateway.conftest import gateway_config
    from tests.support.wait import wait_until

    (fake,) = start_fakes("e0")
    fake.control(healthy=False)
    gateway = start_gateway(gateway_config({"p": [fake.url]}, log_format="json", log_level="INFO"),
                            wait_path="/health")

    def logged() -> list[str] | None:
        lines = [line for line in gateway.log().splitlines() if line.strip()]
        return lines if any("unhealthy" in line for line in lines) else None
    lines = wait_until(logged, "the endpoint logged unhealthy")
    records = [orjson.loads(line) for line in lines]
    assert all(set(r) >= {"time", "level", "logger", "request_id", "message"} for r in records), records
    assert any(r["level"] == "WARNING" and "unhealthy" in r["message"] for r in records)
