"""JSON mode (OpenAI's `response_format: {"type": "json_object"}`) in the engine: each such sequence carries
the state of a JSON recognizer over its output, the sampler sees the tokens that keep the output a valid
prefix of one JSON object (and EOS only once the object has closed), and each sampled token advances the
state. The recognizer and the per-state token masks are `json_mode.py`'s; this module keeps them per model and
per sequence.

The masks are built from the model folder's tokenizer on the first JSON request (about a second), on the
engine thread: a worker that never sees one never pays for it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from backends.engine.errors import EngineRequestError
from backends.engine.json_mode import TokenMasks
from backends.engine.sampling_params import SamplingParams
from backends.engine.sequence import Sequence

log = logging.getLogger(__name__)


def token_bytes_of(model_dir: Path, vocab_size: int) -> list[bytes | None]:
    """Each token id's bytes as the tokenizer spells it; None for special tokens (a role marker is never
    part of a JSON text) and for ids past the tokenizer's vocabulary (padding rows of the embedding)."""
    from tokenizers import Tokenizer

    from backends.server.token_bytes import TokenBytes   # pure tokenizer code, shared with the chat logprobs

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    spell = TokenBytes(tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return [None if i in special or i >= size else spell(i) for i in range(vocab_size)]


class JsonOutput:
    """The JSON-mode sequences of one engine."""

    def __init__(self, model_dir: Path | None, eos_token_ids: Seq[int], vocab_size: int) -> None:
        self._model_dir = model_dir
        self._eos_token_ids = tuple(eos_token_ids)
        self._vocab_size = vocab_size
        self._masks: TokenMasks | None = None
        self._building = threading.Lock()   # `check` runs on the server's thread, the rest on the engine's

    def check(self, params: SamplingParams, first_token_ids: Seq[int]) -> None:
        """Raise EngineRequestError when a JSON-mode request's tokens to continue from (a decode leg's first
        tokens, a resumed answer's) begin no JSON object. Pure: any thread."""
        if params.json_object and first_token_ids and self._token_masks().state_after(first_token_ids) is None:
            raise EngineRequestError("the tokens to continue from are not the start of a JSON object")

    def start(self, seq: Sequence) -> None:
        """Give a JSON-mode sequence its recognizer state, after the tokens it already has (`check`ed)."""
        if seq.params.json_object:
            seq.json_state = self._token_masks().state_after(seq.output_token_ids)

    def allowed(self, seq: Sequence) -> torch.Tensor | None:
        """The tokens the sequence may sample next (a read-only [vocab] bool mask); None: any."""
        if seq.json_state is None:
            return None
        return self._token_masks().allowed(seq.json_state)

    def advance(self, seq: Sequence, token_id: int) -> None:
        if seq.json_state is None:
            return
        state = self._token_masks().advance(seq.json_state, token_id)
        if state is None:   # cannot happen for a sampled token: the mask allowed only valid ones
            raise RuntimeError(f"token {token_id} breaks the JSON output of {seq.request_id}")
        seq.json_state = state

    def _token_masks(self) -> TokenMasks:
        with self._building:
            if self._masks is None:
                if self._model_dir is None:
                    raise EngineRequestError("JSON mode needs the model folder's tokenizer, which this engine has not")
                self._masks = TokenMasks(token_bytes_of(self._model_dir, self._vocab_size), self._eos_token_ids)
                log.info("JSON-mode token masks built for %s", self._model_dir)
            return self._masks
