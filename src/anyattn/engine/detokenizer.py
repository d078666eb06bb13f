"""A request's output text, grown by decoding a few tokens at a time, and cut at stop strings.

`IncrementalDetokenizer` decodes `[prefix_offset, read_offset)` and `[prefix_offset, end)` and
appends the difference, so what a tokenizer does at the start of a decode (SentencePiece drops a
leading space) stays out of the new text; text ending in U+FFFD (an incomplete character) is
held back until `flush`. The text always equals a decode of all the tokens at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "OutputText"]

_REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    """What is needed of a tokenizer (transformers' and `tokenizers.Tokenizer` both fit)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """The text of a growing list of output tokens: `text` is the decode of `token_ids` minus
    a trailing incomplete character; after `flush`, the decode of all of them."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = self.read_offset = 0

    def append(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they settle ("" while a character is still incomplete)."""
        self.token_ids.extend(token_ids)
        return self._settle(is_final=False)

    def flush(self) -> str:
        """Settle everything held back (the request has ended); returns that text."""
        return self._settle(is_final=True)

    def _settle(self, is_final: bool) -> str:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix_ids = self.token_ids[self.prefix_offset : self.read_offset]
        prefix_text = decode(prefix_ids, skip_special_tokens=skip) if prefix_ids else ""
        new_text = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or (not is_final and new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta


class OutputText:
    """The text of a request's output tokens (`token_ids`, a list that grows as it runs), cut
    before the first of its `stop` strings to appear; `stop_reason` is that string, or None."""

    def __init__(self, tokenizer: Tokenizer, token_ids: list[int], stop: Sequence[str]) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._token_ids = token_ids
        self._stop = tuple(stop)
        self._cut: int | None = None
        self._is_flushed = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        return self._detokenizer.text[: self._cut]

    def update(self, is_finished: bool) -> str | None:
        """Decode the tokens added since the last call (and settle everything once finished);
        returns the stop string that now ends the text, if one appeared in the new part."""
        detokenizer = self._detokenizer
        new_ids = self._token_ids[len(detokenizer.token_ids) :]
        if self._cut is not None or self._is_flushed or not (new_ids or is_finished):
            return None
        searched = len(detokenizer.text)
        if new_ids:
            detokenizer.append(new_ids)
        if is_finished:
            detokenizer.flush()
            self._is_flushed = True
        text = detokenizer.text
        # a stop string ends in the newly settled text, and may start a little before it
        cut = len(text)
        for stop in self._stop:
            found = text.find(stop, max(searched - len(stop) + 1, 0), cut + len(stop) - 1)
            if found != -1:
                cut, self.stop_reason = found, stop
        if self.stop_reason is not None:
            self._cut = cut
        return self.stop_reason
