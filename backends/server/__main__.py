"""`python -m backends.server` (and `switchyard worker`): parse flags, build the configs, serve on uvloop.

The only place that turns command-line flags into `EngineConfig` and `ServerConfig`.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.attention.base import AttentionBackendName
from backends.core.engine_config import SPECULATIVE_PROPOSERS, EngineConfig, KVConnectorName
from backends.kv_transfer import auth as kv_auth
from backends.server import auth
from backends.server.server_config import ServerConfig, WorkerRole
from backends.worker.heap import keep_freed_memory

if TYPE_CHECKING:
    from aiohttp import web

DEFAULT_MODEL = "smollm2"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard worker", description="Run a switchyard inference worker.")
    # In the order --help lists them.
    _add_model_and_batch_args(p)
    _add_kv_tier_args(p)
    _add_serving_args(p)
    _add_kv_transfer_args(p)
    _add_weight_and_graph_args(p)
    _add_speculation_args(p)
    _add_server_args(p)
    return p


def _add_model_and_batch_args(p: argparse.ArgumentParser) -> None:
    """The model, where it runs, and the batch and KV cache sizes."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="model spec: 'smollm2', an HF folder or a GGUF file")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--role", choices=[r.value for r in WorkerRole], default=WorkerRole.BOTH.value,
                   help="both (unified); prefill or decode for disaggregated serving")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weights and KV cache; auto: bfloat16 on a GPU that has it and on a CPU with AVX512-BF16 "
                        "or AMX (half the bytes a decode step reads, at native speed), float32 elsewhere "
                        "(an AVX2 CPU converts bfloat16 in software)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks")
    kv.add_argument("--kv-cache-memory-gb", type=float, default=None, help="KV cache budget in GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks (processes this worker spawns; one device each on "
                        "CUDA): heads, KV heads, MLP columns and the vocabulary sharded (docs/parallelism.md)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers over this many stages of --tensor-parallel-size ranks each (processes this "
                        "worker spawns); each step's batch runs through them in micro-batches (docs/parallelism.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: MoE layers split whole experts over the ranks (each holds "
                        "experts/size of them) instead of every expert's columns (docs/parallelism.md)")
    p.add_argument("--distributed-timeout-s", type=float, default=60.0,
                   help="with --tensor-parallel-size: a collective that waits this long, or a rank silent this "
                        "long between steps, fails the whole group (/health answers 503)")


def _add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    tiers = p.add_argument_group("KV tiers below the device pool (docs/kv_tiers.md)")
    tiers.add_argument("--kv-cpu-gb", type=float, default=0.0,
                       help="host-RAM tier: blocks the device pool evicts are kept here (pinned on CUDA)")
    tiers.add_argument("--kv-disk-dir", default=None, help="local-disk tier's folder (kept across restarts)")
    tiers.add_argument("--kv-disk-gb", type=float, default=0.0, help="local-disk tier's size")
    tiers.add_argument("--kv-store", default=None, metavar="mooncake://HOST:PORT",
                       help="shared KV store across workers: a Mooncake Store master's address")
    tiers.add_argument("--kv-store-gb", type=float, default=0.25,
                       help="RAM this worker lends to the shared store's pool; blocks land in any worker's share "
                            "(0: it uses the store and lends none)")
    tiers.add_argument("--kv-write-queue-blocks", type=int, default=64,
                       help="evicted blocks waiting to be written down at most; more are dropped, never waited for")
    tiers.add_argument("--kv-read-slower-tiers", action="store_true",
                       help="read a prefix back from a tier even once that was measured slower than computing it "
                            "(default: compute it, and read that tier on 1 lookup in 16): it spares the GPU's "
                            "compute for other requests at the cost of this one's TTFT")


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    """Attention backend, prefix cache, served names, threads and request size."""
    p.add_argument("--attention-backend", choices=[b.value for b in AttentionBackendName], default=None,
                   help="default: flash or triton on CUDA where available, sdpa on CPU")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument("--served-model-name", action="append", default=None,
                   help="name clients use (repeatable; default: --model)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-request-mb", type=float, default=16.0, help="larger request bodies get 413")


def _add_kv_transfer_args(p: argparse.ArgumentParser) -> None:
    """The KV transfer listener and pulls between prefill and decode workers."""
    p.add_argument("--kv-host", default="127.0.0.1", help="KV transfer listener interface (prefill/both roles)")
    p.add_argument("--kv-port", type=int, default=0, help="KV transfer listener port (0: any free port)")
    p.add_argument("--kv-advertise-host", default=None,
                   help="host name decode workers should dial (default: --kv-host, or this host's address "
                        "when that is a wildcard)")
    p.add_argument("--kv-hold-timeout-s", type=float, default=30.0,
                   help="release held prefill KV that no decode worker pulled after this long")
    p.add_argument("--kv-idle-timeout-s", type=float, default=10.0,
                   help="a KV pull with no bytes moving this long fails")
    p.add_argument("--kv-key", default=os.environ.get(kv_auth.ENV_VAR) or None,
                   help=f"the pool's shared KV-transfer key (default: ${kv_auth.ENV_VAR}, which keeps it out of `ps`): "
                        "the listener refuses peers that cannot prove it, and pulls prove it; every prefill and "
                        "decode worker of a pool needs the same one (none: the listener is open)")
    p.add_argument("--no-kv-shared-memory", action="store_true",
                   help="always move KV over TCP: by default a prefill/both worker on CPU keeps its KV cache in "
                        "shared memory, and a decode worker on the same host copies held blocks from it")


def _add_weight_and_graph_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-weights-compressed", action="store_true",
                   help="with a model folder from `switchyard compress`: keep the layers' matrices compressed in "
                        "memory (~33%% less) and expand each just before it runs (slower steps on CPU); "
                        "--dtype must match the compressed dtype")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, run every decode step eagerly instead of replaying the CUDA graphs captured "
                        "at start for batches of up to min(--max-num-seqs, 256) sequences")


def _add_speculation_args(p: argparse.ArgumentParser) -> None:
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument("--speculative", choices=SPECULATIVE_PROPOSERS, default=None,
                      help="draft tokens with prompt lookup, a draft model, or an EAGLE head; ngram+draft and "
                           "ngram+eagle: prompt lookup where it finds a match, the model elsewhere; the target "
                           "verifies them")
    spec.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per sequence and step at most")
    spec.add_argument("--speculative-model", default=None,
                      help="the draft model's folder (--speculative [ngram+]draft; see `switchyard make-draft`) or "
                           "the EAGLE head's (--speculative [ngram+]eagle; see `switchyard train-draft`)")
    spec.add_argument("--no-adaptive-speculation", action="store_true",
                      help="always draft K tokens (default: each sequence's K follows its acceptance)")
    spec.add_argument("--ngram-min", type=int, default=2, help="prompt lookup: shortest n-gram matched")
    spec.add_argument("--ngram-max", type=int, default=4, help="prompt lookup: longest n-gram matched")
    spec.add_argument("--no-int8-drafts", action="store_true",
                      help="keep an EAGLE head's weights in the model's dtype on a CPU worker (default: int8, "
                           "under half the drafting time of float32; drafts are verified either way, so output "
                           "tokens do not change)")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """Authentication, debug endpoints, draining and logging."""
    p.add_argument("--api-key", default=os.environ.get(auth.ENV_VAR) or None,
                   help=f"clients must send `Authorization: Bearer <key>` (default: ${auth.ENV_VAR}; none: open)")
    p.add_argument("--debug-endpoints", action="store_true", help="serve /debug/* (tests only)")
    p.add_argument("--otlp-traces-endpoint", default=_otlp_traces_endpoint(),
                   help="export a span per API request, joined to the caller's `traceparent`, to this OTLP/HTTP "
                        "traces URL (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or $OTEL_EXPORTER_OTLP_ENDPOINT "
                        "+ /v1/traces; none: no tracing)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM: how long requests in flight and held KV blocks may take to finish")
    p.add_argument("--log-level", default="INFO")


def _otlp_traces_endpoint() -> str | None:
    """OpenTelemetry's own variables: the traces URL as given, or the base URL with the signal's path."""
    if traces := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return traces
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return base.rstrip("/") + "/v1/traces" if base else None


def resolve_dtype(dtype: str, device: str) -> str:
    """`--dtype auto` made concrete for this machine, chosen at start-up; any other value as given."""
    if dtype != "auto":
        return dtype
    import torch

    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native_bf16 else "float32"


def build_configs(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    from backends.worker.loader import resolve_model  # converts the bundled GGUF once, then cached

    model_dir = str(resolve_model(args.model))
    group = args.tensor_parallel_size * args.pipeline_parallel_size > 1
    if group or args.enable_expert_parallel:
        _check_group(Path(model_dir), args.tensor_parallel_size, args.pipeline_parallel_size,
                     args.enable_expert_parallel)
    kv_bytes = int(args.kv_cache_memory_gb * 2**30) if args.kv_cache_memory_gb is not None else None
    engine_config = EngineConfig(
        model_dir=model_dir,
        dtype=resolve_dtype(args.dtype, args.device),
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        enable_prefix_caching=not args.no_prefix_caching,
        torch_num_threads=args.threads,
        kv_shared_memory=(not args.no_kv_shared_memory and args.role != WorkerRole.DECODE.value
                          and args.device == "cpu" and not group),
        keep_weights_compressed=args.keep_weights_compressed,
        cuda_graphs=not args.no_cuda_graphs,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_model=args.speculative_model,
        spec_adaptive=not args.no_adaptive_speculation,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        spec_int8=not args.no_int8_drafts,
        **_kv_tier_fields(args),
        # Every role serves some disaggregated leg; a plain request finds nothing for the P/D connector to do.
        # The tiers join when --kv-cpu-gb, --kv-disk-dir or --kv-store sets a tier.
        # A group on CUDA moves no KV between workers yet: it serves unified requests only.
        kv_connectors=() if group and args.device != "cpu" else (KVConnectorName.PD,),
        kv_hold_timeout_s=args.kv_hold_timeout_s,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        distributed_timeout_s=args.distributed_timeout_s,
    )
    server_config = ServerConfig(
        model_dir=model_dir,
        served_model_names=tuple(args.served_model_name or [args.model]),
        role=WorkerRole(args.role),
        max_request_bytes=int(args.max_request_mb * 2**20),
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_advertise_host=args.kv_advertise_host,
        kv_idle_timeout_s=args.kv_idle_timeout_s,
        debug_endpoints=args.debug_endpoints,
        kv_shared_memory=not args.no_kv_shared_memory,
        api_key=args.api_key,
        kv_key=args.kv_key,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    return server_config, engine_config


def _kv_tier_fields(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's KV tier fields from the flags (docs/kv_tiers.md)."""
    return dict(kv_cpu_bytes=int(args.kv_cpu_gb * 2**30), kv_disk_dir=args.kv_disk_dir,
                kv_disk_bytes=int(args.kv_disk_gb * 2**30), kv_store=args.kv_store,
                kv_store_bytes=int(args.kv_store_gb * 2**30), kv_write_queue_blocks=args.kv_write_queue_blocks,
                kv_read_slower_tiers=args.kv_read_slower_tiers)


def _check_group(model_dir: Path, size: int, stages: int, expert_parallel: bool) -> None:
    """Refuse, before anything starts, a group the model cannot be split over (and say what can)."""
    from backends.models.model_config import load_model_config
    from backends.worker.model_runner import check_group

    try:
        check_group(load_model_config(model_dir), size, stages, expert_parallel)
    except ValueError as exc:
        raise SystemExit(f"switchyard worker: {exc}") from None


async def _freeze_gc(app: web.Application) -> None:
    """After the engine started: the model's and the engine's objects join the permanent generation."""
    gc.freeze()


def main(argv: Sequence[str] | None = None) -> None:
    # The imports leave ~220,000 tracked objects that every full collection would walk (~0.09 s each
    # here, more once the model is loaded: at start-up, and as pauses in the engine and event-loop
    # threads later); frozen, they are skipped.
    gc.freeze()
    keep_freed_memory()   # before the model loads: each step's temporaries stay mapped for the next
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server_config, engine_config = build_configs(args)
    if (engine_config.model_dir is not None and not engine_config.keep_weights_compressed
            and engine_config.world_size == 1):   # a group's ranks read only their slices
        from backends.worker.loader import prefetch_weights
        prefetch_weights(Path(engine_config.model_dir))   # read while the server's modules import
    # Imported only now: aiohttp and transformers take ~1.1 s to import, the prefetch's time to read.
    import uvloop

    from backends.server.app import create_app
    from backends.server.drain import serve

    app = create_app(server_config, engine_config)
    app.on_startup.append(_freeze_gc)
    # handler_cancellation (in serve): a client that goes away cancels its handler, so its sequence aborts.
    uvloop.run(serve(app, args.host, args.port, args.drain_timeout_s))


if __name__ == "__main__":
    main()
