"""The engine's configuration: one frozen record built by the caller (server or CLI).

The engine never reads files or the environment for its settings, except `torch_num_threads`
falling back to SWITCHYARD_TORCH_THREADS (done in `resolved_torch_threads`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from backends.core.registered import Registered

TORCH_THREADS_ENV = "SWITCHYARD_TORCH_THREADS"
# Prompt lookup, a draft model, an EAGLE head; "ngram+X": lookup first, X where it finds nothing.
SPECULATIVE_PROPOSERS = ("ngram", "draft", "eagle", "ngram+draft", "ngram+eagle")
EXPERT_PARALLEL_NEEDS_A_GROUP = ("--enable-expert-parallel splits the experts over a group's ranks: it needs "
                                 "--tensor-parallel-size 2 or more")


class KVConnectorName(Registered):
    """The KV connectors a worker can consult, each with where its factory lives ("module:function", a
    `ConnectorFactory` that backends/kv_connectors/registry.py imports when a worker is configured with it: this
    layer imports none of them). The enum is the registry: adding a connector is one file in kv_connectors/ and
    one member here."""
    # prefill-to-decode transfer
    PD = "pd", "backends.kv_connectors.pd_connector:build_pd_connector"
    # host RAM, disk and a shared store below the device pool
    TIERS = "tiers", "backends.kv_connectors.tiers.factory:build_tiered_connector"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str | None = None              # HF folder or GGUF file; None: the bundled SmolLM2
    dtype: str = "float32"                    # torch dtype name of weights and KV cache
    device: str = "cpu"                       # torch device string ("cpu", "cuda", "cuda:1")
    block_size: int = 16                      # tokens per KV block
    num_blocks: int | None = None             # KV blocks; None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # KV budget when num_blocks is None (runner default if both None)
    max_num_seqs: int = 64                    # sequences in one step at most
    max_num_batched_tokens: int = 512         # tokens in one step at most (prefill chunks + decodes)
    max_model_len: int | None = None          # context limit; None: the model's own
    attention_backend: str | None = None      # runner's backend name; None: the runner picks
    enable_prefix_caching: bool = True        # reuse full blocks across sequences by chained hash
    watermark_blocks: int = 1                 # free blocks kept back when admitting a new sequence
    max_kv_events: int = 10_000               # KV event ring capacity
    torch_num_threads: int | None = None      # None: $SWITCHYARD_TORCH_THREADS, else all cores
    kv_shared_memory: bool = False            # CPU KV cache in shared memory (same-host KV transfer source)
    keep_weights_compressed: bool = False     # a compressed model's layer matrices stay compressed, expanded per use
    cuda_graphs: bool = True                  # on CUDA, decode batches replay graphs captured at start
    speculative: str | None = None            # proposer, one of SPECULATIVE_PROPOSERS; None: no speculation
    num_speculative_tokens: int = 4           # drafts per sequence and step at most (K)
    speculative_model: str | None = None      # the draft model's folder ("draft") or the EAGLE head's ("eagle")
    spec_adaptive: bool = True                # each sequence's K follows its acceptance (0: plain decoding)
    ngram_min: int = 2                        # prompt lookup: shortest n-gram matched
    ngram_max: int = 4                        # prompt lookup: longest n-gram matched
    spec_int8: bool = True                    # an EAGLE head's weights in int8 on a CPU (float32/bf16) target
    kv_cpu_bytes: int = 0                     # host-RAM KV tier (0: none)
    kv_disk_dir: str | None = None            # local-disk KV tier's folder (None: none)
    kv_disk_bytes: int = 0                    # its size
    kv_store: str | None = None               # shared KV store, "mooncake://HOST:PORT" (its master); None: none
    kv_store_bytes: int = 256 << 20           # RAM this worker lends to the store's pool (0: lends none)
    kv_write_queue_blocks: int = 64           # evicted blocks waiting to be written down at most (then dropped)
    kv_read_slower_tiers: bool = False        # read a tier even once measured slower than computing its tokens
    # The KV connectors the engine consults, in this order (several: one MultiConnector); the tiers join
    # last when a tier above is set without being named here (`kv_connector_names`).
    kv_connectors: tuple[KVConnectorName, ...] = ()
    kv_hold_timeout_s: float = 30.0           # the P/D connector: held prefill blocks nobody pulls go after this
    tensor_parallel_size: int = 1             # ranks each layer is split over (rank 0 spawns the others)
    pipeline_parallel_size: int = 1           # stages the layers are split over, each of tensor_parallel_size ranks
    enable_expert_parallel: bool = False      # MoE layers: whole experts per rank, not every expert's columns
    distributed_timeout_s: float = 60.0       # a group's collective, or a rank's silence, past this: the group fails

    def __post_init__(self) -> None:
        try:
            names = tuple(KVConnectorName(name) for name in self.kv_connectors)
        except ValueError:
            raise ValueError(f"unknown KV connector in {[str(n) for n in self.kv_connectors]} "
                             f"(known: {', '.join(n.value for n in KVConnectorName)})") from None
        object.__setattr__(self, "kv_connectors", names)   # names given as strings become members
        if len(set(names)) != len(names):
            raise ValueError(f"a KV connector is named twice in {[n.value for n in names]}")
        if KVConnectorName.TIERS in names and not self.has_kv_tiers:
            raise ValueError("the tiers KV connector needs a tier (--kv-cpu-gb, --kv-disk-dir or --kv-store)")
        if self.kv_hold_timeout_s <= 0:
            raise ValueError("kv_hold_timeout_s must be positive")
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.watermark_blocks < 0:
            raise ValueError("watermark_blocks must be >= 0")
        if self.speculative not in (None, *SPECULATIVE_PROPOSERS):
            raise ValueError(f"unknown speculative proposer {self.speculative!r} ({', '.join(SPECULATIVE_PROPOSERS)})")
        if self.speculative is not None and self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.has_kv_tiers and not self.enable_prefix_caching:
            raise ValueError("KV tiers keep blocks by prefix hash: they need prefix caching")
        if self.kv_disk_dir and self.kv_disk_bytes <= 0:
            raise ValueError("--kv-disk-dir needs a positive --kv-disk-gb")
        if self.kv_cpu_bytes < 0 or self.kv_store_bytes < 0 or self.kv_write_queue_blocks < 1:
            raise ValueError("kv_cpu_bytes and kv_store_bytes must be >= 0 and kv_write_queue_blocks >= 1")
        if self.speculative not in (None, "ngram") and not self.speculative_model:
            raise ValueError(f"--speculative {self.speculative} needs --speculative-model")
        self._check_group()

    def _check_group(self) -> None:
        """What a group of ranks does not serve yet is refused at start, not half-served."""
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1 or self.distributed_timeout_s <= 0:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1 and distributed_timeout_s "
                             "positive")
        if self.tensor_parallel_size == 1 and self.enable_expert_parallel:
            raise ValueError(EXPERT_PARALLEL_NEEDS_A_GROUP)
        if self.world_size == 1:
            return
        # P/D and the tiers reach a CPU group's KV through its ranks' shared-memory caches (executor/group_kv.py)
        unsupported = {"KV tiers on CUDA": self.has_kv_tiers and self.device != "cpu",
                       "P/D transfer on CUDA": KVConnectorName.PD in self.kv_connectors and self.device != "cpu",
                       "weights kept compressed": self.keep_weights_compressed}
        named = [what for what, asked in unsupported.items() if asked]
        if named:
            raise ValueError(f"a group of ranks ({self.tensor_parallel_size} tensor-parallel x "
                             f"{self.pipeline_parallel_size} pipeline stages) does not serve {' or '.join(named)} yet")

    @property
    def world_size(self) -> int:
        """Ranks in the worker's group: tensor-parallel ranks in each pipeline stage, times the stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def has_kv_tiers(self) -> bool:
        """Whether any KV tier below the device pool is asked for."""
        return bool(self.kv_cpu_bytes or self.kv_disk_dir or self.kv_store)

    @property
    def kv_connector_names(self) -> tuple[KVConnectorName, ...]:
        """The connectors to build, in order: those named, then the tiers if a tier is set but they are not named."""
        implied = self.has_kv_tiers and KVConnectorName.TIERS not in self.kv_connectors
        return (*self.kv_connectors, *((KVConnectorName.TIERS,) if implied else ()))

    @property
    def has_kv_tiers_beyond_worker(self) -> bool:
        """Whether a KV tier outlives the worker or is shared with others (disk, store): its blocks are filed
        under the weights' fingerprint (backends/worker/fingerprint.py), which the runner must then have."""
        return bool(self.kv_disk_dir or self.kv_store)

    def resolved_torch_threads(self) -> int:
        """Threads of each rank's torch (the flag and the variable are per rank)."""
        if self.torch_num_threads is not None:
            return max(1, self.torch_num_threads)
        env = os.environ.get(TORCH_THREADS_ENV)
        if env:
            return max(1, int(env))
        return max(1, (os.cpu_count() or 1) // self.world_size)   # each rank its share of the cores
