"""Scheduler: continuous batching with chunked prefill, preemption by recompute, FCFS.

A step's budget of `max_num_batched_tokens` new tokens goes to running decodes (one token
left), then running prompts part-way through (chunked prefill), each in admission order, then
to waiting sequences in arrival order while fewer than `max_num_seqs` run; a waiting sequence
that does not fit stops admission (nobody overtakes it).

A step is applied in two halves: `advance` at launch (tokens computed, full blocks offered to
the prefix cache, one token reserved per sampled sequence) and `resolve` once the sampled
tokens are on the host. The next step may be scheduled and launched in between (asynchronous
scheduling) but is advanced only after that resolve; a sequence whose reserved token reaches
its length limit is not scheduled again. `update` is both halves at once.

When a running sequence needs a block and none is free, the most recently admitted one is
preempted (blocks freed, `num_computed_tokens` 0, back to the front of the queue) and the step
admits nobody. A request that could not finish with the whole pool to itself fails when added
(finish reason "error"), so nothing deadlocks. Running sequences own a row (`slot`) of
`input_batch`, which the model runner lays steps out from.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from anyattn.engine.block_manager import BlockManager
from anyattn.engine.input_batch import InputBatch
from anyattn.engine.sequence import FINISH_REASONS, PLACEHOLDER, Sequence, SequenceStatus

__all__ = ["ScheduledBatch", "Scheduler"]


@dataclass
class ScheduledBatch:
    """One step's work: `seqs` (decodes first) each compute `num_new_tokens[i]` tokens from
    their `num_computed_tokens` on (their blocks cover them); `slots`: int32 `[len(seqs)]`, their
    rows of the scheduler's `input_batch`; `preempted` while planning it; `failed` since the
    previous step (finish reason "error")."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)
    # indices into `seqs` whose next token `Scheduler.advance` reserved and `resolve` fills
    reserved: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_tokens(self) -> int:
        """New tokens in the step, over all sequences."""
        return sum(self.num_new_tokens)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Scheduler: {name} must be an int >= 1 (got {value!r}).")
    return value


class Scheduler:
    """Decides each step's batch and applies its results.

    `waiting` (next to admit first) and `running` (admission order) hold the sequences;
    `num_preemptions` counts preemptions. Without chunked prefill a prompt runs in one step, so
    `max_num_batched_tokens` must hold `max_model_len` tokens (ValueError otherwise, as for a
    limit that is not a positive int).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = _positive("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
        self.max_model_len = _positive("max_model_len", max_model_len)
        self.enable_chunked_prefill = enable_chunked_prefill
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Scheduler: with chunked prefill off, max_num_batched_tokens must be >= "
                f"max_model_len (got {max_num_batched_tokens} < {max_model_len}). Enable chunked "
                "prefill or raise max_num_batched_tokens."
            )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._running_slots: list[int] = []  # seq.slot of each of `running`, same order
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_manager.block_size)
        self.num_preemptions = 0
        self._failed: list[Sequence] = []
        # Per slot: the length at which its sequence finishes; eos and stop ids of all admitted.
        self._max_num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self._stop_ids = np.zeros(0, dtype=np.int64)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. One that can never run (an empty prompt, one longer than
        `max_model_len`, or a request that may outgrow the whole pool) fails instead, reported
        in the next `ScheduledBatch.failed`. ValueError: not a fresh WAITING sequence."""
        if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.block_table:
            raise ValueError(
                f"Scheduler.add: request {seq.request_id!r} is not new (status "
                f"{seq.status.name}, {seq.num_output_tokens} output tokens). Add a new Sequence."
            )
        bm, n, rid = self.block_manager, seq.num_prompt_tokens, seq.request_id
        longest = self._longest(seq)
        if n == 0:
            self._fail(seq, f"request {rid!r} has an empty prompt; give it at least one token.")
        elif n > self.max_model_len:
            self._fail(
                seq,
                f"request {rid!r} has a prompt of {n} tokens, longer than max_model_len "
                f"{self.max_model_len}; shorten the prompt or raise max_model_len.",
            )
        elif bm.num_blocks_for(longest) > bm.num_usable_blocks:
            capped = " (max_model_len)" if longest == self.max_model_len else ""
            self._fail(
                seq,
                f"request {rid!r} may grow to {longest} tokens{capped} (prompt {n} + max_tokens "
                f"{seq.params.max_tokens}), which need {bm.num_blocks_for(longest)} KV blocks of "
                f"{bm.block_size} tokens, but the pool has only {bm.num_usable_blocks}: it could "
                "never finish, even alone. Lower max_tokens, shorten the prompt, or give the KV "
                "cache more memory.",
            )
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while sequences wait or run, or failures are still to be reported."""
        return bool(self.waiting or self.running or self._failed)

    def schedule(self) -> ScheduledBatch:
        """Plan the next step (the module docstring has the rules)."""
        batch = ScheduledBatch(failed=self._failed)
        self._failed = []
        budget = self.max_num_batched_tokens
        decodes = self._schedule_decodes(budget)
        if decodes is not None:
            seqs, decode_slots = decodes
            num_new = [1] * len(seqs)
        else:
            scheduled = self._schedule_running(budget, batch)
            seqs, num_new = list(scheduled), list(scheduled.values())
        budget -= sum(num_new)
        admitted: dict[Sequence, int] = {}
        if not batch.preempted:
            self._admit(budget, admitted)
        batch.seqs = seqs + list(admitted)
        batch.num_new_tokens = num_new + list(admitted.values())
        if decodes is not None:
            new_slots = [seq.slot for seq in admitted]
            batch.slots = np.append(decode_slots, new_slots) if new_slots else decode_slots
        else:
            batch.slots = np.array([seq.slot for seq in batch.seqs], dtype=np.int32)
        return batch

    def _schedule_decodes(self, budget: int) -> tuple[list[Sequence], np.ndarray] | None:
        """When every running sequence is a decode and the budget and free blocks cover them,
        give each one token and return them and their slots (those already at their length
        limit left out); else None, changing nothing."""
        running, batch, bm = self.running, self.input_batch, self.block_manager
        if not running or budget < len(running):
            return None
        slots = np.array(self._running_slots, dtype=np.int32)
        computed = batch.num_computed[slots]
        if not np.array_equal(batch.num_tokens[slots], computed + 1):
            return None
        num_tokens = batch.num_tokens[slots]
        # A reserved last token that reaches the length limit ends its sequence whatever its
        # value: nothing to run. (A known last token at the limit, the end of a prompt of
        # max_model_len tokens, still runs: it is sampled from.)
        ending = (num_tokens >= self._max_num_tokens[slots]) & (
            batch.token_ids[slots, num_tokens - 1] == PLACEHOLDER
        )
        if ending.any():
            running = [seq for seq, end in zip(running, ending.tolist(), strict=True) if not end]
            slots, computed = slots[~ending], computed[~ending]
        grow = np.flatnonzero(computed >= batch.num_blocks[slots] * bm.block_size)
        if len(grow) > bm.num_free_blocks:
            return None
        for index in grow.tolist():
            seq = running[index]
            bm.append(seq, 1)
            batch.extend_blocks(seq.slot, seq.block_table)
        return list(running), slots

    def _schedule_running(self, budget: int, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Running sequences -> their new tokens, decodes first, preempting when blocks run out."""
        scheduled: dict[Sequence, int] = {}
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.token_ids[-1] == PLACEHOLDER and seq.num_tokens >= self._longest(seq):
                continue  # its reserved token ends it whatever its value: nothing to run
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim, batch)
                # A victim scheduled earlier in this loop gives its tokens back.
                budget += scheduled.pop(victim, 0)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append(seq, num_new)
                self.input_batch.extend_blocks(seq.slot, seq.block_table)
                scheduled[seq] = num_new
                budget -= num_new
        return scheduled

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Apply a computed step whose tokens are known: `advance`, then `resolve`.

        `sampled[i]` is the token of `batch.seqs[i]` when the step computed all its known
        tokens, else None (a prefill chunk mid-prompt); ValueError when that does not hold.
        Returns the sequences that finished (their blocks already freed).
        """
        if len(sampled) != len(batch.seqs):
            raise ValueError(
                f"Scheduler.update: sampled has {len(sampled)} entries, expected one per "
                f"scheduled sequence ({len(batch.seqs)})."
            )
        self.advance(batch, [i for i, token in enumerate(sampled) if token is not None])
        return [seq for seq in self.resolve(batch, sampled) if seq.is_finished]

    def advance(self, batch: ScheduledBatch, sample_rows: list[int]) -> None:
        """Count a launched step as computed, offer filled blocks to the prefix cache and
        reserve the next token of each of `sample_rows` (indices into `batch.seqs`) for
        `resolve` to fill. Sequences finished since `schedule` are left alone. ValueError when
        `sample_rows` are not exactly the sequences whose known tokens the step completes."""
        seqs, n = batch.seqs, len(batch.seqs)
        arrays, slots = self.input_batch, batch.slots
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int32)
        live = np.fromiter((s.status is SequenceStatus.RUNNING for s in seqs), bool, n)
        samples = np.zeros(n, dtype=bool)
        samples[np.asarray(sample_rows, dtype=np.int64)] = True
        before = arrays.num_computed[slots]
        completes = before + num_new == arrays.num_tokens[slots]
        bad = np.flatnonzero(live & (completes != samples))
        if len(bad):
            i = int(bad[0])
            expected = "a token" if completes[i] else "None (mid-prefill chunk)"
            got = "a token" if samples[i] else "None"
            raise ValueError(
                f"Scheduler.advance: request {seqs[i].request_id!r} expected {expected} "
                f"(got {got})."
            )
        rows = np.flatnonzero(live & samples)
        for i in rows.tolist():
            if seqs[i].token_ids[-1] == PLACEHOLDER:
                raise RuntimeError(
                    f"Scheduler.advance: request {seqs[i].request_id!r} still has a reserved "
                    "token; resolve the previous step before advancing the next."
                )
        arrays.advance(slots[live], num_new[live])
        for i in np.flatnonzero(live).tolist():
            seqs[i].num_computed_tokens += batch.num_new_tokens[i]
        size = self.block_manager.block_size
        for i in np.flatnonzero(live & ((before + num_new) // size > before // size)).tolist():
            self.block_manager.commit(seqs[i])
        arrays.reserve_tokens(slots[rows])
        for i in rows.tolist():
            seqs[i].reserve_token()
        batch.reserved = rows

    def resolve(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Give the tokens `advance` reserved their values (`sampled[i]` for `batch.seqs[i]`)
        and finish the sequences they end (their blocks freed). A sequence finished since keeps
        none; one preempted since gets its token (recomputed with the others when it resumes).
        Returns the sequences that got a token, in batch order."""
        seqs, arrays = batch.seqs, self.input_batch
        rows = [i for i in batch.reserved.tolist() if seqs[i].status is not SequenceStatus.FINISHED]
        batch.reserved = batch.reserved[:0]
        if not rows:
            return []
        filled = [seqs[i] for i in rows]
        tokens = np.array([sampled[i] for i in rows], dtype=np.int64)
        limits = np.empty(len(rows), dtype=np.int64)
        running, running_slots = [], []
        for k, i in enumerate(rows):
            seq = seqs[i]
            seq.fill_token(int(tokens[k]))
            limits[k] = self._longest(seq) - seq.num_tokens
            if seq.status is SequenceStatus.RUNNING:
                running.append(k)
                running_slots.append(seq.slot)
        arrays.fill_tokens(np.asarray(running_slots, dtype=np.int64), tokens[running])
        may_end = (limits <= 0) | np.isin(tokens, self._stop_ids)
        for k in np.flatnonzero(may_end).tolist():
            seq, token = seqs[rows[k]], int(tokens[k])
            params = seq.params
            if not params.ignore_eos and token in seq.eos_token_ids:
                self.finish(seq, "stop")
            elif token in params.stop_token_ids:
                self.finish(seq, "stop", stop_reason=token)
            elif seq.num_tokens >= self._longest(seq):
                self.finish(seq, "length")
        return filled

    def finish(
        self,
        seq: Sequence,
        reason: str,
        *,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> None:
        """Finish a sequence now (`reason` one of `FINISH_REASONS`, else ValueError): free its
        blocks and drop it from the queues. On a finished sequence only the reasons change."""
        if reason not in FINISH_REASONS:
            raise ValueError(
                f"Scheduler.finish: reason must be one of {FINISH_REASONS} (got {reason!r})."
            )
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if error is not None:
            seq.error = error
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self._drop_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def _admit(self, budget: int, scheduled: dict[Sequence, int]) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            remaining = seq.num_tokens - bm.cached_prefix_len(seq)
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            if not bm.allocate(seq, num_new):
                # With nothing running the whole pool is free, and `add` checked that it fits.
                assert self.running, "an empty pool must hold a sequence that passed the check"
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.slot = self.input_batch.add(seq.token_ids, seq.num_computed_tokens, seq.block_table)
            self.running.append(seq)
            self._running_slots.append(seq.slot)
            self._max_num_tokens[seq.slot] = self._longest(seq)
            ids = set(seq.eos_token_ids) | set(seq.params.stop_token_ids)
            if not ids <= set(self._stop_ids.tolist()):
                self._stop_ids = np.union1d(self._stop_ids, sorted(ids)).astype(np.int64)
            scheduled[seq] = num_new
            budget -= num_new

    def _drop_running(self, seq: Sequence) -> None:
        index = self.running.index(seq)
        del self.running[index], self._running_slots[index]
        assert seq.slot is not None, "a running sequence holds a slot"
        self.input_batch.remove(seq.slot)
        seq.slot = None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._drop_running(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1

    def _fail(self, seq: Sequence, message: str) -> None:
        self.finish(seq, "error", error=message)
        self._failed.append(seq)

    def _longest(self, seq: Sequence) -> int:
        """The most tokens `seq` can reach before it finishes for "length"."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
