"""Long work shows a progress bar on a terminal and nothing in a log: weight loading and `switchyard compress`,
run as real processes with stderr on a pseudo-terminal, then on a pipe (what a log file or a container sees).
"""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
LOAD = "import sys; from backends.worker.loader import load_weights; load_weights(sys.argv[1])"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A small HF-style folder of bf16 weights (enough tensors for a bar to move)."""
    folder = tmp_path / "model"
    folder.mkdir()
    generator = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.up_proj.weight": (torch.randn(64, 64, generator=generator) * 0.02).bfloat16()
               for i in range(4)}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def _on_terminal(args: list[str]) -> str:
    """What the process writes to stderr when stderr is a terminal (100 columns)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:      # EIO: the process closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=120) == 0
    return b"".join(chunks).decode(errors="replace")


def _in_a_log(args: list[str]) -> str:
    out = subprocess.run([sys.executable, *args], cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True,
                         timeout=120, check=True)
    return out.stderr.decode(errors="replace")


def test_weight_loading_shows_progress_only_on_a_terminal(model_dir: Path) -> None:
    terminal = _on_terminal(["-c", LOAD, str(model_dir)])
    assert "loading weights" in terminal and "100%" in terminal
    assert "loading weights" not in _in_a_log(["-c", LOAD, str(model_dir)])


def test_compress_shows_progress_only_on_a_terminal(model_dir: Path, tmp_path: Path) -> None:
    terminal = _on_terminal(["-m", "tools.compress", str(model_dir), str(tmp_path / "on_terminal")])
    assert "compressing" in terminal and "4/4" in terminal
    log = _in_a_log(["-m", "tools.compress", str(model_dir), str(tmp_path / "in_log")])
    assert "compressing" not in log and "%|" not in log
