"""The whole embedding and LM head an EAGLE head reads beside a tensor-parallel shard
(backends/speculative/vocabulary.py): read from a tied checkpoint (SmolLM2) and an untied one (the tiny Llama of the
tensor-parallel tests), against transformers' own tables, and the proposer on them drafting as it does on the
target's own tables."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from backends.speculative.eagle import EagleProposer
from backends.speculative.proposer import DraftRequest
from backends.speculative.vocabulary import WholeVocabulary
from backends.worker.model_runner import ModelRunner
from tests.backends.executor.tp_checkpoints import tiny_llama
from tests.backends.speculative.test_eagle import write_head


@pytest.fixture(scope="module", params=["smollm2-tied", "tiny-llama-untied"])
def checkpoint(request: pytest.FixtureRequest, smollm2_dir: Path, hf_smollm2: PreTrainedModel,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    if request.param == "smollm2-tied":
        return smollm2_dir, hf_smollm2
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, tiny_llama(folder)


def read(folder: Path, runner: ModelRunner) -> WholeVocabulary:
    return WholeVocabulary.read(folder, runner.model.config, runner.kernels, runner.dtype, runner.device)


def test_the_tables_are_transformers_and_a_tied_one_is_kept_once(checkpoint: tuple[Path, PreTrainedModel]) -> None:
    folder, reference = checkpoint
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=8)
    vocabulary = read(folder, runner)
    tied = bool(reference.config.tie_word_embeddings)
    assert vocabulary.lm_head.packed is None   # until the first logits: an int8 head never needs the packed copy
    assert (vocabulary.lm_head_weight() is vocabulary.embed_tokens.weight) == tied
    ids = torch.tensor([0, 1, 17, 4096, reference.config.vocab_size - 1])
    hidden = torch.randn(3, reference.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(vocabulary.embed(ids), reference.get_input_embeddings()(ids))
        want = reference.get_output_embeddings()(hidden)
        got = vocabulary.compute_logits(hidden)
    assert got.shape == want.shape == (3, reference.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    table = reference.config.vocab_size * reference.config.hidden_size * 4   # float32
    copy = vocabulary.lm_head.packed   # packed when the logits were asked for (its layout the CPU's)
    packed = 0 if copy is None else copy.numel() * copy.element_size()
    assert vocabulary.weight_bytes() == table * (1 if tied else 2) + packed


@pytest.mark.parametrize("d2t", [False, True], ids=["whole-vocabulary", "draft-vocabulary"])
def test_a_head_on_the_whole_tables_drafts_as_on_the_targets(tmp_path: Path, checkpoint: tuple[Path, PreTrainedModel],
                                                             d2t: bool) -> None:
    folder, _ = checkpoint
    runner = ModelRunner(folder, dtype=torch.float32, device="cpu", num_blocks=16, block_size=4)
    head = write_head(tmp_path / "head", folder, eagle1=False, fmt="safetensors", d2t=d2t)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, runner.vocab_size, (40,), generator=g).tolist()
    hidden = torch.randn(40, runner.model.config.hidden_size, generator=g)
    drafts = []
    for vocabulary in (None, read(folder, runner)):
        proposer = EagleProposer(head, runner.model, num_blocks=16, block_size=4, int8=False, vocabulary=vocabulary)
        proposer.observe("a", 0, tokens[:31], hidden[:30])
        proposer.observe("b", 0, tokens[:21], hidden[:20])
        drafts.append(proposer.propose([DraftRequest("a", tokens[:31], 4), DraftRequest("b", tokens[:21], 3)]))
    assert [len(d) for d in drafts[0]] == [4, 3]
    assert drafts[1] == drafts[0]
