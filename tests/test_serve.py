"""`switchyard serve` end to end: the all-in-one launcher starts a prefill and a decode worker and the
gateway (switchyard-pd), the unchanged OpenAI SDK gets a chat completion through it, and SIGINT stops
every child process; with two prefill workers, `x-session-affinity` keeps each session's turns on one."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.kv_transfer.protocol import HEADER_SIZE, FrameType, decode_header, encode_json_frame
from policies.session_affinity import HashRing, ring_hash
from tests.support.ports import free_port
from tests.support.wait import wait_until
from tests.support.worker_proc import REPO_ROOT

WORKER_KEY = "sk-serve-workers"

SWITCHYARD = Path(REPO_ROOT) / ".venv" / "bin" / "switchyard"


def children_of(pid: int) -> set[int]:
    """Every descendant process id (from /proc), so none can hide in a new session."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def serving(tmp_path: Path, *args: str, env: dict[str, str] | None = None
            ) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """`switchyard serve ARGS` with its log in tmp_path; on exit, whatever the test left running (it
    failed before `stop_with_sigint`) is killed, children included."""
    log_path = tmp_path / "serve.log"
    log = log_path.open("wb")
    proc = subprocess.Popen([str(SWITCHYARD), "serve", *args], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    try:
        yield proc, log_path
    finally:
        children = children_of(proc.pid) if proc.poll() is None else set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def stop_with_sigint(proc: subprocess.Popen[bytes], log_path: Path) -> set[int]:
    """SIGINT the launcher; it must exit 0 and leave none of its children running."""
    children = children_of(proc.pid)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, log_path.read_text()
    leftover = {pid for pid in children if alive(pid)}
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert not leftover, f"children still running after SIGINT: {leftover}\n{log_path.read_text()}"
    return children


def test_serve_answers_the_openai_sdk_and_sigint_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    # No prefix cache: the streamed request below then runs exactly the steps the first one ran.
    with serving(tmp_path, "--port", str(port), "--worker-arg=--threads=1", "--worker-arg=--num-blocks=64",
                 "--worker-arg=--no-prefix-caching") as (proc, log_path):
        def ready() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(ready, "switchyard serve to be ready", timeout_s=240)
        assert len(children_of(proc.pid)) >= 3   # prefill worker, decode worker, gateway
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens >= 1
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
            stream=True)
        # exact: the same request alone again, without prefix cache, so every worker step repeats the
        # first request's shapes through the same kernels on the same machine (--threads=1 everywhere)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == reply.choices[0].message.content
        # the workers answer the gateway alone: a key drawn for the run, which the gateway sends
        worker_ports = re.findall(r"starting \w+ worker \d+ on :(\d+)", log_path.read_text())
        assert len(worker_ports) == 2, log_path.read_text()
        for worker_port in worker_ports:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"http://127.0.0.1:{worker_port}/v1/models", timeout=5)
            assert refused.value.code == 401
        assert_kv_listener_keyed(log_path.read_text(), worker_ports)
        stop_with_sigint(proc, log_path)


def assert_kv_listener_keyed(log: str, worker_ports: list[str]) -> None:
    """The prefill worker's KV listener has a key drawn for the run: it challenges a stranger first and refuses
    one who asks for a hold without proof; the decode worker's pulls proved it (no wrong proof counted)."""
    kv_ports = re.findall(r"KV transfer listener on 127\.0\.0\.1:(\d+)", log)
    assert len(kv_ports) == 1, log
    with socket.create_connection(("127.0.0.1", int(kv_ports[0])), timeout=10) as sock:
        sock.sendall(encode_json_frame(FrameType.PULL, {"transfer_id": "x", "num_blocks": 1}))
        frames = sock.makefile("rb").read()   # until the listener closes
    header = decode_header(frames[:HEADER_SIZE])
    assert header.frame_type is FrameType.CHALLENGE, frames
    assert decode_header(frames[HEADER_SIZE + header.meta_len:][:HEADER_SIZE]).frame_type is FrameType.ERROR
    counts = []
    for worker_port in worker_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker_port}/metrics", timeout=5) as r:
            counts += re.findall(r'switchyard_kv_transfer_refused_connections_total\{reason="(\w+)"\} (\S+)',
                                 r.read().decode())
    assert sorted(counts) == [("missing", "0.0"), ("missing", "1.0"), ("wrong", "0.0"), ("wrong", "0.0")], counts


def test_serve_kv_store_starts_a_master_every_worker_shares(tmp_path: Path) -> None:
    with serving(tmp_path, "--port", str(free_port()), "--prefill-workers", "0", "--decode-workers", "0",
                 "--both-workers", "2", "--kv-store", "--worker-arg=--threads=1",
                 "--worker-arg=--num-blocks=64", env={"SWITCHYARD_WORKER_API_KEY": WORKER_KEY}) as (proc, log_path):
        wait_until(lambda: b"switchyard is serving" in log_path.read_bytes() or proc.poll() is not None,
                   "switchyard serve to be ready", timeout_s=240)
        assert proc.poll() is None, log_path.read_text()
        text = log_path.read_text()
        assert "Mooncake Store master" in text
        workers = text.split("(workers: ")[1].split(")")[0].split(", ")
        assert len(workers) == 2
        for url in workers:
            load = urllib.request.Request(url + "/load", headers={"Authorization": f"Bearer {WORKER_KEY}"})
            with urllib.request.urlopen(load, timeout=5) as r:   # the key given to serve: its workers take it
                tiers = {t["medium"]: t for t in orjson.loads(r.read())["kv_tiers"]}
            assert tiers["store"]["up"], url
        assert len(stop_with_sigint(proc, log_path)) >= 4   # the master, two workers, the gateway


def num_chat_requests(url: str) -> int:
    """Chat completions a worker answered, by its own /metrics (a prefill leg is one)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == "switchyard_requests_total" and sample.labels["route"].endswith("chat/completions")
                   and sample.labels["status"] == "200"))


def sessions_homed_on(prefill_urls: list[str], num_each: int) -> dict[str, str]:
    """Session keys, `num_each` of them whose ring home (policies/session_affinity.py) is each prefill worker, so
    that the sessions must spread over both."""
    ring = HashRing(prefill_urls, 100)
    keys: dict[str, str] = {}
    candidates = (f"s{i}" for i in range(1000))
    while min(sum(1 for home in keys.values() if home == url) for url in prefill_urls) < num_each:
        key = next(candidates)
        home = ring.first(ring_hash(key), dict.fromkeys(prefill_urls))
        assert home is not None
        if sum(1 for h in keys.values() if h == home) < num_each:
            keys[key] = home
    return keys


def test_serve_keeps_each_sessions_turns_on_one_prefill_worker(tmp_path: Path) -> None:
    port = free_port()
    with serving(tmp_path, "--port", str(port), "--prefill-workers", "2", "--worker-arg=--threads=1",
                 "--worker-arg=--num-blocks=128", env={"SWITCHYARD_WORKER_API_KEY": WORKER_KEY}) as (proc, log_path):
        wait_until(lambda: b"switchyard is serving" in log_path.read_bytes() or proc.poll() is not None,
                   "switchyard serve to be ready", timeout_s=300)
        assert proc.poll() is None, log_path.read_text()
        prefill = [f"http://127.0.0.1:{p}" for p in re.findall(r"starting prefill worker \d+ on :(\d+)",
                                                                 log_path.read_text())]
        assert len(prefill) == 2, log_path.read_text()
        sessions = sessions_homed_on(prefill, num_each=2)
        conversations = {key: [{"role": "user", "content": f"Name a colour, {key}."}] for key in sessions}
        served_on: dict[str, list[str]] = {key: [] for key in sessions}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for turn in range(3):
            for key, messages in conversations.items():   # the sessions' turns interleave
                before = {url: num_chat_requests(url) for url in prefill}
                reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4,
                                                       temperature=0, extra_headers={"x-session-affinity": key})
                after = {url: num_chat_requests(url) for url in prefill}
                served_on[key].extend(url for url in prefill if after[url] > before[url])
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": f"And another one ({turn})?"}]
        # Each turn was one prefill leg, and each session's legs went to one worker: its ring home.
        assert served_on == {key: [home] * 3 for key, home in sessions.items()}, (sessions, served_on)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as r:
            status = orjson.loads(r.read())
        assert status["num_sessions"] == len(sessions)
        decisions = status["models"][0]["decisions"]
        assert decisions.get("affinity_new") == len(sessions), decisions          # "sessions started"
        assert decisions.get("affinity_hit") == 2 * len(sessions), decisions
        stop_with_sigint(proc, log_path)
