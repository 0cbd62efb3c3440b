"""curl against the running gateway: a whole chat completion and a stream (-N), with `x-session-affinity`."""
from __future__ import annotations

import shutil
import subprocess

import orjson
import pytest

from tests.clients.conftest import MODEL, SESSION_HEADER, System, same_worker

pytestmark = pytest.mark.slow


def curl(system: System, body: dict[str, object], *extra: str) -> subprocess.CompletedProcess[bytes]:
    executable = shutil.which("curl")
    assert executable is not None, "curl is not installed"
    return subprocess.run(
        [executable, "-sS", "--fail-with-body", "--max-time", "120", *extra,
         "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {system.api_key}",
         "-H", f"{SESSION_HEADER}: curl-session", "--data-binary", orjson.dumps(body).decode(),
         system.openai_base_url + "/chat/completions"],
        capture_output=True, timeout=180, check=False)


def test_curl_whole_and_streamed(system: System) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0}
    with same_worker(system, 2):
        whole = curl(system, body)
        streamed = curl(system, {**body, "stream": True, "stream_options": {"include_usage": True}}, "-N")
    assert whole.returncode == 0, whole.stderr
    reply = orjson.loads(whole.stdout)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert streamed.returncode == 0, streamed.stderr
    events = [e for e in streamed.stdout.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] <= 8
