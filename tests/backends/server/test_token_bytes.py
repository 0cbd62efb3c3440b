"""Chat logprobs' `bytes`: each token's own bytes, so that joining a text's tokens' bytes gives back the text,
characters split across tokens (emoji, CJK) included; a lone piece of a character decodes to U+FFFD, whose
bytes are not the piece's. Checked on the bundled SmolLM2's byte-level vocabulary and on a SentencePiece-style
one with byte fallback; the texts' token ids come from each tokenizer's own encoder."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from backends.server.tokenization import PromptTokenizer
from backends.structured_output.token_bytes import TokenBytes
from backends.worker.loader import resolve_model

TEXTS = ["🌊 waves, 東京, naïve café — ok", "plain ASCII", "<|im_end|> after a special token"]


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return PromptTokenizer.from_model_dir(resolve_model("smollm2")).backend


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_to_the_text(smollm2: Tokenizer, text: str) -> None:
    ids = smollm2.encode(text, add_special_tokens=False).ids
    token_bytes = TokenBytes(smollm2)
    assert b"".join(token_bytes(i) for i in ids) == text.encode()
    pieces = [i for i in ids if smollm2.decode([i]) == "\ufffd"]
    if "🌊" in text:   # the emoji is split: its pieces decode to U+FFFD alone, their bytes are not its bytes
        assert pieces and all(token_bytes(i) != "\ufffd".encode() for i in pieces)


def test_sentencepiece_byte_fallback_tokens_join_to_the_text() -> None:
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab |= {"\u2581": 256, "h": 257, "i": 258, "\u2581h": 259, "\u2581hi": 260}
    tokenizer = Tokenizer(models.BPE(vocab, [("\u2581", "h"), ("\u2581h", "i")], byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    encoding = tokenizer.encode("hi 🌊 hi")
    assert "<0xF0>" in encoding.tokens            # the emoji falls back to its bytes
    token_bytes = TokenBytes(tokenizer)
    assert b"".join(token_bytes(i) for i in encoding.ids) == " hi 🌊 hi".encode()   # the prefix space is a token's
