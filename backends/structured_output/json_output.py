"""Structured output in the engine: OpenAI's `response_format` `json_object` (any one JSON object) and
`json_schema` (JSON that follows a schema). Each such sequence carries its grammar's masks and the state of
its recognizer over the output; the sampler sees the tokens that keep the output a valid prefix (and EOS only
once the JSON value has closed), and each sampled token advances the state. The recognizers and the masks are
`json_mode.py`'s and `json_schema.py`'s; this module keeps them per model, per schema and per sequence.

The vocabulary's byte tries are built from the model folder's tokenizer on the first structured request (about
half a second): a worker that never sees one never pays for it.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import orjson
import torch

from backends.core.engine_errors import EngineRequestError
from backends.core.sampling_params import SamplingParams
from backends.core.sequence import Sequence
from backends.structured_output.json_mode import GrammarMasks, JsonObject, VocabularyTries
from backends.structured_output.json_schema import UnsupportedSchema, compile_schema
from backends.structured_output.schema_grammar import SchemaGrammar

log = logging.getLogger(__name__)

MAX_SCHEMAS = 16                 # grammars kept per engine (least recently used dropped)
MAX_STATES_PER_SCHEMA = 1024     # cached masks per schema grammar (6 KB each for a 49k vocabulary)


@functools.lru_cache(maxsize=64)
def compiled_schema(text: str) -> SchemaGrammar:
    """The grammar of a schema given as JSON text (raises UnsupportedSchema); shared by the server's check and
    the engine."""
    return compile_schema(orjson.loads(text))


def token_bytes_of(model_dir: Path, vocab_size: int) -> list[bytes | None]:
    """Each token id's bytes as the tokenizer spells it; None for special tokens (a role marker is never
    part of a JSON text) and for ids past the tokenizer's vocabulary (padding rows of the embedding)."""
    from tokenizers import Tokenizer

    from backends.structured_output.token_bytes import TokenBytes  # pure tokenizer code, shared with the chat logprobs

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    spell = TokenBytes(tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    return [None if i in special or i >= size else spell(i) for i in range(vocab_size)]


class JsonOutput:
    """The structured-output sequences of one engine. A sequence's `json_state` is (its grammar's masks, the
    recognizer's state)."""

    def __init__(self, model_dir: Path | None, eos_token_ids: Seq[int], vocab_size: int) -> None:
        self._model_dir = model_dir
        self._eos_token_ids = tuple(eos_token_ids)
        self._vocab_size = vocab_size
        self._tries: VocabularyTries | None = None
        self._grammars: OrderedDict[str | None, GrammarMasks[Any]] = OrderedDict()   # by schema text; None: object
        self._lock = threading.Lock()   # `check` runs on the server's thread, the rest on the engine's

    def check(self, params: SamplingParams, first_token_ids: Seq[int]) -> None:
        """Raise EngineRequestError when a structured request's tokens to continue from (a decode leg's first
        tokens, a resumed answer's) begin no valid output. Any thread."""
        if params.structured and first_token_ids and self._masks(params).state_after(first_token_ids) is None:
            raise EngineRequestError("the tokens to continue from are not the start of the JSON asked for")

    def warm(self) -> None:
        """Build the vocabulary tries now (a worker does at start-up, before it serves), not on the first
        structured request: built then, on the step thread, they stall every running sequence (0.3 s for
        SmolLM2's 49k tokens; a thread of their own holds the GIL as long). Without a tokenizer: nothing."""
        if self._model_dir is not None:
            with self._lock:
                self._vocabulary_tries()

    def start(self, seq: Sequence) -> None:
        """Give a structured sequence its grammar and state, after the tokens it already has (`check`ed)."""
        if seq.params is not None and seq.params.structured:
            masks = self._masks(seq.params)
            seq.json_state = (masks, masks.state_after(seq.output_token_ids))

    def allowed(self, seq: Sequence) -> torch.Tensor | None:
        """The tokens the sequence may sample next ([vocab] bool); None: any."""
        if seq.json_state is None:
            return None
        masks, state = seq.json_state
        return masks.allowed(state)

    def advance(self, seq: Sequence, token_id: int) -> None:
        if seq.json_state is None:
            return
        masks, state = seq.json_state
        after = masks.advance(state, token_id)
        if after is None:   # cannot happen for a sampled token: the mask allowed only valid ones
            raise RuntimeError(f"token {token_id} breaks the JSON output of {seq.request_id}")
        seq.json_state = (masks, after)

    def _masks(self, params: SamplingParams) -> GrammarMasks[Any]:
        key = params.json_schema
        with self._lock:
            masks = self._grammars.get(key)
            if masks is not None:
                self._grammars.move_to_end(key)
                return masks
            tries = self._vocabulary_tries()
            if key is None:
                masks = GrammarMasks(tries, JsonObject())
            else:
                try:
                    grammar = compiled_schema(key)
                except UnsupportedSchema as exc:
                    raise EngineRequestError(f"the JSON schema cannot be followed: {exc}") from None
                masks = GrammarMasks(tries, grammar, max_cached_states=MAX_STATES_PER_SCHEMA)
            self._grammars[key] = masks
            if len(self._grammars) > MAX_SCHEMAS:
                self._grammars.popitem(last=False)
            return masks

    def _vocabulary_tries(self) -> VocabularyTries:
        if self._tries is None:
            if self._model_dir is None:
                raise EngineRequestError("structured output needs the model folder's tokenizer, which this engine "
                                         "has not")
            self._tries = VocabularyTries(token_bytes_of(self._model_dir, self._vocab_size), self._eos_token_ids)
            log.info("structured-output vocabulary tries built for %s", self._model_dir)
        return self._tries
