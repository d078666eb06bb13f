"""What `LLM` returns per request: `RequestOutput` (the request's state) and its
`CompletionOutput` (the generated text and tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from anyattn.engine.detokenizer import OutputText

__all__ = ["CompletionOutput", "RequestOutput"]


class CompletionOutput:
    """One generated completion: its text, token ids (growing while the request runs) and
    why it ended (None while running). `text` is decoded when read, from where the previous
    read stopped."""

    def __init__(self, token_ids: list[int] | None = None, text: OutputText | None = None):
        self.token_ids: list[int] = [] if token_ids is None else token_ids
        self.finish_reason: str | None = None
        self._text = text

    @property
    def text(self) -> str:
        """The output text, cut before a stop string; settled text only while running."""
        if self._text is None:
            return ""
        self._text.update(is_finished=self.finish_reason is not None)
        return self._text.text

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(text={self.text!r}, token_ids={self.token_ids!r}, "
            f"finish_reason={self.finish_reason!r})"
        )


@dataclass
class RequestOutput:
    """The state of one request; `outputs[0]` is its completion.

    Attributes:
        error: why the request failed (e.g. a prompt longer than the model's context).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
