"""The docker-compose deployment as its images would run it. No Docker engine runs here, so each image's Python
environment is built as its Dockerfile builds it (tests/support/dockerfile.py: a fresh venv, the Dockerfile's own
pip and python lines with their extras, only the files it copies), and each service is started from it with the
compose file's command, environment and gateway config (tests/support/compose_run.py); then requests go through
gateway -> prefill/decode -> answer.

One substitution: the TORCH_SPEC build-arg (the worker image's torch, and the gateway's tokenizer stage's) installs
torch from download.pytorch.org, which this machine and CI cannot reach; it is `torch==2.13.0` here, the Makefile's
pin, which pip takes from a local wheel.
The unified `both` pool is not started (its address leads nowhere), so every answer comes from the prefill/decode
pools. Both images are built once per session (a minute or two: torch, the CPU kernels, the model conversion).
"""
from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml

from tests.support.compose_run import Addresses, Service
from tests.support.dockerfile import Build, Stage, Unsupported
from tests.support.redis_proc import RedisProc
from tests.support.wait import wait_until

# The first test's set-up builds both images: minutes on 2 busy cores, past the suite's 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
TORCH_SPEC = "torch==2.13.0"   # for the images' default, which names an index this machine cannot reach
# The compose file's own knobs. WORKER_THREADS=1: two workers on 2 cores. GATEWAY_WORKERS=1: one gateway process,
# so that its /ready speaks for the process the requests reach (each of `auto`'s processes polls its endpoints'
# health on its own, and a request may land on one that has not yet seen them healthy).
COMPOSE_ENV = {"SWITCHYARD_API_KEY": "sk-client", "SWITCHYARD_METRICS_KEY": "sk-metrics",
               "SWITCHYARD_WORKER_API_KEY": "sk-worker", "WORKER_THREADS": "1", "GATEWAY_WORKERS": "1"}
# transformers' greedy answer, "The capital of Japan is Tokyo." and its end, leads its runner-up by at least 0.97
# at every token in float32 and in bf16: float rounding (a cached prefix, another kernel) cannot flip it.
MESSAGES = [{"role": "user", "content": "What is the capital of Japan?"}]


@pytest.fixture(scope="session")
def services() -> dict[str, Any]:
    """docker/compose.yaml as docker-compose resolves it, with COMPOSE_ENV."""
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.fail("docker-compose is not installed (apt-get install -y docker-compose; make test does this)")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **COMPOSE_ENV}
    out = subprocess.run([tool, "-f", str(DOCKER / "compose.yaml"), "config"], env=env, cwd=REPO,
                         check=True, capture_output=True, text=True)
    return yaml.safe_load(out.stdout)["services"]


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Stage]:
    """Both images, built side by side (each is mostly pip and a compiler waiting on one core)."""
    builds = {name: Build(DOCKER / f"{name}.Dockerfile", REPO, tmp_path_factory.mktemp(f"{name}-image"),
                          {"TORCH_SPEC": TORCH_SPEC}) for name in ("worker", "gateway")}
    with ThreadPoolExecutor(len(builds)) as pool:
        done = {name: pool.submit(build.run) for name, build in builds.items()}
        return {name: future.result().image for name, future in done.items()}


@pytest.fixture(scope="session")
def worker_image(images: dict[str, Stage]) -> Stage:
    return images["worker"]


@pytest.fixture(scope="session")
def gateway_image(images: dict[str, Stage]) -> Stage:
    return images["gateway"]


class Deployment:
    """Redis, the Mooncake master, one prefill and one decode worker, and a gateway, as compose starts them."""

    def __init__(self, services: dict[str, Any], worker: Stage, gateway: Stage, log_dir: Path) -> None:
        self.addresses = Addresses(services)
        self.redis = RedisProc().start()
        self.addresses.bind("redis", 6379, self.redis.port)
        self.started: list[Service] = []
        self.ca = trustme.CA()
        self._mount(services["gateway"], gateway)
        try:
            for name in ("mooncake-master", "prefill", "decode"):
                self.started.append(Service(name, services[name], worker, self.addresses, log_dir))
            self.started.append(Service("gateway", services["gateway"], gateway, self.addresses, log_dir))
            for service in self.started:
                service.wait_healthy(timeout_s=300.0)
        except BaseException:
            self.stop()
            raise
        self.url = f"https://127.0.0.1:{self.addresses.port('gateway', 8443)}"
        self.ssl = ssl.create_default_context()
        self.ca.configure_trust(self.ssl)

    def _mount(self, spec: dict[str, Any], stage: Stage) -> None:
        """The gateway's volumes: its config (addresses rewritten, nothing else) and a certificate for 127.0.0.1."""
        for volume in spec["volumes"]:
            source, target_path, _mode = volume.split(":")
            target = stage.host_path(target_path)
            if source == str(DOCKER / "gateway.yaml"):
                target.parent.mkdir(parents=True, exist_ok=True)
                text = (DOCKER / "gateway.yaml").read_text()
                target.write_text(self.addresses.rewrite_config(text, "gateway", stage))
            elif source == str(DOCKER / "certs"):
                target.mkdir(parents=True, exist_ok=True)
                cert = self.ca.issue_cert("127.0.0.1")
                cert.private_key_pem.write_to_path(str(target / "key.pem"))
                cert.private_key_and_cert_chain_pem.write_to_path(str(target / "cert.pem"))
            else:
                pytest.fail(f"the gateway mounts {source}, which this test does not provide")

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST", headers={
            "Authorization": f"Bearer {COMPOSE_ENV['SWITCHYARD_API_KEY']}", "Content-Type": "application/json",
            **(headers or {})})
        return urllib.request.urlopen(request, timeout=120, context=self.ssl)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=5, context=self.ssl) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.log()}" for s in self.started)

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def deployment(services: dict[str, Any], worker_image: Stage, gateway_image: Stage,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    running = Deployment(services, worker_image, gateway_image, tmp_path_factory.mktemp("compose-logs"))
    try:
        wait_until(running.ready, "the gateway's /ready", timeout_s=60.0, interval_s=0.2)
        yield running
    finally:
        running.stop()


def chat(deployment: Deployment, stream: bool, headers: dict[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    body = {"model": "smollm2", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True}} if stream else \
        {"model": "smollm2", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    with deployment.post("/v1/chat/completions", body, headers) as response:
        if not stream:
            answer = json.loads(response.read())
            return answer["choices"][0]["message"]["content"], answer["usage"]
        text, usage = "", {}
        for line in response.read().decode().splitlines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                usage = chunk.get("usage") or usage
        return text, usage


def test_a_chat_goes_through_gateway_prefill_and_decode(deployment: Deployment) -> None:
    text, usage = chat(deployment, stream=False)
    streamed, streamed_usage = chat(deployment, stream=True, headers={"x-session-affinity": "agent-1"})
    assert text.strip(), deployment.logs()
    assert streamed == text   # greedy: the same answer, streamed, through the same two pools
    assert usage["completion_tokens"] > 1 and streamed_usage["prompt_tokens"] == usage["prompt_tokens"]


def test_the_gateway_counts_with_the_model_tokenizer(deployment: Deployment, worker_image: Stage,
                                                     gateway_image: Stage) -> None:
    """The gateway's own count (POST /v1/messages/count_tokens, the count it routes and hashes blocks by) is
    the worker's prompt_tokens: the same tokenizer and chat template, not chars/4."""
    _, usage = chat(deployment, stream=False)
    with deployment.post("/v1/messages/count_tokens", {"model": "smollm2", "messages": MESSAGES}) as response:
        counted = json.loads(response.read())["input_tokens"]
    assert counted == usage["prompt_tokens"]
    config = yaml.safe_load((DOCKER / "gateway.yaml").read_text())
    tokenizer = gateway_image.host_path(config["models"]["smollm2"]["tokenizer"])
    converted = worker_image.host_path(worker_image.env["SWITCHYARD_CACHE"]) / "models" / "smollm2-135m-instruct"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tokenizer / name).read_bytes() == (converted / name).read_bytes(), name
    # ... and it did so without the worker's packages: the tokenizer stage's torch and transformers stayed there
    absent = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'transformers')))"
    found = subprocess.run([gateway_image.which("python"), "-c", absent], env=gateway_image.process_env())
    assert found.returncode == 0


@pytest.mark.parametrize("line", [
    "ADD https://example.com/tool.tar.gz /opt/",   # an instruction the replay does not know
    "RUN curl -sSf https://example.com/install.sh | sh",   # a RUN step it does not know
    "RUN pip install . ; echo installed",          # a shell separator other than &&
    "ENV NAME value",                              # ENV's legacy form
    "COPY --chown=1000:1000 gateway ./gateway",    # a COPY flag
    "FROM debian:12",                              # a base image it has no stand-in for
    "CMD switchyard gateway",                      # the shell form of a command
    "RUN python -c \"open('/etc/motd', 'w')\"",   # an absolute path the replay cannot move into its folder
])
def test_a_construct_the_replay_does_not_understand_fails(line: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Build, "_call", lambda *args, **kwargs: None)   # no venv: it fails before needing one
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM python:3.11-slim\nWORKDIR /app\n{line}\n")
    with pytest.raises(Unsupported):
        Build(dockerfile, REPO, tmp_path).run()
