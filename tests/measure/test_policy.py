"""The measured-selection policy with chosen timings: each backend wins in turn, ties within
2% or the run's noise go to the static order, rejected backends never win."""

from __future__ import annotations

import dataclasses
import time

import pytest

from anyattn.config import AttentionSelectorConfig, BatchLimits
from anyattn.measure import Measurement, MeasureStep, Phase, StepTiming, choose
from anyattn.registry import get_backend_class
from anyattn.selector import measure_backends, priority_list, select_backend
from anyattn.types import DeviceInfo

CONFIG = AttentionSelectorConfig(head_size=64, dtype="float32", num_heads=4, num_kv_heads=2)
LIMITS = BatchLimits(4, 32, 64)


def fake_timer(table: dict[tuple[str, str], float], noise: float = 0.0):
    """A timer giving `table[(backend, phase)]` microseconds per step, +-noise around it."""
    calls: list[tuple[str, str]] = []

    def timer(backend, step):
        calls.append((backend.get_name(), step.name))
        base = table[(backend.get_name(), step.phase.value)]
        times = (base - noise, base, base + noise)
        return StepTiming(step.name, times, first_call_us=10 * base, build_us=1.0)

    timer.calls = calls  # type: ignore[attr-defined]
    return timer


def passes(backend):
    return None


@pytest.fixture
def three(register, make_backend):
    """TORCH, FLEX_ATTENTION and a fake third backend ranked last on the CPU."""
    register("THIRD", make_backend("THIRD", priority={"cpu": 50}))
    wanted = ("TORCH", "FLEX_ATTENTION", "THIRD")
    order = [n for n in priority_list(DeviceInfo.cpu()) if n in wanted]
    assert order == ["TORCH", "FLEX_ATTENTION", "THIRD"]
    return order


def timings_where(winner: dict[str, str], order: list[str]) -> dict[tuple[str, str], float]:
    """Per phase, `winner[phase]` takes 100 us a step and every other backend 200 us."""
    return {
        (name, phase.value): 100.0 if winner[phase.value] == name else 200.0
        for name in order
        for phase in Phase
    }


@pytest.mark.parametrize("rotation", range(3))
def test_each_backend_wins_its_phase_in_turn(three, rotation):
    order = three
    winner = {p.value: order[(i + rotation) % 3] for i, p in enumerate(Phase)}
    timer = fake_timer(timings_where(winner, order))
    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=passes)
    assert measured.order == tuple(order)
    for phase in Phase:
        assert measured.choice(phase) == winner[phase.value]
    # Every fitting backend was timed on every step, once.
    steps = [s.name for s in measured.steps]
    assert sorted(timer.calls) == sorted((b, s) for b in order for s in steps)
    # Overall: 4 decode steps outweigh the prefill and the mixed step.
    assert measured.overall == winner["decode"]
    assert measured.first_calls_s(order[0]) > 0


def test_oracle_checks_are_reported_apart_from_timing(three):
    # The checks (where kernels compile) take 50 ms each here, the fake timings nothing.
    def slow_check(backend):
        time.sleep(0.05)

    timer = fake_timer(timings_where(dict.fromkeys((p.value for p in Phase), three[0]), three))
    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=slow_check)
    assert measured.check_s >= 0.15 > measured.timing_s
    assert measured.to_dict()["check_s"] == measured.check_s


@pytest.mark.parametrize("winner", ["TORCH", "FLEX_ATTENTION", "THIRD"])
def test_select_backend_fastest_returns_the_overall_winner(three, winner, monkeypatch):
    table = timings_where(dict.fromkeys((p.value for p in Phase), winner), three)
    timer = fake_timer(table)
    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=passes)
    assert measured.overall == winner
    # select_backend reads the same (cached) measurement: no new timing.
    chosen = select_backend(CONFIG, "cpu", policy="fastest", limits=LIMITS)
    assert chosen.get_name() == winner
    assert select_backend(CONFIG, "cpu", "fastest", limits=LIMITS).get_name() == winner
    monkeypatch.setenv("ANYATTN_BACKEND", "fastest")
    assert select_backend(CONFIG, "cpu", limits=LIMITS).get_name() == winner
    assert select_backend(CONFIG, "cpu").get_name() == "TORCH"  # no limits: static order


def test_within_two_percent_the_static_order_decides(three):
    table = {(n, p.value): 100.0 for n in three for p in Phase}
    table[("FLEX_ATTENTION", "prefill")] = 98.5  # 1.5% faster: a tie, TORCH comes first
    table[("THIRD", "mixed")] = 97.0  # 3% faster: a win
    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=fake_timer(table), checker=passes)
    prefill = measured.choices["prefill"]
    assert (prefill.backend, prefill.fastest) == ("TORCH", "FLEX_ATTENTION")
    assert prefill.tied == ("TORCH", "FLEX_ATTENTION", "THIRD")
    assert measured.choice("mixed") == "THIRD"
    assert measured.choices["mixed"].tied == ("THIRD",)


def test_within_the_measured_noise_the_static_order_decides(three):
    table = {(n, p.value): 100.0 for n in three for p in Phase}
    table[("THIRD", "decode")] = 90.0  # 10% faster, but each call varies by +-8 us
    noisy = measure_backends(CONFIG, LIMITS, "cpu", timer=fake_timer(table, 8.0), checker=passes)
    assert noisy.choice("decode") == "TORCH"
    assert noisy.choices["decode"].fastest == "THIRD"
    quiet = measure_backends(
        CONFIG, LIMITS, "cpu", timer=fake_timer(table, 1.0), checker=passes, use_cache=False
    )
    assert quiet.choice("decode") == "THIRD"


def test_a_backend_failing_the_oracle_or_raising_is_never_chosen(three):
    table = timings_where(dict.fromkeys((p.value for p in Phase), "THIRD"), three)
    timer = fake_timer(table)

    def checker(backend):
        return "error above bound" if backend.get_name() == "THIRD" else None

    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=checker)
    assert measured.rejected == {"THIRD": "oracle check failed: error above bound"}
    assert "THIRD" not in {b for b, _ in timer.calls}
    assert measured.overall == "TORCH"

    def raising(backend, step):
        if backend.get_name() == "TORCH" and step.phase is Phase.PREFILL:
            raise RuntimeError("out of memory")
        return timer(backend, step)

    again = measure_backends(CONFIG, LIMITS, "cpu", timer=raising, checker=checker, use_cache=False)
    assert again.rejected["TORCH"].endswith("raised RuntimeError: out of memory")
    assert again.overall == "FLEX_ATTENTION"


def test_choose_skips_phases_without_steps_and_backends_without_every_step():
    timing = StepTiming("s", (5.0,), 5.0, 1.0)
    steps = [MeasureStep("s", Phase.DECODE, (1,), (2,))]
    choices = choose(steps, ["A", "B"], {"A": {}, "B": {"s": timing}})
    assert set(choices) == {"decode", "overall"}
    assert choices["decode"].backend == "B" and choices["decode"].totals_us == {"B": 5.0}


def _split_kv_shape(cls, num_blocks, block_size, num_kv_heads, head_size, cache_dtype="auto"):
    return (2, num_blocks, block_size, num_kv_heads, head_size)  # K and V outermost


def test_phase_choices_that_cannot_share_a_kv_cache_say_why(register, make_backend):
    torch_backend = get_backend_class("TORCH")
    # TORCH's layouts, but K and V in the outermost dimension.
    fake = make_backend(
        "SPLIT_KV",
        priority={"cpu": 50},
        supported_kv_cache_layouts=torch_backend.supported_kv_cache_layouts,
        get_kv_cache_stride_order=torch_backend.get_kv_cache_stride_order,
        get_kv_cache_shape=classmethod(_split_kv_shape),
    )
    register("SPLIT_KV", fake)
    table = {("TORCH", p.value): 100.0 for p in Phase}
    table |= {("FLEX_ATTENTION", p.value): 300.0 for p in Phase}
    table |= {("SPLIT_KV", p.value): 300.0 for p in Phase}
    table[("SPLIT_KV", "prefill")] = 10.0
    config = CONFIG.replace(block_size=32)
    measured = measure_backends(config, LIMITS, "cpu", timer=fake_timer(table), checker=passes)
    assert (measured.choice("decode"), measured.choice("prefill")) == ("TORCH", "SPLIT_KV")
    assert not measured.kv_cache_shared and measured.phase_pair is None
    assert measured.kv_cache_note == (
        "KV cache shared by TORCH and SPLIT_KV: the logical cache shapes differ for 8 blocks of "
        "32 tokens, num_kv_heads 2, head_size 64 (TORCH: (8, 2, 32, 2, 64) in order "
        "(0, 1, 3, 2, 4); SPLIT_KV: (2, 8, 32, 2, 64) in order (0, 1, 3, 2, 4))."
    )
    assert measured.pair_note() == (
        "one backend, TORCH (overall), for every step: TORCH (decode) and SPLIT_KV (prefill) "
        f"cannot share one KV cache ({measured.kv_cache_note})"
    )
    one = measure_backends(
        CONFIG, LIMITS, "cpu", timer=fake_timer(table | {("SPLIT_KV", "prefill"): 300.0}),
        checker=passes, use_cache=False,
    )  # fmt: skip
    assert one.kv_cache_shared and one.kv_cache_note == "one backend for every phase"
    assert one.pair_note() == (
        "one backend, TORCH (overall), for every step: decode and prefill both chose TORCH"
    )


def test_phase_choices_that_share_a_kv_cache_make_a_pair(three):
    table = {("TORCH", p.value): 100.0 for p in Phase}
    table |= {("FLEX_ATTENTION", p.value): 300.0 for p in Phase} | {
        ("THIRD", p.value): 900.0 for p in Phase
    }
    table[("FLEX_ATTENTION", "prefill")] = table[("FLEX_ATTENTION", "mixed")] = 10.0
    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=fake_timer(table), checker=passes)
    assert measured.kv_cache_shared and measured.phase_pair == ("TORCH", "FLEX_ATTENTION")
    # TORCH (the decode choice) prefers HND, which FLEX_ATTENTION also takes
    note = "TORCH and FLEX_ATTENTION share one cache: kernel block 16, layout HND, cache dtype auto"
    assert measured.kv_cache_note == note
    assert measured.pair_note() == (
        "per-phase pair used: decodes on TORCH, prefills (and the prefill rows of mixed steps) "
        f"on FLEX_ATTENTION; {note}"
    )
    again = Measurement.from_dict(measured.to_dict())
    assert again.phase_pair == measured.phase_pair and again.to_dict()["engine"] == (
        measured.pair_note()
    )
    mla = dataclasses.replace(measured, is_mla=True)
    assert mla.phase_pair is None and mla.pair_note().endswith(
        "the engine runs MLA layers on one backend for every phase"
    )


def test_a_pair_runs_only_when_it_clearly_beats_the_overall_choice(three):
    # FLEX_ATTENTION prefills 10x faster, but its mixed step is slow: under a pair a mixed step
    # runs both backends (counted as both whole steps), so the pair is predicted to lose.
    table = {("TORCH", p.value): 100.0 for p in Phase}
    table |= {("FLEX_ATTENTION", p.value): 300.0 for p in Phase} | {
        ("THIRD", p.value): 900.0 for p in Phase
    }
    table[("FLEX_ATTENTION", "prefill")] = 10.0
    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=fake_timer(table), checker=passes)
    assert measured.choice("decode") == "TORCH" and measured.choice("prefill") == "FLEX_ATTENTION"
    assert measured.kv_cache_shared and measured.phase_pair is None
    decodes = sum(s.phase is Phase.DECODE for s in measured.steps)
    pair_us, overall_us = decodes * 100 + 10 + (100 + 300), (decodes + 2) * 100
    assert measured.pair_note() == (
        "one backend, TORCH (overall), for every step: the pair TORCH (decode) + FLEX_ATTENTION "
        f"(prefill) is predicted at {pair_us} us over the steps (a mixed step counted as both "
        f"backends' step) against {overall_us} us, not a clear gain"
    )


@pytest.mark.parametrize(("layers_per_step", "winner"), [(None, "FLEX_ATTENTION"),
                         (1, "TORCH"), (100, "FLEX_ATTENTION")])  # fmt: skip
def test_each_steps_build_is_shared_by_the_layers_that_use_it(three, layers_per_step, winner):
    # FLEX_ATTENTION's calls take 90 us against TORCH's 100, its build 500 us against 1: alone
    # a layer call pays the whole build; an engine of 100 such layers pays 5 us of it per call.
    def timer(backend, step):
        name = backend.get_name()
        base, build = {"TORCH": (100.0, 1.0), "FLEX_ATTENTION": (90.0, 500.0)}.get(name, (900, 1))
        return StepTiming(step.name, (base,), first_call_us=base, build_us=build)

    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=passes,
                                layers_per_step=layers_per_step)  # fmt: skip
    assert measured.overall == winner
    assert Measurement.from_dict(measured.to_dict()).overall == winner


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_a_bad_layers_per_step_is_refused_before_any_timing(three, bad):
    timer = fake_timer({(n, p.value): 100.0 for n in three for p in Phase})
    with pytest.raises(
        ValueError, match=rf"layers_per_step must be None or an int >= 1 \(got {bad!r}\)"
    ):
        measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=passes, layers_per_step=bad)
    assert timer.calls == []


def test_a_pair_needs_every_step_timed(three):
    # A stored result whose prefill choice lacks its mixed step: no pair, and the note says why.
    table = {("TORCH", p.value): 100.0 for p in Phase}
    table |= {("FLEX_ATTENTION", p.value): 10.0 for p in Phase} | {
        ("THIRD", p.value): 900.0 for p in Phase
    }
    table |= {("FLEX_ATTENTION", "decode"): 300.0}
    measured = measure_backends(CONFIG, LIMITS, "cpu", timer=fake_timer(table), checker=passes)
    assert measured.phase_pair == ("TORCH", "FLEX_ATTENTION")
    data = measured.to_dict()
    data["timings"]["FLEX_ATTENTION"] = [
        t for t in data["timings"]["FLEX_ATTENTION"] if not t["step"].startswith("mixed")
    ]
    partial = Measurement.from_dict(data)
    assert partial.phase_pair is None
    assert partial.pair_note().endswith("not every step was timed on TORCH, FLEX_ATTENTION")


def test_a_cached_measurement_judges_cache_sharing_for_the_choices_made_now(three):
    # FLEX_ATTENTION's calls are faster everywhere, but its decode build is 500 us: alone it
    # wins both phases; over one layer per build TORCH takes the decodes. The cached entry of
    # the first call must not carry its "one backend" sharing note into the second.
    def timer(backend, step):
        name = backend.get_name()
        if name == "FLEX_ATTENTION":
            base, build = (90.0, 500.0) if step.phase is Phase.DECODE else (10.0, 1.0)
        else:
            base, build = (100.0, 1.0) if name == "TORCH" else (900.0, 1.0)
        return StepTiming(step.name, (base,), first_call_us=base, build_us=build)

    alone = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=passes)
    assert alone.kv_cache_note == "one backend for every phase"
    cached = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=passes,
                              layers_per_step=1)  # fmt: skip
    fresh = measure_backends(CONFIG, LIMITS, "cpu", timer=timer, checker=passes,
                             layers_per_step=1, use_cache=False)  # fmt: skip
    assert cached.from_cache and (cached.choice("decode"), cached.choice("prefill")) == (
        "TORCH", "FLEX_ATTENTION"
    )  # fmt: skip
    assert (cached.kv_cache_shared, cached.kv_cache_note) == (
        fresh.kv_cache_shared, fresh.kv_cache_note
    )  # fmt: skip
    assert cached.kv_cache_note.startswith("TORCH and FLEX_ATTENTION share one cache")
    assert cached.pair_note() == fresh.pair_note()
