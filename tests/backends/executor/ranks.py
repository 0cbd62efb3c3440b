"""The rank processes of a tensor-parallel worker, as /proc shows them (Linux)."""
from __future__ import annotations

import os


def rank_pids(pid: int) -> list[int]:
    """The rank processes `pid` spawned (multiprocessing's spawn_main; not its resource tracker)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as children:
            for child in children.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    if b"spawn_main" in cmdline.read():
                        found.append(int(child))
    return found


def gone(pid: int) -> bool:
    """The process has ended (reaped, or a zombie waiting for a reaper that is not ours)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
