"""The records rank 0 and the other ranks exchange over their control pipes (pickled by multiprocessing).

Each step's inputs go down the pipe, not through a collective: a rank waits for the next step for as long as
the worker idles, which a collective's timeout would not allow, and a closed pipe tells it that rank 0 died.
"""
from __future__ import annotations

from dataclasses import dataclass

from backends.core.batch import ForwardBatch
from backends.core.engine_config import EngineConfig
from backends.kv_transfer.base import SharedRegion


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What a spawned rank needs to join the group and build its shard."""
    rank: int                  # this rank, 1..world_size-1
    world_size: int            # ranks in the group, rank 0 included
    store_port: int            # rank 0's TCPStore, on 127.0.0.1, where the ranks meet
    model_dir: str             # the resolved HF folder every rank reads its slices from
    engine_config: EngineConfig  # the worker's configuration (sizes, dtype, device, timeouts)
    heartbeat_timeout_s: float   # exit when rank 0 sends nothing (no step, no ping) for this long


@dataclass(frozen=True, slots=True)
class Step:
    """Rank 0 -> rank r: run this batch's forward on your shard (its logits stay with rank 0)."""
    batch: ForwardBatch        # the same batch rank 0 runs: each rank builds its positions and slots from it
    all_hidden: bool = False   # pipeline stages: the last sends every token's hidden state back, not only those
                               # of the logits rows (a proposer or a pooler reads them)


@dataclass(frozen=True, slots=True)
class Ping:
    """Rank 0 -> rank r, while no step runs: answer with a Pong (a stopped or wedged rank does not)."""
    seq: int                   # echoed in the Pong


@dataclass(frozen=True, slots=True)
class Stop:
    """Rank 0 -> rank r: leave the group and exit (the worker shuts down)."""


@dataclass(frozen=True, slots=True)
class Ready:
    """Rank r -> rank 0, once: its shard is loaded and its KV cache allocated."""
    rank: int                  # who is ready
    num_blocks: int            # KV blocks it allocated (every rank agreed on the same count)
    weight_bytes: int          # bytes of its parameters (its resident share of the model)
    read_bytes: int            # bytes it read from the checkpoint (its slices)
    rss_anon_bytes: int        # its anonymous resident memory after loading (/proc/self/status RssAnon)
    rss_anon_before_bytes: int  # the same before it built its shard (the interpreter, torch, the group)
    weights_fingerprint: str = ""          # its slices' digest (backends/worker/fingerprint.py)
    kv_region: SharedRegion | None = None  # where its KV cache lies in shared memory, for rank 0 to map
    kv_layers: int = 0                     # the layers that cache holds (its stage's)


@dataclass(frozen=True, slots=True)
class Pong:
    """Rank r -> rank 0: the answer to a Ping."""
    rank: int                  # who answers
    seq: int                   # the Ping's


@dataclass(frozen=True, slots=True)
class Failed:
    """Rank r -> rank 0: it could not start (the error), and exits."""
    rank: int                  # who failed
    error: str                 # what went wrong, for rank 0's log and its start-up error


ToRank = Step | Ping | Stop
FromRank = Ready | Pong | Failed
