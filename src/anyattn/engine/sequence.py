"""Sequence: one request as the engine tracks it, from waiting in the queue to finished."""

from __future__ import annotations

import enum

from anyattn.engine.sampling_params import SamplingParams

__all__ = ["FINISH_REASONS", "PLACEHOLDER", "Sequence", "SequenceStatus"]

# "stop": eos, a stop token id or string; "length": max_tokens or max_model_len; "abort": the
# caller gave up; "error": it could not run (`Sequence.error` says why).
FINISH_REASONS = ("stop", "length", "abort", "error")

# A reserved token's value until its sampled token reaches the host (negative: no vocabulary
# id, so one that reached the model would fail loudly).
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (or preempted), being computed, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """One request: its tokens, how far its K/V are computed, and the KV blocks that hold them
    (state owned by the scheduler and block manager).

    Attributes:
        output_token_ids: generated tokens (a stop or eos token included); a reserved token
            joins them once its value is known.
        finish_reason: None until finished, then one of `FINISH_REASONS`; `stop_reason`: the
            stop token id or string that finished it (None for eos); `error`: why it failed.
        num_computed_tokens: leading tokens whose K/V are in the cache; `num_cached_tokens`:
            those reused from the prefix cache at the latest admission.
        block_table: block ids covering the computed and scheduled tokens; `block_hashes`: the
            chained hashes of full blocks (kept across preemption); `num_committed_blocks`:
            leading blocks already offered to the prefix cache.
        slot: its row of the scheduler's `InputBatch` while running, else None.
    """

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)  # ignored with ignore_eos
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_computed_tokens = self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.slot: int | None = None
        self.token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reserve_token(self) -> None:
        """Append a token sampled by a step still running (`PLACEHOLDER` until `fill_token`)."""
        self.token_ids.append(PLACEHOLDER)

    def fill_token(self, token_id: int) -> None:
        """Give the reserved last token its value; it becomes an output token."""
        assert self.token_ids[-1] == PLACEHOLDER, "fill_token needs a reserved token"
        self.token_ids[-1] = token_id
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(request_id={self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens}, "
            f"finish_reason={self.finish_reason!r})"
        )
