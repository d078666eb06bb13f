"""IncrementalDetokenizer: a request's output text, grown by decoding a few tokens per step.

Decoding the whole output after every token costs O(n) per step, O(n^2) per request. Instead
two offsets into the output tokens are kept: text before `prefix_offset` is settled; the
tokens `[prefix_offset, read_offset)` are the last ones already turned into text; each step
decodes `[prefix_offset, read_offset)` and `[prefix_offset, end)` and appends the difference.
Decoding from one token before the new ones (not from the new ones alone) keeps what a
tokenizer does at the start of a decode (SentencePiece drops the first token's leading space)
away from the new text. While the new text ends in U+FFFD (a multi-byte character split across
tokens, whose remaining bytes have not been generated yet) nothing is appended and the window
grows; `flush` settles what is left at the end. Each window starts where an earlier decode
ended on a whole character, so the text equals a decode of all the tokens at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    """What is needed of a tokenizer (transformers' and `tokenizers.Tokenizer` both fit)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of a growing list of output tokens.

    Args:
        tokenizer: anything with `decode(ids, skip_special_tokens=...)`.
        skip_special_tokens: drop special tokens from the text (as `generate` does).

    Attributes:
        token_ids: the tokens seen so far.
        text: the settled text: a decode of `token_ids`, minus a trailing part that may still
            change (an incomplete character); after `flush`, the decode of all of them.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def append(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they settle ("" while a character is still incomplete)."""
        self.token_ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        return self._settle(prefix_text, new_text)

    def flush(self) -> str:
        """Settle everything held back (the request has ended); returns that text."""
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text):
            return ""
        return self._settle(prefix_text, new_text)

    def _decode_window(self) -> tuple[str, str]:
        ids = self.token_ids
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix_ids = ids[self.prefix_offset : self.read_offset]
        prefix_text = decode(prefix_ids, skip_special_tokens=skip) if prefix_ids else ""
        return prefix_text, decode(ids[self.prefix_offset :], skip_special_tokens=skip)

    def _settle(self, prefix_text: str, new_text: str) -> str:
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta
