"""Asynchronous scheduling: each step is scheduled and launched before the previous step's
tokens reach the host. Whatever the timing, a request's outputs must be those of the
synchronous engine (token ids, text, finish and stop reasons), every KV block must come back,
and a token a finished request computed past its end must never surface. On the CPU the
device is the host, so these runs check the bookkeeping (reserved tokens fed from the device,
finishing one step late, preemption and aborts in between), not the overlap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anyattn.engine.block_manager import BlockManager
from anyattn.engine.input_batch import InputBatch
from anyattn.engine.sampling_params import SamplingParams
from anyattn.engine.scheduler import ScheduledBatch, Scheduler
from anyattn.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

pytest.importorskip("transformers")

PROMPTS = [[5, 9, 17, 33, 2, 80, 41, 7, 7, 150, 3], [99], [12, 13, 14, 15, 16, 17, 18], [4, 4]]


def _summary(outputs) -> list[tuple]:
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.error,
        )
        for o in outputs
    ]


def _pair(tiny_llm, kind: str = "llama", **kwargs):
    sync, _ = tiny_llm(kind, async_scheduling=False, **kwargs)
    fast, _ = tiny_llm(kind, async_scheduling=True, **kwargs)
    return sync, fast


def _assert_drained(llm) -> None:
    bm = llm.block_manager
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_default_is_off_on_the_cpu(tiny_llm):
    llm, _ = tiny_llm("llama")
    assert llm.async_scheduling is False


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_outputs_equal_the_synchronous_engine_over_mixed_chunked_steps(tiny_llm, kind):
    # a 7-token budget chunks prompts and mixes decodes with prefills; requests end at
    # different steps, so later steps still carry a request that just finished
    sync, fast = _pair(tiny_llm, kind, max_num_batched_tokens=7)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 3, 1, 6)]
    expected = _summary(sync.generate(PROMPTS, params))
    got = _summary(fast.generate(PROMPTS, params))
    assert got == expected
    assert [len(g[0]) for g in got] == [9, 3, 1, 6]  # no token past max_tokens
    _assert_drained(fast)


def test_stops_by_token_id_string_and_eos_end_at_the_same_token(tiny_llm):
    sync, fast = _pair(tiny_llm)
    free = sync.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in free]
    word = free[1].outputs[0].text.split()[2]
    params = [
        SamplingParams(
            temperature=0, max_tokens=10, stop_token_ids=[tokens[0][3]], ignore_eos=True
        ),
        SamplingParams(temperature=0, max_tokens=10, stop=[word], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10),
    ]
    for llm in (sync, fast):  # the fourth request's first token ends it as eos
        llm.eos_token_ids = (tokens[3][0],)
    expected = _summary(sync.generate(PROMPTS, params))
    got = _summary(fast.generate(PROMPTS, params))
    assert got == expected
    assert [g[2] for g in got] == ["stop", "stop", "length", "stop"]
    assert got[0][0] == tokens[0][: tokens[0].index(tokens[0][3]) + 1]
    assert word not in got[1][1] and len(got[3][0]) == 1
    _assert_drained(fast)


def test_preemption_with_a_token_in_flight_changes_no_output(tiny_llm):
    prompts = [[3 + i, 40 + i, 7, 9, 11, 60 + i, 2] * 2 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sync, _ = tiny_llm("llama", async_scheduling=False)
    expected = _summary(sync.generate(prompts, params))
    # 14 blocks of 1536 bytes hold about two of these 26-token sequences at a time
    fast, _ = tiny_llm("llama", async_scheduling=True, kv_cache_memory=14 * 1536, max_num_seqs=6)
    assert _summary(fast.generate(prompts, params)) == expected
    assert fast.scheduler.num_preemptions > 0
    _assert_drained(fast)


def test_seeded_sampling_draws_the_same_tokens(tiny_llm):
    sync, fast = _pair(tiny_llm)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=8),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=1.3, seed=11, max_tokens=8),
        SamplingParams(temperature=0.5, top_k=3, seed=5, max_tokens=3),
    ]
    assert _summary(fast.generate(PROMPTS, params)) == _summary(sync.generate(PROMPTS, params))


def test_a_step_returns_the_previous_steps_tokens(tiny_llm):
    llm, _ = tiny_llm("llama", async_scheduling=True)
    request_id = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))
    output = llm._requests[request_id].output
    assert llm.step() == [] and output.outputs[0].token_ids == []  # the prefill is in flight
    changed = llm.step()  # launches the first decode, then returns the prefill's token
    assert changed == [output] and len(output.outputs[0].token_ids) == 1
    while llm.has_unfinished_requests():
        llm.step()
    assert output.finished and len(output.outputs[0].token_ids) == 3


def test_abort_while_a_step_is_in_flight_drops_its_token_and_frees_blocks(tiny_llm):
    llm, _ = tiny_llm("llama", async_scheduling=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kept = llm.add_request(PROMPTS[0], params)
    dropped = llm.add_request(PROMPTS[2], params)
    for _ in range(4):
        llm.step()
    tokens = list(llm._requests[dropped].output.outputs[0].token_ids)
    output = llm._requests[dropped].output
    llm.abort_request(dropped)  # its latest step is still in flight
    while llm.has_unfinished_requests():
        llm.step()
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert output.outputs[0].token_ids == tokens
    assert len(llm._requests[kept].output.outputs[0].token_ids) == 20
    llm.abort_request(kept)
    _assert_drained(llm)


def test_streaming_yields_the_same_text(tiny_llm):
    sync, fast = _pair(tiny_llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pieces = list(fast.stream("t5 t6 t7", params))
    assert len(pieces) >= 2
    assert "".join(pieces) == sync.generate("t5 t6 t7", params)[0].outputs[0].text


def test_bad_async_scheduling_is_refused(tiny_llm):
    with pytest.raises(TypeError, match="async_scheduling must be a bool or None"):
        tiny_llm("llama", async_scheduling="yes")


# --- the scheduler's two halves -------------------------------------------------------------


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _one_prefill_advanced() -> tuple[Scheduler, Sequence, ScheduledBatch]:
    """A scheduler whose one request's prefill step is launched (advanced), tokens unknown."""
    sched = Scheduler(BlockManager(32, 4), 4, 64, 64)
    seq = Sequence(0, [1, 2, 3], _greedy(4))
    sched.add(seq)
    first = sched.schedule()
    sched.advance(first, [0])
    return sched, seq, first


def test_a_reserved_token_is_scheduled_and_filled_in_place():
    sched, seq, first = _one_prefill_advanced()
    assert seq.token_ids == [1, 2, 3, PLACEHOLDER] and seq.output_token_ids == []
    arrays = sched.input_batch
    assert arrays.token_ids[seq.slot, 3] == PLACEHOLDER and arrays.num_tokens[seq.slot] == 4
    second = sched.schedule()  # before the first step's token is known
    assert second.seqs == [seq] and second.num_new_tokens == [1]
    step = arrays.gather(second.slots, np.array([1]))
    assert step.input_ids.tolist() == [PLACEHOLDER] and step.positions.tolist() == [3]
    assert sched.resolve(first, [42]) == [seq]
    assert seq.token_ids == [1, 2, 3, 42] and arrays.token_ids[seq.slot, 3] == 42
    assert sched.resolve(first, [42]) == []  # resolving twice changes nothing
    sched.advance(second, [0])
    sched.resolve(second, [43])
    assert seq.output_token_ids == [42, 43] and seq.num_computed_tokens == 4


def test_a_sequence_finished_while_its_next_step_runs_keeps_no_token():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, 4, 64, 64)
    seq = Sequence(0, [1, 2, 3], SamplingParams(temperature=0, max_tokens=5), eos_token_ids=(9,))
    sched.add(seq)
    first = sched.schedule()
    sched.advance(first, [0])
    second = sched.schedule()  # runs the token that will end the request (eos)
    assert second.seqs == [seq]
    assert sched.resolve(first, [9]) == [seq] and seq.finish_reason == "stop"
    assert bm.num_free_blocks == bm.num_usable_blocks
    sched.advance(second, [0])  # the finished sequence is left alone
    assert sched.resolve(second, [10]) == []
    assert seq.output_token_ids == [9] and seq.token_ids == [1, 2, 3, 9]


def test_a_sequence_preempted_with_a_reserved_token_resumes_with_it():
    bm = BlockManager(4, 2)  # 3 usable blocks of 2 tokens
    sched = Scheduler(bm, 2, 64, 64)
    a, b = Sequence(0, [1, 2, 3, 4], _greedy(2)), Sequence(1, [4], _greedy(3))
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first.seqs == [a, b]
    sched.advance(first, [0, 1])  # a holds 2 blocks, b 1: a's next token needs a fourth
    second = sched.schedule()
    assert second.preempted == [b] and b.status is SequenceStatus.WAITING
    assert b.token_ids == [4, PLACEHOLDER]
    filled = sched.resolve(first, [7, 8])
    assert filled == [a, b] and b.token_ids == [4, 8] and b.num_computed_tokens == 0
    sched.advance(second, [0])
    sched.resolve(second, [9])
    assert a.output_token_ids == [7, 9] and a.finish_reason == "length"
    while sched.has_unfinished():
        batch = sched.schedule()
        rows = [
            i
            for i, (s, k) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True))
            if s.num_computed_tokens + k == s.num_tokens
        ]
        sched.advance(batch, rows)
        sched.resolve(batch, [5 if i in rows else None for i in range(len(batch.seqs))])
    assert b.output_token_ids == [8, 5, 5] and b.finish_reason == "length"
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_advance_refuses_rows_that_do_not_complete():
    sched = Scheduler(BlockManager(64, 4), 8, 4, 64)
    seq = Sequence(0, [1, 2, 3, 4, 5, 6], _greedy(5))
    sched.add(seq)
    batch = sched.schedule()
    with pytest.raises(ValueError, match=r"Scheduler.advance: request 0 expected None"):
        sched.advance(batch, [0])
    assert seq.num_computed_tokens == 0 and seq.token_ids == [1, 2, 3, 4, 5, 6]


def test_reserved_input_ids_come_from_the_last_sampled_tokens(tiny_llm):
    llm, _ = tiny_llm("llama", async_scheduling=False)
    runner = llm.runner
    batch, slots = InputBatch.from_lists(
        [[3, 4, PLACEHOLDER], [6, PLACEHOLDER]], [2, 1], [[1], [2]], 4
    )
    runner.record_sampled(slots, torch.tensor([17, 23]))
    seen = []
    forward = runner.model.forward

    def spy(input_ids, *args, **kwargs):
        seen.append(input_ids.tolist())
        return forward(input_ids, *args, **kwargs)

    runner.model.forward = spy
    runner.execute(batch, slots, np.array([1, 1]))
    assert seen == [[17, 23]]


def test_a_prompt_of_max_model_len_tokens_ends_after_its_one_token(tiny_llm):
    # its reserved token reaches max_model_len: the next step must not schedule it again
    sync, fast = _pair(tiny_llm, max_model_len=12)
    prompt = list(range(3, 15))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = _summary(sync.generate([prompt, [5, 6]], params))
    assert _summary(fast.generate([prompt, [5, 6]], params)) == expected
    assert len(expected[0][0]) == 1 and expected[0][2] == "length"
    _assert_drained(fast)


def test_a_request_at_max_tokens_is_not_run_again():
    sched = Scheduler(BlockManager(32, 4), 4, 64, 64)
    ending, going = Sequence(0, [1, 2, 3], _greedy(1)), Sequence(1, [4, 5], _greedy(4))
    sched.add(ending)
    sched.add(going)
    first = sched.schedule()
    sched.advance(first, [0, 1])
    second = sched.schedule()  # `ending`'s reserved token is its last, whatever its value
    assert second.seqs == [going]
    sched.resolve(first, [7, 8])
    assert ending.finish_reason == "length" and ending.output_token_ids == [7]


def test_advancing_before_the_previous_step_is_resolved_is_refused():
    sched, seq, first = _one_prefill_advanced()
    second = sched.schedule()
    with pytest.raises(RuntimeError, match="resolve the previous step"):
        sched.advance(second, [0])
    assert seq.num_computed_tokens == 3 and seq.token_ids == [1, 2, 3, PLACEHOLDER]
    sched.resolve(first, [9])
    sched.advance(second, [0])
    sched.resolve(second, [10])
    assert seq.output_token_ids == [9, 10]


@pytest.mark.parametrize("seed, budget, max_num_seqs, num_blocks", [(1, 7, 3, 30), (2, 16, 5, 14)])
def test_random_aborts_and_late_requests_change_no_output(
    tiny_llm, seed, budget, max_num_seqs, num_blocks
):
    """Tight limits (chunked prefills; 14 blocks also preempt), requests aborted and added
    between steps at random: every request that runs to its end has the synchronous engine's
    tokens, an aborted one a prefix of them, and every block comes back."""
    rng = np.random.default_rng(seed)
    # 4-token blocks of 1536 bytes (see test_llm's pressure test)
    limits = dict(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, kv_cache_memory=num_blocks * 1536
    )
    sync, fast = _pair(tiny_llm, **limits)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = {tuple(p): sync.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS}
    prompts = {fast.add_request(p, params): p for p in PROMPTS * 2}
    outputs = {i: fast._requests[i].output for i in prompts}
    aborted = set()
    while fast.has_unfinished_requests():
        fast.step()
        live = [i for i in prompts if i not in aborted and not outputs[i].finished]
        if live and rng.random() < 0.25:
            victim = int(rng.choice(live))
            aborted.add(victim)
            fast.abort_request(victim)
        if rng.random() < 0.2:
            prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
            new = fast.add_request(prompt, params)
            prompts[new], outputs[new] = prompt, fast._requests[new].output
    for request_id, prompt in prompts.items():
        got, want = outputs[request_id].outputs[0].token_ids, expected[tuple(prompt)]
        if request_id in aborted:
            assert got == want[: len(got)]
        else:
            assert got == want and outputs[request_id].outputs[0].finish_reason == "length"
    assert fast.scheduler.num_preemptions > 0 or num_blocks > 14
    _assert_drained(fast)
