"""`python -m backends.server` flags → ServerConfig and EngineConfig."""
from __future__ import annotations

from pathlib import Path

import pytest

from backends.core.engine_config import EngineConfig, KVConnectorName
from backends.server.__main__ import build_configs, build_parser, resolve_dtype
from backends.server.server_config import ServerConfig, WorkerRole


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")   # an HF folder is used as it is
    return tmp_path


def test_flags_become_configs(model_dir: Path) -> None:
    args = build_parser().parse_args([
        "--model", str(model_dir), "--port", "9000", "--role", "prefill", "--dtype", "bfloat16",
        "--device", "cuda", "--max-num-seqs", "8", "--max-num-batched-tokens", "1024",
        "--kv-cache-memory-gb", "1.5", "--block-size", "32", "--attention-backend", "triton",
        "--served-model-name", "a", "--served-model-name", "b", "--threads", "3", "--max-model-len", "4096",
        "--no-prefix-caching", "--max-request-mb", "2", "--keep-weights-compressed"])
    server, engine = build_configs(args)
    assert server == ServerConfig(model_dir=str(model_dir), served_model_names=("a", "b"),
                                  role=WorkerRole.PREFILL, max_request_bytes=2 * 2**20)
    assert engine == EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda", block_size=32,
                                  num_blocks=None, kv_cache_memory_bytes=int(1.5 * 2**30), max_num_seqs=8,
                                  max_num_batched_tokens=1024, max_model_len=4096, attention_backend="triton",
                                  enable_prefix_caching=False, torch_num_threads=3, keep_weights_compressed=True,
                                  kv_connectors=(KVConnectorName.PD,))


def test_defaults(model_dir: Path) -> None:
    server, engine = build_configs(build_parser().parse_args(["--model", str(model_dir), "--port", "1"]))
    assert server.role is WorkerRole.BOTH and server.served_model_names == (str(model_dir),)
    assert (engine.dtype, engine.device, engine.block_size, engine.num_blocks) == (resolve_dtype("auto", "cpu"),
                                                                                   "cpu", 16, None)
    assert not engine.keep_weights_compressed


@pytest.mark.parametrize("flags, engine_shm, server_shm", [
    ([], True, True),                                         # both on CPU: cache in shared memory
    (["--role", "decode"], False, True),                      # a decode worker copies from peers' caches
    (["--no-kv-shared-memory"], False, False),
    (["--device", "cuda"], False, True),                      # CUDA caches move over TCP
])
def test_kv_shared_memory_flags(model_dir: Path, flags: list[str], engine_shm: bool, server_shm: bool) -> None:
    server, engine = build_configs(build_parser().parse_args(["--model", str(model_dir), "--port", "1", *flags]))
    assert (engine.kv_shared_memory, server.kv_shared_memory) == (engine_shm, server_shm)


@pytest.mark.parametrize("argv", [
    ["--port", "1", "--num-blocks", "10", "--kv-cache-memory-gb", "1"],   # one KV sizing flag at most
    ["--port", "1", "--role", "router"],
    ["--port", "1", "--attention-backend", "magic"],
    ["--model", "smollm2"],                                               # --port is required
])
def test_bad_flags_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"), [(False, False, "float32"), (True, False, "bfloat16"),
                                                              (False, True, "bfloat16")])
def test_dtype_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, avx512_bf16: bool, amx: bool,
                                    expected: str) -> None:
    import torch
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_dtype("auto", "cpu") == expected
    assert resolve_dtype("float32", "cpu") == "float32" and resolve_dtype("bfloat16", "cpu") == "bfloat16"


def test_dtype_auto_reaches_the_engine_config(model_dir: Path) -> None:
    import torch
    _, engine = build_configs(build_parser().parse_args(["--model", str(model_dir), "--port", "1", "--dtype", "auto"]))
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert engine.dtype == ("bfloat16" if native else "float32")


def test_kv_tier_flags_reach_the_engine_config(model_dir: Path) -> None:
    args = build_parser().parse_args(["--model", str(model_dir), "--port", "9000", "--kv-cpu-gb", "1",
                                      "--kv-disk-dir", "/var/kv", "--kv-disk-gb", "2.5", "--kv-store", "mooncake://10.0.0.7:50051",
                                      "--kv-store-gb", "1.5", "--kv-write-queue-blocks", "8", "--kv-read-slower-tiers"])
    _, engine = build_configs(args)
    assert (engine.kv_cpu_bytes, engine.kv_disk_dir, engine.kv_disk_bytes, engine.kv_store,
            engine.kv_write_queue_blocks) == (2**30, "/var/kv", int(2.5 * 2**30), "mooncake://10.0.0.7:50051", 8)
    assert engine.kv_read_slower_tiers and engine.kv_store_bytes == int(1.5 * 2**30)
    assert engine.kv_connector_names == (KVConnectorName.PD, KVConnectorName.TIERS)   # the tier flags imply the tiers
    _, engine = build_configs(build_parser().parse_args(["--model", str(model_dir), "--port", "9000"]))
    assert not engine.kv_read_slower_tiers and engine.kv_store_bytes == 256 << 20
    assert engine.kv_connector_names == (KVConnectorName.PD,)   # no tier: every role keeps the P/D connector
    with pytest.raises(ValueError, match="--kv-disk-gb"):
        build_configs(build_parser().parse_args(["--model", str(model_dir), "--port", "9000",
                                                 "--kv-disk-dir", "/var/kv"]))
