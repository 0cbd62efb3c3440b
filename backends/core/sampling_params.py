"""What a request asks of generation, as the engine sees it (after the server has validated it).

Frozen: a sequence's parameters never change once admitted, and the record crosses the
server/engine boundary and (inside kv_transfer_params) the prefill/decode boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5   # a temperature below this samples greedily


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16                 # output tokens at most (the engine also caps at the context)
    temperature: float = 1.0             # 0 (below GREEDY_BELOW) means greedy
    top_p: float = 1.0                   # nucleus mass kept, in (0, 1]
    top_k: int = 0                       # 0 (or < 0) disables
    min_p: float = 0.0                   # drop tokens below min_p * max prob
    seed: int | None = None              # same seed, same tokens, whatever the batch
    stop_token_ids: tuple[int, ...] = () # finish (reason "stop") when one is sampled
    ignore_eos: bool = False             # keep going past EOS
    min_tokens: int = 0                  # EOS and stop ids are masked until this many are out
    presence_penalty: float = 0.0        # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0       # OpenAI semantics, over output tokens
    repetition_penalty: float = 1.0      # HF/vLLM semantics, over prompt and output tokens
    logprobs: int | None = None          # None: none; k >= 0: the sampled token's logprob + top-k
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit): OpenAI's logit_bias
    speculative: bool = True             # False: this request never runs drafts (the worker's setting otherwise)
    json_object: bool = False            # the output is one JSON object (OpenAI's response_format json_object)
    json_schema: str | None = None       # ... or JSON that follows this schema (its JSON text, its key order)
    # Stop strings are matched by the server on detokenized text; the engine never sees them.
    stop: tuple[str, ...] = field(default=())

    @property
    def structured(self) -> bool:
        """The output is constrained to JSON (backends/structured_output/json_output.py)."""
        return self.json_object or self.json_schema is not None

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that sampling at it is greedy anyway (dividing float32 logits by it
        could overflow them into NaN probabilities): below 1e-5, as vLLM rounds it."""
        return self.temperature < GREEDY_BELOW
