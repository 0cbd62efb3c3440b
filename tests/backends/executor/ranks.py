"""The rank processes of a tensor-parallel worker, as /proc shows them (Linux)."""
from __future__ import annotations

import os


def rank_pids(pid: int) -> list[int]:
    """The rank processes `pid` spawned (multiprocessing's spawn_main; not its resource tracker). A thread or a
    child that ends while /proc is read is passed by: its entry vanishes between the listing and the open."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as children:
                listed = children.read().split()
        except FileNotFoundError:   # the thread ended
            continue
        for child in listed:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as cmdline:
                    if b"spawn_main" in cmdline.read():
                        found.append(int(child))
            except FileNotFoundError:   # the child ended
                continue
    return found


def gone(pid: int) -> bool:
    """The process has ended (reaped, or a zombie waiting for a reaper that is not ours)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
