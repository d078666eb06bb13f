"""Sequence: one request as the engine tracks it, from waiting in the queue to finished."""

from __future__ import annotations

import enum

from anyattn.engine.sampling_params import SamplingParams

__all__ = ["FINISH_REASONS", "PLACEHOLDER", "Sequence", "SequenceStatus"]

# "stop": an eos token, a stop token id or a stop string; "length": max_tokens or max_model_len;
# "abort": the caller gave up on it; "error": it could not run (the message is in `error`).
FINISH_REASONS = ("stop", "length", "abort", "error")

# The value of a reserved token until its step's sampled token reaches the host (no vocabulary
# id is negative, so a placeholder that reached the model would fail loudly, not silently).
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (or preempted), being computed, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """One request: its tokens, how far its K/V are computed, and the KV blocks that hold them.

    The scheduler and block manager own the mutable state; the model runner reads it through
    the scheduler's `InputBatch`.

    Attributes:
        output_token_ids: generated tokens, in order (a stop or eos token included); a
            reserved token (`reserve_token`) joins them once its value is known.
        finish_reason: None until finished, then one of `FINISH_REASONS`; `stop_reason`: the
            stop token id or string that finished it (None for eos); `error`: why it failed.
        num_computed_tokens: leading tokens whose K/V are in the cache (prefix-cache hits
            included); 0 again after a preemption. `num_cached_tokens`: those reused from the
            prefix cache at the latest admission.
        block_table: physical block ids covering the computed tokens and those scheduled.
        block_hashes: chained hashes of the full blocks of `token_ids` (filled lazily by the
            block manager, kept across preemption); `num_committed_blocks`: leading blocks
            already offered to the prefix cache.
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
        # prompt + output as one list, read by block hashing; never mutate it from outside.
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
        """Count one more token whose value is not known yet (sampled by a step still running on
        the device): `token_ids` ends with `PLACEHOLDER` until `fill_token`."""
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
