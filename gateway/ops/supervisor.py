"""`switchyard serve`: the whole system on one machine — workers, then the gateway in front of them.

A supervisor only: it starts each part as its own process (the gateway never imports `backends`),
waits for them to be healthy, prints the URL, and stops all of them on Ctrl-C or when one dies.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

WORKER_KEY_ENV = "SWITCHYARD_WORKER_API_KEY"   # what a worker reads its --api-key from (backends/server/auth.py)
KV_KEY_ENV = "SWITCHYARD_KV_KEY"   # what a worker reads its --kv-key from (backends/kv_transfer/auth.py)

MODEL_NAME = "smollm2"


@dataclass(frozen=True, slots=True)
class ServePlan:
    host: str = "127.0.0.1"               # the gateway's interface
    port: int = 8080                      # the gateway's port
    model: str = "smollm2"                # worker --model spec (bundled model, HF folder or GGUF)
    served_model_name: str = MODEL_NAME   # the name clients send
    num_prefill_workers: int = 1          # disaggregated pool: prefill
    num_decode_workers: int = 1           # disaggregated pool: decode
    num_both_workers: int = 0             # unified workers (a fallback provider when PD pools exist)
    worker_args: tuple[str, ...] = ()     # extra flags for every worker (e.g. --dtype bfloat16)
    gateway: Mapping[str, Any] = field(default_factory=dict)  # merged into the generated gateway config
    gateway_workers: int | None = None    # gateway processes on the port; None: auto (cores up to 4 with
                                          # gateway.redis_url, else 1: processes share state through Redis)
    kv_store: bool = False                # start a Mooncake Store master; every worker shares KV through it


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_plan(argv: Sequence[str]) -> ServePlan:
    parser = argparse.ArgumentParser(prog="switchyard serve", description=__doc__)
    parser.add_argument("--config", help="YAML with any of the fields below plus a `gateway:` section")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--model")
    parser.add_argument("--prefill-workers", type=int, dest="num_prefill_workers")
    parser.add_argument("--decode-workers", type=int, dest="num_decode_workers")
    parser.add_argument("--both-workers", type=int, dest="num_both_workers")
    parser.add_argument("--gateway-workers", type=int, dest="gateway_workers",
                        help="gateway processes on the port (N > 1 needs gateway.redis_url; default: auto)")
    parser.add_argument("--kv-store", action="store_true", default=None,
                        help="start a Mooncake Store master and give every worker --kv-store (docs/kv_tiers.md)")
    parser.add_argument("--worker-arg", action="append", dest="worker_args", default=None,
                        help="extra flag for every worker, repeatable (e.g. --worker-arg=--dtype=bfloat16)")
    options = vars(parser.parse_args(argv))
    raw: dict[str, Any] = {}
    if options.pop("config"):
        with open(parser.parse_args(argv).config, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh) or {}
    raw.update({k: v for k, v in options.items() if v is not None})
    unknown = set(raw) - set(ServePlan.__dataclass_fields__)
    if unknown:
        raise SystemExit(f"switchyard serve: unknown settings {sorted(unknown)}")
    if "worker_args" in raw:
        raw["worker_args"] = tuple(raw["worker_args"])
    plan = ServePlan(**raw)
    if plan.num_prefill_workers + plan.num_decode_workers + plan.num_both_workers == 0:
        raise SystemExit("switchyard serve: no workers requested")
    if plan.gateway_workers is not None and plan.gateway_workers > 1 and not plan.gateway.get("redis_url"):
        raise SystemExit("switchyard serve: gateway_workers > 1 needs gateway.redis_url (the processes share "
                         "sessions, rate limits and load through Redis)")
    if (plan.num_prefill_workers == 0) != (plan.num_decode_workers == 0):
        raise SystemExit("switchyard serve: prefill and decode workers come in pools of at least one each")
    return plan


def resolve_model_dir(spec: str) -> Path:
    """Convert/locate the model once, before any worker starts (the conversion shows its progress)."""
    code = "import sys; from backends.worker.loader import resolve_model; print(resolve_model(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, spec], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def gateway_config(plan: ServePlan, model_dir: Path, pools: Mapping[str, list[str]],
                   worker_key: str | None = None) -> dict[str, Any]:
    """`worker_key`: the key the workers were started with (the providers send it)."""
    providers: dict[str, Any] = {}
    chain: list[str] = []
    if pools["prefill"]:
        providers["local-pd"] = {"kind": "switchyard-pd", "prefill_endpoints": pools["prefill"],
                                 "endpoints": pools["decode"], "offers_load": True, "offers_kv_events": True,
                                 "offers_token_ids": True}
        chain.append("local-pd")
    if pools["both"]:
        providers["local"] = {"kind": "openai", "endpoints": pools["both"],
                              "offers_load": True, "offers_kv_events": True, "offers_token_ids": True}
        chain.append("local")
    if worker_key is not None:
        for provider in providers.values():
            provider["api_key"] = worker_key
    config: dict[str, Any] = {
        "listen": {"host": plan.host, "port": plan.port},
        "models": {plan.served_model_name: {"tokenizer": str(model_dir), "providers": chain,
                                            "policy": {"name": "session_affinity"}}},
        "providers": providers,
    }
    for key, value in plan.gateway.items():  # user overrides: api_keys, redis_url, listen.tls, ...
        if isinstance(value, Mapping) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def wait_healthy(proc: subprocess.Popen, url: str, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{name} was not healthy after {timeout_s:.0f} s ({url})")


class Supervisor:
    """Owns the child processes; `stop()` terminates them all, politely then firmly."""

    def __init__(self) -> None:
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
        print(f"switchyard serve: starting {name}", flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True,   # our SIGINT handling, not the terminal's
                                env=None if env is None else {**os.environ, **env})
        self.children.append((name, proc))
        return proc

    def first_dead(self) -> tuple[str, int] | None:
        for name, proc in self.children:
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in self.children:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_kv_store(sup: Supervisor) -> str:
    """A Mooncake Store master on free local ports (the kv-store extra installs it beside this Python);
    its --kv-store URL."""
    binary = Path(sys.executable).with_name("mooncake_master")
    if not binary.exists():
        raise RuntimeError("--kv-store needs mooncake_master: pip install -e '.[kv-store]' "
                           "(and apt-get install libibverbs1 libnuma1)")
    port, metrics_port = free_port(), free_port()
    proc = sup.start(f"Mooncake Store master on :{port}", [
        str(binary), f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics_port}",
        "--metrics_host=127.0.0.1", "--enable_metric_reporting=false"])
    wait_healthy(proc, f"http://127.0.0.1:{metrics_port}/health", "the Mooncake Store master", timeout_s=60)
    return f"mooncake://127.0.0.1:{port}"


def start_workers(sup: Supervisor, plan: ServePlan, kv_store: str | None = None,
                  worker_key: str | None = None, kv_key: str | None = None) -> dict[str, list[str]]:
    """The workers, each guarded by `worker_key`, their KV listeners by `kv_key` (both passed in the environment:
    not in `ps`)."""
    keys = {WORKER_KEY_ENV: worker_key, KV_KEY_ENV: kv_key}
    env = {name: key for name, key in keys.items() if key is not None} or None
    pools: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
    counts = {"prefill": plan.num_prefill_workers, "decode": plan.num_decode_workers,
              "both": plan.num_both_workers}
    started = []
    for role, count in counts.items():
        for i in range(count):
            port = free_port()
            name = f"{role} worker {i} on :{port}"
            cmd = [sys.executable, "-m", "backends.server", "--model", plan.model, "--role", role,
                   "--port", str(port), "--served-model-name", plan.served_model_name, *plan.worker_args,
                   *(() if kv_store is None else ("--kv-store", kv_store))]
            started.append((sup.start(name, cmd, env), f"http://127.0.0.1:{port}", name, role))
    for proc, url, name, role in started:
        wait_healthy(proc, url + "/health", name, timeout_s=600)
        pools[role].append(url)
    return pools


def main(argv: Sequence[str]) -> None:
    plan = parse_plan(argv)
    model_dir = resolve_model_dir(plan.model)
    sup = Supervisor()
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        # The workers' ports answer the gateway alone, not whoever else reaches 127.0.0.1: with the key in
        # SWITCHYARD_WORKER_API_KEY when one is set (so that other tools can read the workers), else one per run.
        worker_key = os.environ.get(WORKER_KEY_ENV) or secrets.token_urlsafe(24)
        # The KV listeners answer the pool's workers alone, likewise; the gateway never holds this key.
        kv_key = os.environ.get(KV_KEY_ENV) or secrets.token_urlsafe(24)
        pools = start_workers(sup, plan, start_kv_store(sup) if plan.kv_store else None, worker_key, kv_key)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="switchyard-gateway-", delete=False) as fh:
            yaml.safe_dump(gateway_config(plan, model_dir, pools, worker_key), fh)
        workers = "auto" if plan.gateway_workers is None else str(plan.gateway_workers)
        gateway = sup.start("gateway", [sys.executable, "-m", "gateway.cli", "gateway", "--config", fh.name,
                                        "--workers", workers])
        scheme = "https" if plan.gateway.get("listen", {}).get("tls") else "http"
        if scheme == "http":
            wait_healthy(gateway, f"http://{plan.host}:{plan.port}/health", "gateway", timeout_s=60)
        print(f"\nswitchyard is serving {plan.served_model_name!r} at {scheme}://{plan.host}:{plan.port}/v1 "
              f"(workers: {', '.join(u for urls in pools.values() for u in urls)}). Ctrl-C stops it.\n", flush=True)
        while not stopping:
            dead = sup.first_dead()
            if dead:
                print(f"switchyard serve: {dead[0]} exited with code {dead[1]}; stopping", file=sys.stderr)
                raise SystemExit(1)
            time.sleep(0.5)
    except RuntimeError as exc:
        print(f"switchyard serve: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        print("switchyard serve: stopping", flush=True)
        sup.stop()
        if "fh" in locals():
            os.unlink(fh.name)
