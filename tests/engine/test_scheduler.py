"""Scheduler: exact schedules, stop rules, preemption, failures, and random mixes (hypothesis).

A fake "model" drives the scheduler: every step it writes each new token's id into a paged
fake KV cache at its slot (from the block table), then for each sequence that completed its known
tokens it reads the whole context back from the cache and derives the next token from it. A
wrong block table, a bad prefix hit or a block owned twice therefore changes the outputs, which
must equal those of a run with a pool and budget so large that nothing is ever preempted.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from anyattn.engine.block_manager import NULL_BLOCK, BlockManager
from anyattn.engine.sampling_params import SamplingParams
from anyattn.engine.scheduler import ScheduledBatch, Scheduler
from anyattn.engine.sequence import Sequence, SequenceStatus

VOCAB = 50
EOS = 0


def fake_next_token(context: list[int]) -> int:
    h = 0
    for token in context:
        h = (h * 1_000_003 + token + 1) % 2_147_483_647
    return h % VOCAB


@dataclass
class Run:
    seqs: list[Sequence]
    steps: list[list[tuple[int, int]]]  # per step: (request_id, num_new_tokens)
    batches: list[ScheduledBatch]
    bm: BlockManager
    sched: Scheduler

    @property
    def outputs(self) -> dict[int, list[int]]:
        return {s.request_id: s.output_token_ids for s in self.seqs if s.finish_reason != "error"}


def check_invariants(sched: Scheduler, batch: ScheduledBatch) -> None:
    bm = sched.block_manager
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    assert all(n > 0 for n in batch.num_new_tokens)
    assert len({id(s) for s in batch.seqs}) == len(batch.seqs)
    owners: dict[int, int] = {}
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert NULL_BLOCK not in seq.block_table
        assert len(set(seq.block_table)) == len(seq.block_table)
        for block_id in seq.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.block_table == []
    for block_id in range(bm.num_blocks):
        assert bm.ref_count(block_id) == owners.get(block_id, 0), block_id
        if owners.get(block_id, 0) > 1:  # only cached full blocks are shared
            assert bm.block_hash(block_id) is not None
    assert bm.num_free_blocks + len(owners) == bm.num_usable_blocks
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert seq in sched.running
        assert seq.num_computed_tokens + n <= seq.num_tokens
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
        if not sched.enable_chunked_prefill:
            assert seq.num_computed_tokens + n == seq.num_tokens
    check_input_batch(sched, batch)


def check_input_batch(sched: Scheduler, batch: ScheduledBatch) -> None:
    """The per-slot arrays mirror every running sequence exactly; other rows are clear."""
    ib = sched.input_batch
    assert batch.slots.tolist() == [s.slot for s in batch.seqs]
    slots = [seq.slot for seq in sched.running]
    assert len(set(slots)) == len(slots) and None not in slots
    for seq in sched.running:
        row = seq.slot
        assert ib.num_tokens[row] == seq.num_tokens
        assert ib.token_ids[row, : seq.num_tokens].tolist() == seq.token_ids
        assert ib.num_computed[row] == seq.num_computed_tokens
        assert ib.num_blocks[row] == len(seq.block_table)
        assert ib.block_table[row, : len(seq.block_table)].tolist() == seq.block_table
        assert not ib.block_table[row, len(seq.block_table) :].any()
    for row in set(range(ib.max_num_reqs)) - set(slots):
        assert ib.num_tokens[row] == ib.num_computed[row] == ib.num_blocks[row] == 0
        assert not ib.block_table[row].any()


def run(
    requests: list[tuple[list[int], SamplingParams]],
    *,
    num_blocks: int = 1000,
    block_size: int = 4,
    max_num_seqs: int = 64,
    budget: int = 4096,
    max_model_len: int = 1024,
    chunked: bool = True,
    prefix_caching: bool = True,
    arrivals: list[int] | None = None,
) -> Run:
    """Run requests to the end; request i is added before step `arrivals[i]` (default 0)."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len, enable_chunked_prefill=chunked)
    seqs = [Sequence(i, p, params, (EOS,)) for i, (p, params) in enumerate(requests)]
    pending = sorted(zip(arrivals or [0] * len(seqs), range(len(seqs)), strict=True))
    kv = [-1] * (num_blocks * block_size)

    def slot(seq: Sequence, position: int) -> int:
        return seq.block_table[position // block_size] * block_size + position % block_size

    result = Run(seqs, [], [], bm, sched)
    while pending or sched.has_unfinished():
        assert len(result.steps) < 20_000, "no progress"
        while pending and pending[0][0] <= len(result.steps):
            sched.add(seqs[pending.pop(0)[1]])
        batch = sched.schedule()
        check_invariants(sched, batch)
        sampled: list[int | None] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            for position in range(start, start + n):
                kv[slot(seq, position)] = seq.token_ids[position]
            if start + n < seq.num_tokens:
                sampled.append(None)
                continue
            context = [kv[slot(seq, p)] for p in range(seq.num_tokens)]
            assert context == seq.token_ids, "the cache does not hold the sequence's tokens"
            sampled.append(fake_next_token(context))
        ids = [s.request_id for s in batch.seqs]
        result.steps.append(list(zip(ids, batch.num_new_tokens, strict=True)))
        result.batches.append(batch)
        finished = sched.update(batch, sampled)
        assert all(s.is_finished and s.block_table == [] for s in finished)
    assert all(s.is_finished for s in seqs)
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(bm.ref_count(b) == 0 for b in range(num_blocks))
    return result


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)  # type: ignore[arg-type]


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7 + 3 * i) % (VOCAB - 1) + 1 for i in range(length)]  # no EOS inside


def test_constructor_validation() -> None:
    bm = BlockManager(8, 4)
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1"):
        Scheduler(bm, 0, 16, 16)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_model_len"):
        Scheduler(bm, 4, 8, 16, enable_chunked_prefill=False)


def test_chunked_prefill_with_budget_of_7_exact_schedule() -> None:
    params = greedy(3, ignore_eos=True)
    requests = [(prompt(1, 10), params), (prompt(2, 5), params)]
    chunked = run(requests, budget=7)
    assert chunked.steps[:4] == [
        [(0, 7)],  # A's first chunk takes the whole budget
        [(0, 3), (1, 4)],  # A finishes its prompt, B starts with what is left
        [(0, 1), (1, 1)],  # A decodes; B has one prompt token left: a 1-token step
        [(0, 1), (1, 1)],
    ]
    assert all(sum(n for _, n in step) <= 7 for step in chunked.steps)
    whole = run(requests, budget=4096)
    assert whole.steps[0] == [(0, 10), (1, 5)]
    assert chunked.outputs == whole.outputs
    assert all(len(out) == 3 for out in whole.outputs.values())


def test_chunking_off_schedules_prompts_whole() -> None:
    requests = [(prompt(i, 9), greedy(2, ignore_eos=True)) for i in range(3)]
    result = run(requests, budget=16, max_model_len=16, chunked=False)
    assert result.steps[0] == [(0, 9)]  # 9 + 9 > 16: the second prompt waits
    assert result.steps[1] == [(0, 1), (1, 9)]
    assert result.outputs == run(requests).outputs


def test_fcfs_and_max_num_seqs_cap() -> None:
    requests = [(prompt(i, 3 + i), greedy(2 + (i % 3), ignore_eos=True)) for i in range(6)]
    result = run(requests, max_num_seqs=2)
    first_step = {}
    for index, step in enumerate(result.steps):
        assert len(step) <= 2
        for rid, _ in step:
            first_step.setdefault(rid, index)
    assert list(first_step) == list(range(6))  # admitted in arrival order
    assert first_step[2] > first_step[1]  # had to wait for a free slot
    assert result.outputs == run(requests).outputs


def test_stop_rules() -> None:
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, max_model_len=12)
    cases = {
        "eos": Sequence(0, [1, 2], greedy(10), (EOS,)),
        "eos_ignored": Sequence(1, [1, 2], greedy(2, ignore_eos=True), (EOS,)),
        "stop_id": Sequence(2, [1, 2], greedy(10, stop_token_ids=[7]), (EOS,)),
        "model_len": Sequence(3, list(range(1, 11)), greedy(10), (EOS,)),
    }
    for seq in cases.values():
        sched.add(seq)
    batch = sched.schedule()
    assert [s.request_id for s in batch.seqs] == [0, 1, 2, 3]
    finished = sched.update(batch, [EOS, EOS, 7, 5])
    assert finished == [cases["eos"], cases["stop_id"]]
    assert (cases["eos"].finish_reason, cases["eos"].stop_reason) == ("stop", None)
    assert (cases["stop_id"].finish_reason, cases["stop_id"].stop_reason) == ("stop", 7)
    assert cases["eos"].output_token_ids == [EOS]  # the stop token is kept
    batch = sched.schedule()
    assert batch.num_new_tokens == [1, 1]
    finished = sched.update(batch, [EOS, 5])
    # max_tokens 2 reached; 12 tokens = max_model_len reached.
    assert [s.finish_reason for s in finished] == ["length", "length"]
    assert cases["model_len"].num_tokens == 12
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_finish_for_stop_strings_and_aborts() -> None:
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64, 64)
    a, b, c = (Sequence(i, [1, 2, 3], greedy(5), (EOS,)) for i in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    batch = sched.schedule()
    sched.update(batch, [4, 4, 4])
    sched.finish(a, "stop", stop_reason="###")
    assert a.finish_reason == "stop" and a.stop_reason == "###" and a.block_table == []
    batch = sched.schedule()
    assert batch.seqs == [b, c]
    sched.finish(b, "abort")  # between schedule and update: update skips it
    assert sched.update(batch, [5, EOS]) == [c]
    assert b.output_token_ids == [4] and c.finish_reason == "stop"
    sched.finish(c, "stop", stop_reason="!")  # already finished: only the reason changes
    assert c.stop_reason == "!"
    with pytest.raises(ValueError, match="reason must be one of"):
        sched.finish(c, "done")
    assert bm.num_free_blocks == bm.num_usable_blocks and not sched.has_unfinished()


def test_update_rejects_mismatched_samples() -> None:
    sched = Scheduler(BlockManager(64, 4), 8, 4, 64)
    seq = Sequence(0, [1, 2, 3, 4, 5, 6], greedy(5))
    sched.add(seq)
    batch = sched.schedule()
    assert batch.num_new_tokens == [4]
    with pytest.raises(ValueError, match="expected None"):
        sched.update(batch, [3])
    with pytest.raises(ValueError, match="one per scheduled sequence"):
        sched.update(batch, [])
    sched.update(batch, [None])
    batch = sched.schedule()
    with pytest.raises(ValueError, match="expected a token"):
        sched.update(batch, [None])
    with pytest.raises(ValueError, match="is not new"):
        sched.add(seq)


def test_preemption_by_recompute_under_a_tiny_pool() -> None:
    # 4 usable blocks of 2 tokens: two sequences of 3 + 4 tokens cannot both stay.
    requests = [(prompt(i, 3), greedy(4, ignore_eos=True)) for i in range(2)]
    for prefix_caching in (True, False):
        tight = run(requests, num_blocks=5, block_size=2, prefix_caching=prefix_caching)
        preempted = [s.request_id for b in tight.batches for s in b.preempted]
        assert preempted == [1]  # the most recently admitted one
        assert tight.sched.num_preemptions == 1
        assert all(s.finish_reason == "length" for s in tight.seqs)
        assert tight.outputs == run(requests).outputs
        # Once resumed it recomputes its prompt and the token it had generated.
        resumed = next(i for i, b in enumerate(tight.batches) if b.preempted) + 1
        resume_step = next(
            step for step in tight.steps[resumed:] if any(rid == 1 for rid, _ in step)
        )
        (n,) = [n for rid, n in resume_step if rid == 1]
        cached = tight.seqs[1].num_cached_tokens
        assert n + cached == 3 + 2 and (cached > 0) == prefix_caching


def test_prefix_caching_reuses_blocks_and_changes_no_output() -> None:
    shared = prompt(9, 12)
    requests = [([*shared, 40 + i], greedy(3, ignore_eos=True)) for i in range(3)]
    # One at a time, so the later requests find the first one's blocks in the cache.
    cached = run(requests, max_num_seqs=1)
    assert cached.bm.num_cached_blocks_reused == 2 * 3
    assert [s.num_cached_tokens for s in cached.seqs] == [0, 12, 12]
    uncached = run(requests, max_num_seqs=1, prefix_caching=False)
    assert uncached.bm.num_cached_blocks_reused == 0
    assert cached.outputs == uncached.outputs


def test_over_long_prompt_fails_while_others_finish() -> None:
    requests = [
        (prompt(1, 5), greedy(3)),
        (prompt(2, 40), greedy(3)),
        ([], greedy(3)),
        (prompt(3, 6), greedy(3)),
    ]
    result = run(requests, max_model_len=32)
    assert [s.request_id for s in result.batches[0].failed] == [1, 2]
    long, empty = result.seqs[1], result.seqs[2]
    assert long.finish_reason == "error" and long.output_token_ids == []
    assert "prompt of 40 tokens, longer than max_model_len 32" in (long.error or "")
    assert "empty prompt" in (empty.error or "")
    assert all(result.seqs[i].finish_reason in ("stop", "length") for i in (0, 3))
    alone = run([requests[0], requests[3]]).outputs
    assert result.outputs == {0: alone[0], 3: alone[1]}


def test_request_that_can_never_fit_fails_at_once_while_others_finish() -> None:
    # 3 usable blocks of 2 tokens = 6 slots.
    huge = (prompt(1, 7), greedy(3))  # its prompt alone needs 4 blocks
    grows = (prompt(2, 4), greedy(10, ignore_eos=True))  # 4 + 10 tokens would need 7 blocks
    small = (prompt(3, 1), greedy(2, ignore_eos=True))
    result = run([huge, grows, small], num_blocks=4, block_size=2)
    # rejected before taking a block or running a step: nothing was computed for them
    assert [s.request_id for s in result.batches[0].failed] == [0, 1]
    assert all(s.request_id == 2 for b in result.batches for s in b.seqs)
    assert "may grow to 10 tokens (prompt 7 + max_tokens 3), which need 5 KV blocks of 2 " in (
        result.seqs[0].error or ""
    )
    grown = result.seqs[1]
    assert grown.finish_reason == "error" and grown.output_token_ids == []
    assert grown.error == (
        "request 1 may grow to 14 tokens (prompt 4 + max_tokens 10), which need 7 KV blocks of 2 "
        "tokens, but the pool has only 3: it could never finish, even alone. Lower max_tokens, "
        "shorten the prompt, or give the KV cache more memory."
    )
    assert result.seqs[2].finish_reason == "length"
    assert result.outputs[2] == run([small]).outputs[0]
    # max_model_len caps the growth: 3 + 100 tokens stop at 6, which fit
    capped = run([(prompt(4, 3), greedy(100, ignore_eos=True))], num_blocks=4, block_size=2,
                 max_model_len=6)  # fmt: skip
    assert capped.seqs[0].finish_reason == "length" and capped.seqs[0].num_tokens == 6
    over = run([(prompt(4, 3), greedy(100, ignore_eos=True))], num_blocks=4, block_size=2,
               max_model_len=7)  # fmt: skip
    assert "may grow to 7 tokens (max_model_len) (prompt 3" in (over.seqs[0].error or "")


@st.composite
def request_mixes(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_model_len = draw(st.integers(8, 64))
    num_reqs = draw(st.integers(1, 8))
    # A shared prefix so that prefix caching has something to find.
    shared = draw(st.lists(st.integers(1, VOCAB - 1), min_size=4, max_size=24))
    requests = []
    for _ in range(num_reqs):
        # Mostly short prompts; now and then an empty one or one longer than max_model_len.
        is_odd = draw(st.integers(0, 9)) == 0
        own_len = draw(st.integers(0, max_model_len + 4) if is_odd else st.integers(1, 8))
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=own_len, max_size=own_len))
        cut = draw(st.sampled_from([len(shared), len(shared) // 2, 0]))
        params = SamplingParams(
            temperature=0,
            max_tokens=draw(st.integers(1, 12)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        )
        requests.append(([*shared[:cut], *own], params))
    arrivals = draw(st.lists(st.integers(0, 30), min_size=num_reqs, max_size=num_reqs))
    chunked = draw(st.booleans())
    pool_tokens = draw(st.integers(4, 128))
    return {
        "requests": requests,
        "block_size": block_size,
        "num_blocks": 1 + max(1, pool_tokens // block_size),
        "max_num_seqs": draw(st.integers(1, 6)),
        "budget": draw(st.integers(1, 48)) if chunked else draw(st.integers(64, 96)),
        "max_model_len": max_model_len,
        "chunked": chunked,
        "prefix_caching": draw(st.integers(0, 3)) > 0,
        "arrivals": arrivals,
    }


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request_mixes())
def test_random_mixes_terminate_with_invariants_and_unpressured_outputs(mix: dict) -> None:
    result = run(**mix)  # asserts invariants every step, termination and an empty pool at the end
    reference = run(mix["requests"], max_model_len=mix["max_model_len"])
    bm = result.bm
    # Coverage notes, shown by --hypothesis-show-statistics.
    event(f"preemptions: {min(result.sched.num_preemptions, 3)}+")
    event(f"errors: {sum(s.finish_reason == 'error' for s in result.seqs)}")
    event(f"prefix hits: {bm.num_cached_blocks_reused > 0}, evictions: {bm.num_evictions > 0}")
    for seq, ref in zip(result.seqs, reference.seqs, strict=True):
        if seq.finish_reason == "error" and ref.finish_reason != "error":
            # Only a pool too small for the sequence alone may fail it, and then at once.
            longest = min(seq.num_prompt_tokens + seq.params.max_tokens, mix["max_model_len"])
            assert bm.num_blocks_for(longest) > bm.num_usable_blocks, seq.error
            assert seq.output_token_ids == []
        else:
            assert seq.output_token_ids == ref.output_token_ids
            assert (seq.finish_reason, seq.stop_reason) == (ref.finish_reason, ref.stop_reason)


def test_a_chunked_prompt_of_max_model_len_tokens_runs_to_its_one_token() -> None:
    # its length is the limit from the start: the last prompt token must still run and sample
    result = run([(prompt(0, 15), greedy(1))], block_size=1, budget=9, max_model_len=15)
    assert [n for step in result.steps for _, n in step] == [9, 6]
    assert len(result.seqs[0].output_token_ids) == 1
    assert result.seqs[0].finish_reason == "length"
