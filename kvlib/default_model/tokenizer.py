"""Byte-level tokenizer of the default model: token id = byte value, plus three specials.

Ids 0..255 are the bytes of the UTF-8 text; :data:`BOS_ID` (256) starts every sequence,
:data:`EOS_ID` (257) ends one, :data:`PAD_ID` (258) pads a batch. :data:`VOCAB_SIZE` is 259.
Encoding is lossless for any string; decoding drops specials and replaces invalid UTF-8.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259


@dataclass(frozen=True)
class ByteTokenizer:
    """Text <-> byte ids. The same interface as :class:`kvlib.eval.tokenizers.TextTokenizer`."""

    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    pad_token_id: int = PAD_ID

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, after :data:`BOS_ID` when ``bos``."""
        return ([BOS_ID] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of the byte ids in ``ids``; special ids are skipped."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def instruct(self, message: str, reply_start: str = "") -> list[int]:
        """BOS, ``message`` and ``reply_start`` (the model has no chat template)."""
        return self.encode(message + reply_start, bos=True)
