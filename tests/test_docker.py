"""The docker-compose deployment, checked statically: no Docker engine runs here, so nothing is built.

docker-compose itself validates the file; the gateway's own loader parses its config; and every
command line a service runs is accepted by the CLI that will run it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker" / "compose.yaml"
ENV = {**os.environ, "SWITCHYARD_API_KEY": "sk-test", "SWITCHYARD_METRICS_KEY": "sk-metrics-test",
       "REDIS_URL": "redis://redis:6379/0"}


@pytest.fixture(scope="module")
def resolved() -> dict:
    """The compose file as docker-compose resolves it (anchors merged, variables substituted)."""
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed (apt-get install -y docker-compose; .ci/run does this)")
    out = subprocess.run([tool, "-f", str(COMPOSE), "config"], env=ENV, cwd=REPO, check=True,
                         capture_output=True, text=True)
    return yaml.safe_load(out.stdout)


def test_compose_has_the_whole_system(resolved: dict) -> None:
    services = resolved["services"]
    assert {"redis", "gateway", "prefill", "decode", "both", "mooncake-master"} <= set(services)
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        assert "healthcheck" in service, name
    assert services["gateway"]["deploy"]["replicas"] >= 2
    mounts = " ".join(str(v) for v in services["gateway"]["volumes"])
    assert "certs" in mounts and "gateway.yaml" in mounts


def test_gateway_config_parses_with_the_gateway_loader(tmp_path: Path) -> None:
    from gateway.config.gateway_config import load_config

    config = load_config(REPO / "docker" / "gateway.yaml", environ=ENV)
    assert config.redis_url == "redis://redis:6379/0"
    assert config.listen.tls is not None
    assert config.models["smollm2"].providers == ("local-pd", "local")
    assert config.providers["local-pd"].prefill_endpoints == ("http://prefill:8000",)


def test_every_service_command_exists_in_the_cli(resolved: dict) -> None:
    from backends.server.__main__ import build_parser

    checked = 0
    for name, service in resolved["services"].items():
        command = service.get("command")
        if name == "redis" or not command:
            continue
        if service.get("entrypoint") == ["mooncake_master"]:
            flags = [arg.split("=")[0].lstrip("-") for arg in command]
            help_text = subprocess.run([str(Path(sys.executable).with_name("mooncake_master")), "--helpfull"],
                                       capture_output=True, text=True, timeout=30).stdout
            assert all(f"-{flag} (" in help_text for flag in flags), flags
            checked += 1
            continue
        subcommand, args = command[0], command[1:]
        if subcommand == "worker":
            build_parser().parse_args(args)  # exits (SystemExit) on an unknown flag
        elif subcommand == "gateway":
            from gateway.cli import gateway_parser
            options = gateway_parser().parse_args(args)  # exits (SystemExit) on an unknown flag
            assert options.config and not options.reuse_port
        else:
            pytest.fail(f"service {name} runs an unknown subcommand {subcommand!r}")
        checked += 1
    assert checked == 5
