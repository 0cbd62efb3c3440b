"""Each token's own bytes, as the model's tokenizer spells it: the `bytes` of OpenAI's chat logprobs.

A token that is part of a character (a byte-level BPE piece of an emoji, a SentencePiece byte-fallback token)
decodes to U+FFFD alone; its bytes are what a client joins with its neighbours' to rebuild the text, which
is what the field is for. Byte-level vocabularies (GPT-2's, Llama 3's, SmolLM2's) spell each byte as one
printable character; SentencePiece ones spell a space as U+2581 and a lone byte as `<0xNN>`.
"""
from __future__ import annotations

import re
from typing import Any

import orjson
from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's printable spelling of the 256 bytes, read backwards: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_chars()


def _decoder_types(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    kind = decoder.get("type")
    found = {kind} if isinstance(kind, str) else set()
    for inner in decoder.get("decoders") or ():
        found |= _decoder_types(inner)
    return found


class TokenBytes:
    """token id -> its bytes, for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = "ByteLevel" in _decoder_types(orjson.loads(tokenizer.to_str()).get("decoder"))

    def __call__(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if (match := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(match[1], 16)])
        return piece.replace(_SENTENCEPIECE_SPACE, " ").encode()
