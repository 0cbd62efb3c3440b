"""A group's ranks read their slices of a compressed checkpoint (`switchyard compress`): each slice, bit-exact, is the
slice of the whole file as load_compressed_file decodes it; a range of rows is decoded from the chunks that hold it
alone (so a damaged chunk elsewhere goes unread, and one inside is refused); and a TP=2 or PP=2 worker on the
compressed folder gives one rank's greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from backends.compression import CorruptWeightsError, compress_folder, load_compressed_file
from backends.compression.compress import CastDtype
from backends.compression.container import map_file
from backends.compression.layout import LANE_SIZE, LANES_PER_CHUNK, Part, part_name
from backends.models.model_config import load_model_config
from backends.models.tensor_parallel import TPLayout
from backends.worker.compressed_slices import CompressedSlices
from backends.worker.shard_loader import ShardReader
from tests.backends.executor.test_tensor_parallel_served import STORY
from tests.backends.executor.tp_checkpoints import tiny_llama
from tests.backends.pd_http import assert_idle, post
from tests.support.worker_proc import started_workers

CHUNK = LANE_SIZE * LANES_PER_CHUNK   # elements a checksummed chunk holds
NAME = "tiny-llama"


def _slice(tensor: torch.Tensor, rows: tuple[int, int, int] | None) -> torch.Tensor:
    if rows is None:
        return tensor
    dim, start, stop = rows
    return tensor[start:stop] if dim == 0 else tensor[:, start:stop]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """What to compare bit for bit: a 16-bit float's bits, any other tensor itself."""
    return tensor.view(torch.int16) if tensor.dtype in (torch.bfloat16, torch.float16) else tensor


@pytest.fixture(scope="module")
def compressed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama, compressed in bf16."""
    plain, out = tmp_path_factory.mktemp("tiny-llama"), tmp_path_factory.mktemp("tiny-llama-swz")
    tiny_llama(plain)
    compress_folder(plain, out, cast=CastDtype.BF16)
    return out


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_slices_are_the_whole_files_slices(compressed: Path, rank: int) -> None:
    whole = load_compressed_file(compressed / "model.safetensors")
    layout = TPLayout.of(load_model_config(compressed), rank, 2, False)
    with ShardReader(compressed, layout) as shards:
        assert set(shards) == set(whole)
        for name, tensor in whole.items():
            got, want = shards[name], _slice(tensor, layout.rows_of(name))
            assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), name
        assert shards.read_bytes > 0


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """One bf16 tensor [2048, 1024] of 8 chunks, 256 rows each, compressed, and a plain float32 norm."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    weight = (torch.randn(2048, 1024, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    save_file({"w": weight, "norm": torch.ones(8)}, str(src / "model.safetensors"))
    compress_folder(src, dst)
    return dst / "model.safetensors"


def test_rows_are_decoded_from_their_chunks_alone(big: Path) -> None:
    whole = load_compressed_file(big)["w"]
    slices = CompressedSlices(big)
    everything, read_all = slices.read("w", None)
    assert torch.equal(_bits(everything), _bits(whole))
    rows_per_chunk = CHUNK // 1024
    half, read_half = slices.read("w", (0, 0, 4 * rows_per_chunk))   # the first 4 of 8 chunks
    assert torch.equal(_bits(half), _bits(whole[:4 * rows_per_chunk]))
    assert 0.4 * read_all < read_half < 0.6 * read_all
    columns, read_columns = slices.read("w", (1, 512, 1024))   # half of every row: every chunk
    assert torch.equal(_bits(columns), _bits(whole[:, 512:])) and read_columns == read_all
    tail, _ = slices.read("w", (0, 2000, 4096))                # clipped to the tensor's end, as safetensors does
    assert torch.equal(_bits(tail), _bits(whole[2000:]))
    assert torch.equal(slices.read("norm", (0, 2, 4))[0], torch.ones(2))


def test_a_damaged_chunk_is_refused_where_it_is_read(big: Path) -> None:
    mapped = map_file(big)
    _, _, begin, _ = mapped.spans[part_name("w", Part.RAW)]
    with open(big, "r+b") as f:   # one raw byte of chunk 6 flipped
        header = big.stat().st_size - mapped.data.size
        f.seek(header + begin + 6 * CHUNK + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    slices = CompressedSlices(big)
    rows_per_chunk = CHUNK // 1024
    slices.read("w", (0, 0, 4 * rows_per_chunk))   # chunks 0-3: not read, not checked
    with pytest.raises(CorruptWeightsError, match="chunk 6 fails its checksum"):
        slices.read("w", (0, 5 * rows_per_chunk, 8 * rows_per_chunk))


@pytest.mark.slow
async def test_groups_on_a_compressed_folder_give_one_ranks_tokens(compressed: Path,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    common = ["--model", str(compressed), "--threads", "1", "--num-blocks", "64", "--served-model-name", NAME]
    args = {"tp1": common, "tp2": [*common, "--tensor-parallel-size", "2"],
            "pp2": [*common, "--pipeline-parallel-size", "2"]}
    body = {"model": NAME, "prompt": STORY, "max_tokens": 12, "temperature": 0.0, "return_token_ids": True,
            "ignore_eos": True}
    with started_workers(args, tmp_path_factory.mktemp("swz-workers")) as workers:
        answers = {}
        for name, worker in workers.items():
            status, answer = await post(worker.url, body)
            assert status == 200, answer
            answers[name] = answer["choices"][0]["token_ids"]
        assert len(answers["tp1"]) == 12
        assert answers["tp2"] == answers["tp1"] == answers["pp2"]
        await assert_idle([worker.url for worker in workers.values()])
