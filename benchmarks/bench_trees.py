"""Other checkouts of switchyard as measured paths of a benchmark (`--gateway-tree`, `--worker-tree`): the
NAME=DIR option, the check that a process started in DIR imports DIR's packages, and the ratio of one tree's
figures to another's with the spread of the per-round ratios (the rounds are interleaved, so round k of two
trees saw the same load on the machine)."""
from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys


def tree_option(spec: str) -> tuple[str, pathlib.Path]:
    """argparse type for NAME=DIR: the name and the checkout's resolved folder."""
    name, sep, folder = spec.partition("=")
    path = pathlib.Path(folder).expanduser().resolve()
    if not sep or not name or not path.is_dir():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=DIR with DIR a checkout of switchyard")
    return name, path


def check_trees(trees: list[tuple[str, pathlib.Path]], package: str) -> None:
    """Each tree's `package` must come from that tree when Python runs there (cwd first on sys.path), not
    from the checkout installed in the interpreter; the names must differ."""
    names = [name for name, _ in trees]
    if len(set(names)) != len(names):
        raise SystemExit(f"tree names repeat: {names}")
    for name, folder in trees:
        found = subprocess.run([sys.executable, "-c", f"import {package}; print({package}.__file__)"], cwd=folder,
                               capture_output=True, text=True, check=False).stdout.strip()
        if not found or not pathlib.Path(found).resolve().is_relative_to(folder):
            raise SystemExit(f"tree {name}: `import {package}` run in {folder} gives {found or 'nothing'}")
        print(f"tree {name}: {package} from {pathlib.Path(found).parent}", flush=True)


def ratio(values: list[float], base: list[float]) -> tuple[float, float, float]:
    """(median(values) / median(base), lowest and highest per-round ratio values[k] / base[k])."""
    per_round = [v / b if b else float("nan") for v, b in zip(values, base, strict=True)]
    mid = statistics.median(values) / statistics.median(base) if base and statistics.median(base) else float("nan")
    return mid, min(per_round, default=float("nan")), max(per_round, default=float("nan"))


def spread(values: list[float]) -> float:
    """(highest - lowest) / median of one path's per-round figures: that path's round-to-round noise."""
    mid = statistics.median(values) if values else 0.0
    return (max(values) - min(values)) / mid if mid else float("nan")


def ratio_cell(name: str, values: list[float], base: list[float]) -> str:
    mid, low, high = ratio(values, base)
    return f"{name} {mid:.3f} (rounds {low:.2f}-{high:.2f})"
