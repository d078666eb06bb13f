"""What `LLM` returns per request: `RequestOutput` (the request's state) and its
`CompletionOutput` (the generated text and tokens)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One generated completion: its text, token ids and why it ended (None while running)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


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
