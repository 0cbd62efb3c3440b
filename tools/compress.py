"""`python -m tools.compress SRC DST [--cast bf16|fp16]`: compress a model folder losslessly.

SRC is an HF folder or a model spec (`smollm2`, a .gguf file) resolved by the worker's loader.
Prints a progress bar, the ratio of every tensor and the total.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tqdm import tqdm

from backends.compression.compress import CastDtype, TensorStats, compress_folder


def _resolve_source(spec: str) -> Path:
    path = Path(spec)
    if path.is_dir():
        return path
    if os.sep in spec and not path.exists():   # a path that is not there: no need to load the loader
        raise FileNotFoundError(f"{spec}: no such folder or file")
    from backends.worker.loader import resolve_model  # only needed for specs, and pulls in the loader
    return resolve_model(spec)


def _count_tensors(folder: Path) -> int:
    from safetensors import safe_open
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += len(list(f.keys()))
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchyard compress", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="HF folder with *.safetensors, or a model spec such as 'smollm2'")
    parser.add_argument("dst", help="output folder (created)")
    parser.add_argument("--cast", choices=[c.value for c in CastDtype], default=None,
                        help="cast floating-point tensors first (needed for fp32 models)")
    args = parser.parse_args(argv)
    try:
        src = _resolve_source(args.src)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cast = CastDtype(args.cast) if args.cast else None
    # A bar on a terminal only: redirected to a log, the per-tensor lines are the whole record.
    bar = tqdm(total=_count_tensors(src), unit="tensor", desc="compressing", disable=not sys.stderr.isatty())

    def report(stat: TensorStats) -> None:
        ratio = stat.stored_bytes / stat.original_bytes if stat.original_bytes else 1.0
        how = "compressed" if stat.compressed else "stored as is"
        bar.write(f"{stat.name}: {stat.original_bytes} -> {stat.stored_bytes} bytes ({ratio:.1%}, {how})")
        bar.update(1)

    try:
        stats = compress_folder(src, Path(args.dst), cast, on_tensor=report)
    except (FileNotFoundError, ValueError) as exc:
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    before = sum(s.original_bytes for s in stats)
    after = sum(s.stored_bytes for s in stats)
    print(f"total: {before} -> {after} bytes ({after / before:.1%} of the input weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
