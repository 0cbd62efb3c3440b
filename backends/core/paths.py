"""Where the workers keep what they build or convert once per machine: `$SWITCHYARD_CACHE`, by default
~/.cache/switchyard (converted models, compiled CPU kernels, trained draft heads). Reads the environment
only; creates nothing.
"""
from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("SWITCHYARD_CACHE", Path.home() / ".cache" / "switchyard"))
