"""Incremental detokenization of one sequence's output, with stop strings matched on the text.

Owns only text: which tokens to run and when to abort is the caller's business. Text that may
be the start of a stop string is held back until the next tokens settle it, so a stream never
shows a stop string (or part of one) that the final text does not contain.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the decoder as context, so the first output token decodes with the
# spacing it has after the prompt (SentencePiece-style decoders strip a leading space).
_PROMPT_CONTEXT_TOKENS = 4


class StopStringDetokenizer:
    """Turns output token ids into text one token at a time and cuts it at the first stop string."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens
        )
        self._stop = tuple(s for s in stop if s)
        self._max_stop_chars = max((len(s) for s in self._stop), default=0)
        self._text = ""        # output text so far, cut before the stop string once one matched
        self._num_sent = 0     # characters of _text already handed out by take()/finish()
        self._stopped = False
        self._matched_stop: str | None = None   # the stop string that cut the text

    @property
    def text(self) -> str:
        """All output text so far (without any stop string)."""
        return self._text

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self._matched_stop

    def push(self, token_id: int) -> bool:
        """Add one output token; True when its text completed a stop string (push no more)."""
        if self._stopped:
            raise RuntimeError("push() after a stop string matched")
        chunk = self._stream.step(self._tokenizer, token_id)
        if not chunk:
            return False
        # Text before this chunk held no complete stop string, so a match ends inside the chunk.
        search_from = max(0, len(self._text) - self._max_stop_chars + 1)
        self._text += chunk
        cut = self._find_stop(search_from)
        if cut is not None:
            self._matched_stop = next(s for s in self._stop if self._text.startswith(s, cut))
            self._text = self._text[:cut]
            self._stopped = True
        return self._stopped

    def take(self) -> str:
        """Text that is safe to send now: everything except a tail that could begin a stop string."""
        end = len(self._text) if self._stopped else len(self._text) - self._held_back()
        return self._send_until(end)

    def finish(self) -> str:
        """The sequence ended: send whatever is left, held-back tail included."""
        return self._send_until(len(self._text))

    def _send_until(self, end: int) -> str:
        if end <= self._num_sent:
            return ""
        out = self._text[self._num_sent:end]
        self._num_sent = end
        return out

    def _find_stop(self, search_from: int) -> int | None:
        hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
