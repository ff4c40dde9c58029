"""Pipeline schedule tables: pure Python, no devices, no jax."""

from collections import Counter

import numpy as np
import pytest

from mlm_jax.pipeline import lockstep
from mlm_jax.pipeline.schedules import (
    IDLE,
    Action,
    ScheduleError,
    build_schedule,
    gpipe,
    ideal_idle_fraction,
    ideal_ticks,
    idle_fraction,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    render,
    to_arrays,
    validate_schedule,
)

FLAT_CASES = [(P, m) for P in range(1, 7) for m in range(1, 13)]
INTERLEAVED_CASES = [(P, k * P, V) for P in range(2, 6) for k in (1, 2, 3) for V in (2, 3, 4)]
ALL_CASES = [("gpipe", P, m, 1) for P, m in FLAT_CASES]
ALL_CASES += [("1f1b", P, m, 1) for P, m in FLAT_CASES]
ALL_CASES += [("interleaved", P, m, V) for P, m, V in INTERLEAVED_CASES]


def _program_order(table, stage):
    """The non-idle actions of one stage, in tick order."""
    return [row[stage] for row in table if not row[stage].is_idle]


@pytest.mark.parametrize("name,P,m,V", ALL_CASES)
def test_tables_are_valid_and_hit_the_bubble_formula(name, P, m, V):
    table = build_schedule(name, P, m, V)
    validate_schedule(table, P, m, V)
    assert all(len(row) == P for row in table)
    # Every (microbatch, chunk) forward and backward exactly once on every stage, counted
    # independently of validate_schedule.
    for stage in range(P):
        counts = Counter((a.kind, a.microbatch, a.chunk) for a in _program_order(table, stage))
        expected = {(k, mb, c): 1 for k in "FB" for mb in range(m) for c in range(V)}
        assert dict(counts) == expected
    assert len(table) == ideal_ticks(P, m, V) == 2 * (m * V + P - 1)
    idle_slots = sum(a.is_idle for row in table for a in row)
    assert idle_slots == 2 * P * (P - 1)
    # Every stage idles exactly 2*(P-1) ticks: the bubble is spread evenly.
    for stage in range(P):
        assert sum(row[stage].is_idle for row in table) == 2 * (P - 1)
    assert idle_fraction(table) == pytest.approx((P - 1) / (m * V + P - 1))
    assert idle_fraction(table) == pytest.approx(ideal_idle_fraction(P, m, V))


@pytest.mark.parametrize("P,m", FLAT_CASES)
def test_in_flight_bounds(P, m):
    assert max_in_flight(gpipe(P, m)) == (m,) * P
    in_flight = max_in_flight(one_f_one_b(P, m))
    assert in_flight == tuple(min(P - s, m) for s in range(P))
    assert max(in_flight) <= P


@pytest.mark.parametrize("P,m,V", INTERLEAVED_CASES)
def test_interleaved_in_flight(P, m, V):
    expected = tuple(min(2 * (P - s - 1) + (V - 1) * P + 1, m * V) for s in range(P))
    assert max_in_flight(interleaved_1f1b(P, m, V)) == expected


@pytest.mark.parametrize("P,m", [(4, 8), (4, 3), (3, 7), (1, 4)])
def test_one_f_one_b_follows_megatron_order(P, m):
    table = one_f_one_b(P, m)
    for stage in range(P):
        warmup = min(P - stage - 1, m)
        expected = [Action("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            expected += [Action("F", warmup + i, 0), Action("B", i, 0)]
        expected += [Action("B", i, 0) for i in range(m - warmup, m)]
        assert _program_order(table, stage) == expected


@pytest.mark.parametrize("P,m,V", [(2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2)])
def test_interleaved_follows_megatron_order(P, m, V):
    # Megatron's modular form: virtual microbatch k -> (group of P microbatches, chunk).
    def forward(k):
        group, within = divmod(k, P * V)
        return Action("F", group * P + within % P, within // P)

    def backward(k):
        f = forward(k)
        return Action("B", f.microbatch, V - 1 - f.chunk)

    total = m * V
    table = interleaved_1f1b(P, m, V)
    for stage in range(P):
        warmup = min(2 * (P - stage - 1) + (V - 1) * P, total)
        expected = [forward(k) for k in range(warmup)]
        for i in range(total - warmup):
            expected += [forward(warmup + i), backward(i)]
        expected += [backward(k) for k in range(total - warmup, total)]
        assert _program_order(table, stage) == expected


def test_gpipe_layout():
    table = gpipe(3, 2)
    assert render(table) == (
        "stage 0: F0 F1 .. .. .. .. B0 B1\n"
        "stage 1: .. F0 F1 .. .. B0 B1 ..\n"
        "stage 2: .. .. F0 F1 B0 B1 .. .."
    )


def test_render_shows_chunks_for_interleaved():
    text = render(interleaved_1f1b(2, 4, 2))
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("stage 0: F0a F1a F0b F1b")
    assert lines[1].startswith("stage 1: ... F0a F1a F0b B0b")
    assert "B3a" in lines[0] and "B3a" in lines[1]
    assert render(gpipe(2, 1), show_chunk=True) == (
        "stage 0: F0a ... ... B0a\nstage 1: ... F0a B0a ..."
    )
    assert render([]) == ""


def test_to_arrays():
    table = interleaved_1f1b(2, 2, 2)
    arrays = to_arrays(table)
    assert set(arrays) == {"kind", "microbatch", "chunk"}
    for array in arrays.values():
        assert array.dtype == np.int32
        assert array.shape == (len(table), 2)
    for tick, row in enumerate(table):
        for stage, action in enumerate(row):
            code = {"idle": 0, "F": 1, "B": 2}[action.kind]
            assert arrays["kind"][tick, stage] == code
            if not action.is_idle:
                assert arrays["microbatch"][tick, stage] == action.microbatch
                assert arrays["chunk"][tick, stage] == action.chunk
    idle = arrays["kind"] == 0
    assert idle.any() and (arrays["microbatch"][idle] == 0).all()
    assert (to_arrays(table, idle_fill=-1)["chunk"][idle] == -1).all()


# --------------------------------------------------------------------- broken tables


def _gpipe_2_1():
    # stage 0: F0 .. .. B0
    # stage 1: .. F0 B0 ..
    table = gpipe(2, 1)
    assert table == [
        (Action("F", 0, 0), IDLE),
        (IDLE, Action("F", 0, 0)),
        (IDLE, Action("B", 0, 0)),
        (Action("B", 0, 0), IDLE),
    ]
    return table


def test_validate_rejects_missing_backward():
    table = _gpipe_2_1()
    table[2] = (IDLE, IDLE)
    with pytest.raises(
        ScheduleError, match=r"^missing backward of microbatch 0 chunk 0 on stage 1$"
    ):
        validate_schedule(table, 2, 1)
    table = one_f_one_b(4, 8)
    table = [tuple(IDLE if a == Action("B", 5, 0) else a for a in row) for row in table]
    with pytest.raises(
        ScheduleError,
        match=r"missing backward of microbatch 5 chunk 0 on stage 0 \(and 3 more missing actions\)",
    ):
        validate_schedule(table, 4, 8)


def test_validate_rejects_dependency_violations():
    # Stage 1 runs its forward in the same tick as stage 0: the activation is not there yet.
    table = _gpipe_2_1()
    table = [(Action("F", 0, 0), Action("F", 0, 0))] + table[2:]
    with pytest.raises(
        ScheduleError,
        match=r"dependency violated: forward of microbatch 0 chunk 0 on stage 1 at tick 0 needs "
        r"forward of microbatch 0 chunk 0 on stage 0 in an earlier tick, but it runs at tick 0",
    ):
        validate_schedule(table, 2, 1)
    # Stage 0's backward before stage 1's.
    table = _gpipe_2_1()
    table[2], table[3] = table[3], table[2]
    with pytest.raises(
        ScheduleError,
        match=r"dependency violated: backward of microbatch 0 chunk 0 on stage 0 at tick 2 needs "
        r"backward of microbatch 0 chunk 0 on stage 1 in an earlier tick, but it runs at tick 3",
    ):
        validate_schedule(table, 2, 1)
    # Interleaved: chunk 1 on stage 0 needs chunk 0 of stage 1 (the wrap-around).
    table = interleaved_1f1b(2, 2, 2)
    validate_schedule(table, 2, 2, 2)
    tick = next(t for t, row in enumerate(table) if row[0] == Action("F", 0, 1))
    table[tick - 1], table[tick] = table[tick], table[tick - 1]
    with pytest.raises(
        ScheduleError, match=r"forward of microbatch 0 chunk 1 on stage 0 at tick 1"
    ):
        validate_schedule(table, 2, 2, 2)


def test_validate_rejects_malformed_tables():
    table = _gpipe_2_1()
    with pytest.raises(
        ScheduleError, match=r"tick 1 has 1 actions, expected one per stage \(P=2\)"
    ):
        validate_schedule([table[0], table[1][:1]] + table[2:], 2, 1)
    with pytest.raises(ScheduleError, match=r"runs twice, at ticks 0 and 4"):
        validate_schedule(table + [table[0]], 2, 1)
    with pytest.raises(ScheduleError, match=r"out of range \(microbatch < m=1, chunk < V=1\)"):
        validate_schedule(table + [(Action("F", 1, 0), IDLE)], 2, 1)
    with pytest.raises(ScheduleError, match=r"expected an Action, got 'F0'"):
        validate_schedule([("F0", IDLE)], 2, 1)


# --------------------------------------------------------------------- argument errors


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: gpipe(0, 4), r"pipeline size P must be an integer >= 1, got P=0"),
        (
            lambda: one_f_one_b(2, 0),
            r"number of microbatches m must be an integer >= 1, got m=0",
        ),
        (lambda: build_schedule("1f1b", 2, 4, 0), r"virtual chunks per stage V .* got V=0"),
        (lambda: gpipe(2.0, 4), r"got P=2.0"),
        (lambda: gpipe(True, 4), r"got P=True"),
        (
            lambda: build_schedule("interleaved", 1, 4, 2),
            r"V=2 virtual chunks per stage needs a pipeline size P > 1, got P=1",
        ),
        (lambda: interleaved_1f1b(4, 6, 2), r"multiple of the pipeline size P .*got m=6, P=4"),
        (
            lambda: interleaved_1f1b(4, 2, 2),
            r"interleaved 1F1B needs m >= P microbatches, got m=2, P=4",
        ),
        (lambda: interleaved_1f1b(2, 4, 1), r"needs V >= 2 virtual chunks per stage, got V=1"),
        (
            lambda: build_schedule("gpipe", 2, 4, 2),
            r"'gpipe' schedule runs one chunk per stage, got V=2",
        ),
        (
            lambda: build_schedule("1f1b", 2, 4, 3),
            r"'1f1b' schedule runs one chunk per stage, got V=3",
        ),
        (
            lambda: build_schedule("zero-bubble", 2, 4),
            r"unknown pipeline schedule 'zero-bubble'; "
            r"choose one of 'gpipe', '1f1b', 'interleaved'",
        ),
        (lambda: validate_schedule([], 0, 1), r"got P=0"),
        (lambda: Action("X", 0, 0), r"action kind must be 'F', 'B' or 'idle', got 'X'"),
        (lambda: Action("F"), r"a F action needs microbatch >= 0 and chunk >= 0"),
        (lambda: Action("idle", 0, 0), r"an idle action has microbatch=-1 and chunk=-1"),
    ],
)
def test_argument_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_build_schedule_dispatch():
    assert build_schedule("gpipe", 3, 5) == gpipe(3, 5)
    assert build_schedule("1F1B", 3, 5) == one_f_one_b(3, 5)
    assert build_schedule("interleaved", 3, 6, 2) == interleaved_1f1b(3, 6, 2)
    # One stage: no pipeline, no bubble.
    table = build_schedule("1f1b", 1, 3)
    assert len(table) == 6 and idle_fraction(table) == 0.0


# --------------------------------------------------------------------------- two-slot lockstep


@pytest.mark.parametrize("name,P,m,V", ALL_CASES)
def test_two_slot_tables_are_valid_and_cost_the_asynchronous_bound(name, P, m, V):
    """Every unit once per stage, each input produced exactly one tick before its use (the
    last virtual stage's backward: after its forward, same tick), and the SPMD program's cost
    (every tick of a phase runs the phase's slots on every stage) equals the asynchronous
    executor's (m*V + P - 1)(F + B)/V, for F=1, B=3 and for F=1, B=2; 1F1B at P=2 one forward
    more (its one-tick cooldown runs in the steady scan, forward slot masked)."""
    table = lockstep.two_slot(name, P, m, V)
    lockstep.validate(table, P, m, V)
    lockstep.validate(lockstep.two_slot(name, P, m, V, forward_only=True), P, m, V, forward_only=True)
    joined = name != "gpipe" and V * P == 2  # a one-tick cooldown
    for backward in (3.0, 2.0):
        assert lockstep.lockstep_cost(table, V, 1.0, backward) == pytest.approx(
            lockstep.async_cost(P, m, V, 1.0, backward) + (1.0 / V if joined else 0.0))
    phases = [(p.ticks, p.forward, p.backward) for p in lockstep.phases(table)]
    if name == "gpipe":
        assert phases == ([(m + P - 1, True, False), (m + P - 1, False, True)])
    elif joined:  # warmup 1, then steady m and the cooldown's one tick in one scan
        assert phases == [(1, True, False), (m + 1, True, True)]
    else:  # warmup V*P-1, steady m*V - V*P + P, cooldown V*P-1 (no warmup/cooldown when P*V = 1)
        edge = [(V * P - 1, True, False)] if P * V > 1 else []
        assert phases == edge + [(m * V - V * P + P, True, True)] + [
            (t, False, True) for t, _, _ in edge]


@pytest.mark.parametrize("P,V", [(P, V) for P in range(1, 7) for V in (1, 2, 3) if P > 1 or V == 1])
def test_two_slot_stash_is_flat_in_m(P, V):
    """Stage s holds at most 2(V*P-1) - 2s + 1 stage inputs, the same for every m >= 2P;
    GPipe holds m on every stage but the first (which re-embeds from the tokens)."""
    name = "interleaved" if V > 1 else "1f1b"
    held = {m: lockstep.stash_in_flight(lockstep.two_slot(name, P, m, V), P) for m in (2 * P, 4 * P, 8 * P)}
    assert held[2 * P] == held[4 * P] == held[8 * P], held
    assert all(h <= 2 * (V * P - 1) - 2 * s + 1 for s, h in enumerate(held[8 * P])), held
    if V == 1:
        assert lockstep.stash_in_flight(lockstep.two_slot("gpipe", P, 8), P) == (0,) + (8,) * (P - 1)


def test_two_slot_unit_order_is_megatrons():
    """Units in Megatron's interleaved order: per group of P microbatches, chunk by chunk."""
    assert [lockstep.unit(k, 2, 2) for k in range(8)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert [lockstep.unit(k, 3, 1) for k in range(3)] == [(0, 0), (1, 0), (2, 0)]
    fwd, bwd = lockstep.two_slot("1f1b", 2, 2)[1]  # tick 1: F1 on stage 0, F0 then B0 on stage 1
    assert fwd == (Action("F", 1, 0), Action("F", 0, 0)) and bwd == (IDLE, Action("B", 0, 0))


def test_two_slot_validator_rejects_broken_tables():
    table = lockstep.two_slot("1f1b", 2, 2)
    b0, b1, none = Action("B", 0, 0), Action("B", 1, 0), (IDLE, IDLE)
    assert table[2][1] == (b0, b1) and table[3][1] == (b1, IDLE)
    # B0 on stage 0 a tick late:
    late = table[:2] + [(table[2][0], (IDLE, b1)), (none, (b0, IDLE)), (none, (b1, IDLE))]
    with pytest.raises(ScheduleError, match=r"backward of microbatch 0 chunk 0 on stage 0 at tick 3 "
                       r"needs backward of microbatch 0 chunk 0 on stage 1 at tick 2, it runs at 1"):
        lockstep.validate(late, 2, 2)
    with pytest.raises(ScheduleError, match="missing or extra"):
        lockstep.validate(table[:-1], 2, 2)
    with pytest.raises(ScheduleError, match="runs twice"):
        lockstep.validate(table + table[-1:], 2, 2)
    with pytest.raises(ValueError, match="multiple of P"):
        lockstep.two_slot("interleaved", 4, 6, 2)


def test_two_slot_render():
    # (P=2: the one-tick cooldown runs in the steady scan, `lockstep.phases`)
    assert lockstep.render(lockstep.two_slot("1f1b", 2, 2)) == (
        "stage 0 F: F0 | F1 .. ..\n"
        "stage 0 B: .. | .. B0 B1\n"
        "stage 1 F: .. | F0 F1 ..\n"
        "stage 1 B: .. | B0 B1 .."
    )
