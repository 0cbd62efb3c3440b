"""The OpenAI Node SDK (npm `openai`, pinned) run by Debian's node against the running gateway, with
`x-session-affinity`. The package is installed once into ~/.cache/switchyard/npm and reused."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.clients.conftest import MODEL, System, same_worker

pytestmark = pytest.mark.slow

# The newest release line that still runs on Debian's Node 20 (7.x asks for Node 22).
OPENAI_NODE_VERSION = "6.30.1"
SCRIPT = Path(__file__).with_name("openai_client.mjs")


def openai_node_package() -> Path:
    """The folder whose node_modules holds the pinned SDK (installed on first use)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard" / "npm"
    folder = cache / f"openai-{OPENAI_NODE_VERSION}"
    if not (folder / "node_modules" / "openai" / "package.json").exists():
        npm = shutil.which("npm")
        assert npm is not None, "npm is not installed (make test installs Debian's npm)"
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--no-save", "--loglevel=error",
                        f"openai@{OPENAI_NODE_VERSION}"], cwd=folder, check=True, timeout=600)
    return folder


def test_openai_node_sdk(system: System) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed (make test installs Debian's nodejs)"
    folder = openai_node_package()
    script = folder / SCRIPT.name          # beside node_modules, so that `import "openai"` resolves there
    shutil.copyfile(SCRIPT, script)
    with same_worker(system, 2):
        run = subprocess.run([node, str(script), system.openai_base_url, system.api_key, MODEL, "node-session"],
                             capture_output=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr.decode(errors="replace")
    result = orjson.loads(run.stdout.strip().splitlines()[-1])
    assert result["whole"]["text"] and result["whole"]["finish"] in ("stop", "length")
    assert 0 < result["whole"]["usage"]["completion_tokens"] <= 8
    assert result["stream"]["text"] and result["stream"]["finish"] in ("stop", "length")
    assert 0 < result["stream"]["usage"]["completion_tokens"] <= 8
    assert result["badKeyStatus"] == 401
