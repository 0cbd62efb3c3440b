"""The model runner: loads a model and its paged KV cache once, then turns each `ForwardBatch` into logits.

It does not schedule, sample or own block allocation: the engine decides what runs and which blocks a
sequence holds; the runner validates the batch, builds every index tensor in one pass, and runs the model.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Protocol

import torch

from backends.attention.base import AttentionContext, AttentionShape, StepLayout, create_backend
from backends.core.batch import ForwardBatch
from backends.core.engine_config import EXPERT_PARALLEL_NEEDS_A_GROUP, EngineConfig
from backends.models import model_class, sharded_model_class
from backends.models.base import CausalLM, LayerKVSpec
from backends.models.kernels.registry import select_kernels
from backends.models.layers import Linear, LMHead
from backends.models.model_config import ModelConfig, load_model_config
from backends.models.moe import MoEBlock
from backends.models.pipeline import PipelineStage
from backends.models.tensor_parallel import TensorParallel, TPLayout
from backends.worker.cuda_graphs import DecodeGraphs, StaticInputs
from backends.worker.fingerprint import digest_of, model_fingerprint
from backends.worker.kv_cache import KVCache, KVCacheSpec
from backends.worker.loader import load_weights
from backends.worker.random_weights import RandomCheckpoint
from backends.worker.shard_loader import ShardReader

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GB = 1.0
# On CUDA without an explicit size, this share of the memory free after loading goes to the cache.
CUDA_KV_CACHE_FREE_FRACTION = 0.8


class RankPlace(Protocol):
    """Where a runner sits in a worker's group of ranks (backends/executor builds it): its tensor-parallel
    group and its pipeline stage (either may be None, not both)."""

    @property
    def rank(self) -> int:
        """Its rank in the whole group (0: the one that samples)."""
        ...

    @property
    def world_size(self) -> int:
        """Ranks in the group: the tensor-parallel size times the pipeline stages."""
        ...

    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """The ranks of its stage that split each layer with it (None: it holds its layers whole)."""
        ...

    @property
    def stage(self) -> PipelineStage | None:
        """The layers it holds (None: one stage, all of them)."""
        ...

    def agree_min(self, value: int) -> int:
        """The smallest `value` any rank of the whole group holds (every rank gets it)."""
        ...


class ModelRunner:
    def __init__(self, model_dir: Path, *, dtype: torch.dtype, device: str, num_blocks: int | None,
                 block_size: int = 16, attention_backend: str | None = None,
                 kv_cache_memory_gb: float | None = None, kv_shared_memory: bool = False,
                 keep_weights_compressed: bool = False, cuda_graph_max_batch: int = 0,
                 random_weights: bool = False, fingerprint_weights: bool = False,
                 place: RankPlace | None = None) -> None:
        """`cuda_graph_max_batch`: on CUDA, decode steps of up to this many sequences replay CUDA graphs
        captured here (0: every step runs eagerly). `random_weights`: no checkpoint is read; every weight
        is drawn at random (benchmarks of model shapes whose weights are not here: speed does not depend
        on the values). `fingerprint_weights`: digest the weights as they are loaded (`weights_fingerprint`,
        which KV tiers on disk or in a shared store file their blocks under, and KV transfers compare); else it
        is None. `place`: this runner is one rank of a group and holds that rank's shard (its slices of its stage's
        layers read from the checkpoint, their KV heads cached); only rank 0's logits are the model's."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on, and CUDA graphs capture from, the current device: make it this one
            # (for this thread, the one that builds and steps the engine).
            torch.cuda.set_device(self.device)
        self.dtype = dtype
        self.model_dir = Path(model_dir)   # the checkpoint folder (or file) it was read from
        self.config = load_model_config(Path(model_dir))
        self.weights_fingerprint: str | None = None
        self.place = place
        self.tensor_parallel = None if place is None else place.tensor_parallel
        self.stage = None if place is None else place.stage
        self.read_bytes = 0   # bytes read from the checkpoint (a rank's slices; its mapped files otherwise)
        self.kernels = select_kernels(self.device)   # the layers' kernels for this device, chosen once
        if place is not None:
            self.model = self._load_shard(Path(model_dir), place)
        else:
            self.model = self._load_model(Path(model_dir), keep_weights_compressed, random_weights,
                                          fingerprint_weights)
        self.kernels.prepare(self.model)   # before the graphs capture which kernel each projection runs
        kv_layers = self.model.kv_cache_spec()
        kv = uniform_kv_spec(kv_layers)
        self.block_size = block_size
        self.num_blocks = num_blocks or self._blocks_for_memory(kv_cache_memory_gb, len(kv_layers), kv)
        if place is not None:   # one block table serves every rank: all must hold as many blocks
            self.num_blocks = place.agree_min(self.num_blocks)
        if self.num_blocks <= 0:
            raise ValueError("the KV cache must hold at least one block")
        self.kv_cache = KVCache(KVCacheSpec(num_layers=len(kv_layers), num_blocks=self.num_blocks,
                                            block_size=block_size, num_kv_heads=kv.num_kv_heads,
                                            head_dim=kv.head_dim, dtype=dtype), self.device, kv_shared_memory)
        shape = AttentionShape(num_heads=kv.num_heads, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                               block_size=block_size, scale=kv.scale, dtype=dtype,
                               latent_value_dim=kv.latent_value_dim)
        self.attention = create_backend(attention_backend, shape, self.device)
        self.max_model_len: int = int(self.config.max_position_embeddings)
        self.vocab_size: int = int(self.config.vocab_size)
        log.info("model %s on %s (%s), %d KV blocks of %d tokens, attention %s", model_dir, self.device,
                 dtype, self.num_blocks, block_size, self.attention.name.value)
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch > 0 and self._can_capture(keep_weights_compressed):
            self.decode_graphs = DecodeGraphs(self._static_decode, device=self.device, max_batch=cuda_graph_max_batch,
                                              max_blocks_per_seq=-(-self.max_model_len // block_size),
                                              block_size=block_size)

    def _can_capture(self, keep_weights_compressed: bool) -> bool:
        """CUDA graphs need CUDA, an attention backend whose decode reads fixed tensors, and weights that
        stay put (compressed ones are expanded into scratch at every call)."""
        if self.device.type != "cuda" or keep_weights_compressed:
            return False
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.attention.static_decode_metadata(rows, rows.view(1, 1).int(), rows) is None:
            log.info("attention %s cannot be captured: decode runs without CUDA graphs", self.attention.name.value)
            return False
        return True

    def _static_decode(self, inputs: StaticInputs, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward a CUDA graph captures: n sequences, every input read from `inputs`."""
        token_ids, positions, slots, seq_lens = inputs.table[:, :n]
        metadata = self.attention.static_decode_metadata(inputs.rows[:n], inputs.block_tables[:n], seq_lens)
        context = AttentionContext(backend=self.attention, metadata=metadata, slot_mapping=slots,
                                   k_caches=self.kv_cache.k, v_caches=self.kv_cache.v)
        hidden = self.model(token_ids, positions, context)
        return self.model.compute_logits(hidden).float(), hidden

    def _load_model(self, model_dir: Path, keep_compressed: bool, random_weights: bool,
                    fingerprint: bool) -> CausalLM:
        """`keep_compressed`: the decoder layers' matrices of a compressed folder stay compressed on the
        device and are expanded just before each layer runs (less memory, more work per step)."""
        with torch.device("meta"):   # shapes only: nothing is allocated until _materialize_empty
            model = model_class(getattr(self.config, "architectures", None))(self.config, self.kernels)
        _materialize_empty(model, self.dtype, self.device)
        start = time.perf_counter()
        weights = (RandomCheckpoint(self.config, self.dtype, self.device) if random_weights
                   else load_weights(model_dir, self.device if keep_compressed else None, self.dtype))
        read_s = time.perf_counter() - start
        with torch.no_grad():
            model.load_weights(weights, keep_compressed=keep_compressed)
        log.info("weights of %s read in %.2f s, placed in %.2f s", model_dir, read_s,
                 time.perf_counter() - start - read_s)
        if fingerprint:   # random weights: a digest no other runner has (their KV is worth sharing with none)
            self.weights_fingerprint = (f"random-{os.urandom(8).hex()}" if random_weights
                                        else model_fingerprint(self.config, weights))
            log.info("weights fingerprint %s", self.weights_fingerprint)
        return model.eval()

    def _load_shard(self, model_dir: Path, place: RankPlace) -> CausalLM:
        """This rank's shard, built from its slices of the checkpoint alone (its stage's layers only)."""
        tp, stage = place.tensor_parallel, place.stage
        with torch.device("meta"):
            model = sharded_model_class(getattr(self.config, "architectures", None), tensor_parallel=tp is not None)(
                self.config, self.kernels, tp=tp, stage=stage)
        _materialize_empty(model, self.dtype, self.device)
        start = time.perf_counter()
        layout = None if tp is None else TPLayout.of(self.config, tp.rank, tp.size, tp.expert_parallel)
        with ShardReader(model_dir, layout) as weights, torch.no_grad():
            model.load_weights(weights)
        self.read_bytes = weights.read_bytes
        self.weights_fingerprint = digest_of(self.config, weights.lines)   # its slices' (the group combines them)
        log.info("rank %d of %d: %.1f MB of slices of %s read and placed in %.2f s", place.rank, place.world_size,
                 self.read_bytes / 1e6, model_dir, time.perf_counter() - start)
        return model.eval()

    def weight_bytes(self) -> int:
        """Bytes of the model's weights on this runner: parameters and the kernels' packed copies that replace
        them (a tied table counted once)."""
        seen: dict[int, int] = {}
        for module in self.model.modules():
            for tensor in (*module.parameters(recurse=False), *_packed_copies(module)):
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
        return sum(seen.values())

    def _blocks_for_memory(self, memory_gb: float | None, num_layers: int, kv: LayerKVSpec) -> int:
        spec = KVCacheSpec(num_layers=num_layers, num_blocks=1, block_size=self.block_size,
                           num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, dtype=self.dtype)
        if memory_gb is None and self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            return int(free_bytes * CUDA_KV_CACHE_FREE_FRACTION) // spec.bytes_per_block
        gb = DEFAULT_CPU_KV_CACHE_GB if memory_gb is None else memory_gb
        return int(gb * 2**30) // spec.bytes_per_block

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [rows, vocab]: for each chunk with want_logits, its last `num_logits` tokens, in order."""
        return self.execute_with_hidden(batch)[0]

    def execute_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of `execute`, and the final (normed) hidden states of every token [num_tokens, hidden]
        in batch order (speculative proposers that read the target's features)."""
        if not batch.chunks:
            empty = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
            return empty, torch.empty(0, int(self.config.hidden_size), dtype=self.dtype, device=self.device)
        if self.decode_graphs is not None and self.decode_graphs.covers(batch):
            for index, chunk in enumerate(batch.chunks):
                self._check_chunk(index, chunk.token_ids, chunk.num_context_tokens, chunk.block_table)
            with torch.inference_mode():
                return self.decode_graphs.run(batch)
        hidden, logits_rows = self.run_layers(batch)
        return self.logits(hidden.index_select(0, logits_rows)), hidden

    def run_layers(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This runner's decoder layers over a non-empty batch (writing their K/V): their output [num_tokens,
        hidden], and the rows of it whose logits the batch wants. `hidden`: a later pipeline stage's input, the
        previous stage's output for the same batch."""
        token_ids, positions, slots, logits_rows = self._flatten(batch)
        layout = StepLayout(
            query_lens=tuple(len(c.token_ids) for c in batch.chunks),
            context_lens=tuple(c.num_context_tokens for c in batch.chunks),
            block_tables=tuple(c.block_table for c in batch.chunks),
            slot_mapping=slots, device=self.device)
        with torch.inference_mode():
            metadata = self.attention.prepare(layout)
            context = AttentionContext(backend=self.attention, metadata=metadata, slot_mapping=slots,
                                       k_caches=self.kv_cache.k, v_caches=self.kv_cache.v)
            if hidden is None:
                return self.model(token_ids, positions, context), logits_rows  # [num_tokens, hidden]
            return self.model(token_ids, positions, context, hidden), logits_rows

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of final hidden states [rows, hidden] (the first stage's LM head)."""
        if hidden.shape[0] == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            return self.model.compute_logits(hidden).float()

    def _flatten(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """token ids, positions, cache slots ([num_tokens] each) and the rows to take logits from."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        self.check_batch(batch)
        for chunk in batch.chunks:
            start, table = chunk.num_context_tokens, chunk.block_table
            end = start + len(chunk.token_ids)
            token_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            slots.extend(table[pos // bs] * bs + pos % bs for pos in range(start, end))
            if chunk.want_logits:
                logits_rows.extend(range(len(token_ids) - chunk.num_logits, len(token_ids)))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long).to(self.device, non_blocking=True)  # noqa: E731
        return as_tensor(token_ids), as_tensor(positions), as_tensor(slots), as_tensor(logits_rows)

    def check_batch(self, batch: ForwardBatch) -> None:
        """ValueError for a chunk that could write outside its blocks, index past the vocabulary or want logits
        it has no tokens for (raised before anything runs)."""
        for index, chunk in enumerate(batch.chunks):
            self._check_chunk(index, chunk.token_ids, chunk.num_context_tokens, chunk.block_table)
            if chunk.want_logits and not 1 <= chunk.num_logits <= len(chunk.token_ids):
                raise ValueError(f"chunk {index} wants logits for {chunk.num_logits} of its "
                                 f"{len(chunk.token_ids)} tokens")

    def _check_chunk(self, index: int, token_ids: tuple[int, ...], num_context: int, table: tuple[int, ...]) -> None:
        """Reject a malformed chunk before it can write outside its blocks or index past the vocab."""
        if not token_ids:
            raise ValueError(f"chunk {index} has no tokens")
        if num_context < 0:
            raise ValueError(f"chunk {index} has a negative context length")
        end = num_context + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(f"chunk {index} reaches position {end}, past max_model_len {self.max_model_len}")
        if len(table) * self.block_size < end:
            raise ValueError(f"chunk {index}: {len(table)} blocks cannot hold {end} tokens")
        if min(table) < 0 or max(table) >= self.num_blocks:
            raise ValueError(f"chunk {index}: block id out of range [0, {self.num_blocks})")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"chunk {index}: token id out of range [0, {self.vocab_size})")


def runner_for(config: EngineConfig, model_dir: Path, cuda_graph_max_batch: int,
               place: RankPlace | None = None) -> ModelRunner:
    """The runner an engine's configuration asks for (one rank's of a group, with `place`)."""
    kv_gb = None if config.kv_cache_memory_bytes is None else config.kv_cache_memory_bytes / 2**30
    device = config.device
    if place is not None and device.startswith("cuda"):
        device = f"cuda:{place.rank}"   # one device per rank
    return ModelRunner(model_dir, dtype=getattr(torch, config.dtype), device=device,
                       num_blocks=config.num_blocks, block_size=config.block_size,
                       attention_backend=config.attention_backend, kv_cache_memory_gb=kv_gb,
                       # a group's ranks: where rank 0 maps them, for a KV transfer or the tiers to copy their blocks
                       kv_shared_memory=config.kv_shared_memory or (place is not None
                                                                    and bool(config.kv_connector_names)),
                       keep_weights_compressed=config.keep_weights_compressed,
                       cuda_graph_max_batch=cuda_graph_max_batch,
                       fingerprint_weights=place is None,   # KV tiers and KV transfers name the weights
                       place=place)


def _packed_copies(module: torch.nn.Module) -> list[torch.Tensor]:
    """The kernels' packed copies a module holds in place of (or beside) its parameters."""
    if isinstance(module, Linear | LMHead):
        return [t for t in (module.packed, getattr(module, "packed_wide", None)) if t is not None]
    if isinstance(module, MoEBlock) and module.packed is not None:
        return [*module.packed.gate_up, *module.packed.down]
    return []


def check_group(config: ModelConfig, size: int, stages: int = 1, expert_parallel: bool = False) -> None:
    """ValueError, saying what to choose, where `size` tensor-parallel ranks in each of `stages` pipeline stages
    cannot split this model (checked before any rank starts)."""
    if size == 1 and expert_parallel:
        raise ValueError(EXPERT_PARALLEL_NEEDS_A_GROUP)
    if size > 1 or stages > 1:
        sharded_model_class(getattr(config, "architectures", None), tensor_parallel=size > 1)
    if size > 1:
        TPLayout.of(config, 0, size, expert_parallel)
    if stages > 1:
        PipelineStage.of(int(config.num_hidden_layers), 0, stages)


def uniform_kv_spec(layers: tuple[LayerKVSpec, ...]) -> LayerKVSpec:
    """The one KV shape of every layer: the cache (KVCache) holds one shape for all layers."""
    if not layers:
        raise ValueError("the model declares no layer with a KV cache")
    if any(spec != layers[0] for spec in layers):
        raise ValueError(f"layers with different KV shapes ({sorted(set(layers), key=str)}) need a cache "
                         "that holds more than one shape")
    return layers[0]


def _materialize_empty(model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Give every parameter of a model built on the meta device uninitialised storage on `device`,
    floating ones in `dtype`, ties kept (the models register no buffers). Nothing is written and
    nothing is allocated twice: load_weights fills every parameter, and a weight that stays
    compressed (or is packed) never touches its placeholder, so on the CPU that costs no memory."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in done:
                target = dtype if param.is_floating_point() else param.dtype
                # torch.empty, not empty_like: empty_like of a meta tensor goes through torch._refs,
                # whose first call imports sympy (0.42 s of a worker start)
                done[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=target, device=device),
                                                     requires_grad=param.requires_grad)
            setattr(module, name, done[id(param)])
