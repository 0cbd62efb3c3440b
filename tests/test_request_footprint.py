"""How many of our modules one plain chat request executes, gateway and worker in one process.

A newcomer follows a request by opening the files it runs through; this test keeps that number from creeping
back up (docs/architecture.md lists the modules). It serves a real gateway (the lean server included, as in
production) in front of a real worker on the bundled model, sends one warm-up request, then traces the calls
of a second, identical one in every thread (the event loop, the engine's thread, executors) and counts the
source files of ours that ran. Background pollers are set far apart so that only the request's code runs.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from backends.server.__main__ import build_configs, build_parser
from backends.server.app import create_app as create_worker_app
from gateway.app import create_app as create_gateway_app, make_site
from gateway.config.gateway_config import parse_config
from gateway.server.middlewares import DRAIN
from tests.support.ports import free_port
from tests.support.wait import await_until

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
GATEWAY_PACKAGES = ("gateway", "cache", "policies")   # what the gateway process runs
WORKER_PACKAGES = ("backends",)                       # what the worker process runs
# What one request may run (issue 46's caps; docs/architecture.md lists the modules). A feature the request does
# not use (tools, response_format, the response cache, API keys, a continuation) runs none of its code. Lower
# these as the path is cut; never raise them without saying why in the commit.
MAX_GATEWAY_MODULES = 20
MAX_WORKER_MODULES = 24
BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 4, "temperature": 0}


class CallRecorder:
    """A trace function for `sys.settrace` and `threading.settrace` that notes the file of every call while
    it is on. It returns None, so no line inside a function is traced: only entering a frame costs."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.on and event == "call":
            self.files.add(frame.f_code.co_filename)

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Traces this thread and every thread started from now on (the engine's, the executors')."""
        threading.settrace(self)
        sys.settrace(self)
        try:
            yield
        finally:
            sys.settrace(None)
            threading.settrace(None)   # type: ignore[arg-type]


def our_modules(files: set[str], packages: tuple[str, ...]) -> list[str]:
    found = []
    for name in files:
        path = Path(name)
        if path.is_relative_to(REPO_ROOT) and path.relative_to(REPO_ROOT).parts[0] in packages:
            found.append(str(path.relative_to(REPO_ROOT)))
    return sorted(found)


def gateway_config(worker_url: str, gateway_port: int, tokenizer_dir: str) -> Any:
    """The gateway as `switchyard serve` configures it for its workers, pollers far apart."""
    raw = {
        "listen": {"host": "127.0.0.1", "port": gateway_port},
        "models": {"smollm2": {"tokenizer": tokenizer_dir, "providers": ["local"]}},
        "providers": {"local": {"kind": "openai", "endpoints": [worker_url], "offers_load": True,
                                "offers_kv_events": True}},
        "pollers": {"health_interval_s": 3600, "load_interval_s": 3600, "kv_events_interval_s": 3600},
    }
    return parse_config(yaml.safe_dump(raw), {})


async def test_a_plain_chat_request_runs_few_of_our_modules() -> None:
    recorder = CallRecorder()
    worker_port, gateway_port = free_port(), free_port()
    with recorder.installed():
        server_config, engine_config = build_configs(build_parser().parse_args(
            ["--model", "smollm2", "--served-model-name", "smollm2", "--port", str(worker_port),
             "--max-num-seqs", "4"]))
        worker = web.AppRunner(create_worker_app(server_config, engine_config))
        await worker.setup()
        await web.TCPSite(worker, "127.0.0.1", worker_port).start()
        config = gateway_config(f"http://127.0.0.1:{worker_port}", gateway_port, server_config.model_dir)
        gateway = web.AppRunner(create_gateway_app(config))
        await gateway.setup()
        await make_site(gateway, config).start()
        try:
            async with aiohttp.ClientSession() as client:
                url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
                for measured in (False, True):   # the first request warms caches and lazy imports up
                    recorder.on = measured
                    async with client.post(url, json=BODY) as response:
                        answer = await response.json()
                    # the gateway's handler may still be finishing (its lease, the access log) after the client
                    # has the whole answer: that is the request's code too
                    await await_until(lambda: gateway.app[DRAIN].num_in_flight == 0, "the gateway to finish")
                    recorder.on = False
                    assert response.status == 200, answer
                    assert answer["choices"][0]["message"]["content"]
        finally:
            await gateway.cleanup()
            await worker.cleanup()

    gateway_modules = our_modules(recorder.files, GATEWAY_PACKAGES)
    worker_modules = our_modules(recorder.files, WORKER_PACKAGES)
    print(f"\ngateway modules executed ({len(gateway_modules)}):", *gateway_modules, sep="\n  ")
    print(f"worker modules executed ({len(worker_modules)}):", *worker_modules, sep="\n  ")
    assert gateway_modules and worker_modules   # the recorder saw both sides
    assert len(gateway_modules) <= MAX_GATEWAY_MODULES, gateway_modules
    assert len(worker_modules) <= MAX_WORKER_MODULES, worker_modules
