"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B as tables of actions.

A schedule is a table: a list of ticks, each tick a tuple with one `Action` per pipeline stage.
An action is a forward ('F') or backward ('B') of one microbatch on one model chunk, or idle.
These are Megatron's per-stage orders, the reference an asynchronous executor runs; the runtime
executes their two-slot lockstep form (`lockstep`), which costs the same time. Everything here
is pure Python and is tested without devices.

Timing model (one action per stage per tick)
--------------------------------------------
- P stages; each stage holds V model chunks. Chunk c on stage s is virtual stage v = c*P + s,
  so a microbatch's forward walks v = 0 .. P*V-1 (wrapping from the last stage back to the first
  between chunks) and its backward walks back down.
- In each tick every stage does at most one action; forwards and backwards cost one tick each.
- Data moves to the neighbouring stage between ticks: the forward of (mb, v) needs the forward of
  (mb, v-1) done in an earlier tick; the backward of (mb, v) needs its own forward and the
  backward of (mb, v+1) done in earlier ticks (the last virtual stage's backward only needs its
  forward: the loss sits there).

Each schedule is Megatron-LM's per-stage program order, executed as soon as possible: a stage
runs the next action of its order in the first tick whose inputs exist, and idles until then
(what Megatron's blocking send/recv does).

- GPipe: all m forwards, then all m backwards, microbatches in order.
- 1F1B (Megatron's non-interleaved schedule): stage s runs W = min(P-s-1, m) warmup forwards,
  then alternates forward(W+i), backward(i) (steady 1F1B), then the W remaining backwards.
- Interleaved 1F1B (Megatron's interleaved schedule, microbatch group size P): the forward
  order on every stage is, for each group of P microbatches, chunk 0 of the group, then chunk 1,
  ..., then chunk V-1; the backward order is the same with chunk c replaced by V-1-c. Stage s runs
  W = min(2*(P-s-1) + (V-1)*P, m*V) warmup forwards, then forward(W+i), backward(i) pairs, then
  the remaining backwards. Needs m % P == 0 (hence m >= P), V >= 2 and P >= 2.

What holds in this model (asserted by tests/test_schedules.py over a sweep of P, m, V)
-------------------------------------------------------------------------------------
- Every (microbatch, chunk) runs forward and backward exactly once on every stage, and no action
  runs before its inputs exist (`validate_schedule`).
- Ticks are exactly 2*(m*V + P - 1) (V = 1 for GPipe and 1F1B) and every stage idles exactly
  2*(P-1) ticks, so the idle fraction is exactly (P-1)/(m*V + P - 1): the GPipe/1F1B bubble,
  divided by V for interleaving (for m >= 1 with GPipe/1F1B, and m a multiple of P when
  interleaved). Megatron's orderings reach these bounds as they are; nothing was reordered.
- Forwards whose backward has not run yet (`max_in_flight`), on stage s: GPipe m on every stage;
  1F1B min(P-s, m), so at most P; interleaved min(2*(P-s-1) + (V-1)*P + 1, m*V) chunk-sized
  units (each holds one chunk's activations, 1/V of the stage's layers).

What this model leaves out: a real backward costs about twice a forward, and real transfers take
time. Megatron's interleaved warmup of 2*(P-s-1) (rather than P-s-1) is there for those; in the
unit-cost model the smaller warmup (P-s-1) + (V-1)*P reaches the same tick count with P-s-1
fewer chunk activations stashed, but the table keeps Megatron's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

FORWARD = "F"
BACKWARD = "B"
IDLE_KIND = "idle"

# Integer codes of `to_arrays`' "kind" array.
KIND_CODES = {IDLE_KIND: 0, FORWARD: 1, BACKWARD: 2}

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A schedule table breaks an invariant (see `validate_schedule`)."""


@dataclasses.dataclass(frozen=True)
class Action:
    """What one stage does in one tick.

    kind: 'F' (forward), 'B' (backward) or 'idle'. microbatch and chunk index the work; both are
    -1 for idle.
    """

    kind: str
    microbatch: int = -1
    chunk: int = -1

    def __post_init__(self):
        if self.kind not in KIND_CODES:
            raise ValueError(f"action kind must be 'F', 'B' or 'idle', got {self.kind!r}")
        if self.kind == IDLE_KIND:
            if (self.microbatch, self.chunk) != (-1, -1):
                raise ValueError(
                    f"an idle action has microbatch=-1 and chunk=-1, got "
                    f"microbatch={self.microbatch}, chunk={self.chunk}"
                )
        elif self.microbatch < 0 or self.chunk < 0:
            raise ValueError(
                f"a {self.kind} action needs microbatch >= 0 and chunk >= 0, got "
                f"microbatch={self.microbatch}, chunk={self.chunk}"
            )

    @property
    def is_idle(self) -> bool:
        return self.kind == IDLE_KIND


IDLE = Action(IDLE_KIND)

Table = list[tuple[Action, ...]]


# --------------------------------------------------------------------------- arguments


def _check_count(name: str, what: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} {name} must be an integer >= 1, got {name}={value!r}")


def _check_sizes(P: int, m: int, V: int) -> None:
    _check_count("P", "pipeline size", P)
    _check_count("m", "number of microbatches", m)
    _check_count("V", "number of virtual chunks per stage", V)
    if V > 1 and P == 1:
        raise ValueError(
            f"V={V} virtual chunks per stage needs a pipeline size P > 1, got P=1"
        )


def ideal_ticks(P: int, m: int, V: int = 1) -> int:
    """Ticks of a schedule with the bubble of the formula: 2*(m*V + P - 1)."""
    _check_sizes(P, m, V)
    return 2 * (m * V + P - 1)


def ideal_idle_fraction(P: int, m: int, V: int = 1) -> float:
    """The bubble formula: (P-1)/(m*V + P - 1) of all (tick, stage) slots are idle."""
    _check_sizes(P, m, V)
    return (P - 1) / (m * V + P - 1)


# --------------------------------------------------------------------------- execution


def _dependencies(action: Action, stage: int, P: int, V: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, virtual stage) that must run in an earlier tick than `action`."""
    v = action.chunk * P + stage
    if action.kind == FORWARD:
        return [(FORWARD, action.microbatch, v - 1)] if v > 0 else []
    deps = [(FORWARD, action.microbatch, v)]
    if v < P * V - 1:
        deps.append((BACKWARD, action.microbatch, v + 1))
    return deps


def _execute(orders: Sequence[Sequence[Action]], P: int, V: int) -> Table:
    """Runs each stage's program order as soon as its inputs exist; returns the table."""
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage)
    position = [0] * P
    remaining = sum(len(order) for order in orders)
    table: Table = []
    while remaining:
        row = []
        for s in range(P):
            action = orders[s][position[s]] if position[s] < len(orders[s]) else IDLE
            if not action.is_idle and not all(
                dep in done for dep in _dependencies(action, s, P, V)
            ):
                action = IDLE
            row.append(action)
        if all(action.is_idle for action in row):
            raise RuntimeError(
                f"schedule deadlocks at tick {len(table)}: no stage's next action has its inputs"
            )
        # Record only after the whole tick: an output is visible to neighbours the next tick.
        for s, action in enumerate(row):
            if not action.is_idle:
                done.add((action.kind, action.microbatch, action.chunk * P + s))
                position[s] += 1
                remaining -= 1
        table.append(tuple(row))
    return table


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action], warmup: int):
    """Warmup forwards, then forward/backward pairs, then the remaining backwards."""
    warmup = min(warmup, len(forwards))
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(forwards) - warmup :]


# --------------------------------------------------------------------------- schedules


def gpipe(P: int, m: int) -> Table:
    """GPipe: every stage runs all m forwards, then all m backwards."""
    _check_sizes(P, m, 1)
    forwards = [Action(FORWARD, i, 0) for i in range(m)]
    backwards = [Action(BACKWARD, i, 0) for i in range(m)]
    return _execute([forwards + backwards] * P, P, 1)


def one_f_one_b(P: int, m: int) -> Table:
    """Megatron's non-interleaved 1F1B: P-s-1 warmup forwards on stage s, steady 1F1B, cooldown."""
    _check_sizes(P, m, 1)
    forwards = [Action(FORWARD, i, 0) for i in range(m)]
    backwards = [Action(BACKWARD, i, 0) for i in range(m)]
    orders = [_one_f_one_b_order(forwards, backwards, P - s - 1) for s in range(P)]
    return _execute(orders, P, 1)


def interleaved_1f1b(P: int, m: int, V: int) -> Table:
    """Megatron's interleaved 1F1B with V chunks per stage, microbatches in groups of P."""
    _check_sizes(P, m, V)
    if V < 2:
        raise ValueError(
            f"interleaved 1F1B needs V >= 2 virtual chunks per stage, got V={V} "
            f"(use '1f1b' for one chunk per stage)"
        )
    if m < P:
        raise ValueError(f"interleaved 1F1B needs m >= P microbatches, got m={m}, P={P}")
    if m % P:
        raise ValueError(
            f"interleaved 1F1B needs the number of microbatches m to be a multiple of the "
            f"pipeline size P (microbatches go through in groups of P), got m={m}, P={P}"
        )
    # (microbatch, chunk) in Megatron's order: per group of P microbatches, chunk by chunk.
    work = [(g + j, c) for g in range(0, m, P) for c in range(V) for j in range(P)]
    forwards = [Action(FORWARD, mb, c) for mb, c in work]
    backwards = [Action(BACKWARD, mb, V - 1 - c) for mb, c in work]
    orders = [
        _one_f_one_b_order(forwards, backwards, 2 * (P - s - 1) + (V - 1) * P) for s in range(P)
    ]
    return _execute(orders, P, V)


def build_schedule(name: str, P: int, m: int, V: int = 1) -> Table:
    """The table of schedule `name` ('gpipe', '1f1b' or 'interleaved') for P stages, m
    microbatches and V virtual chunks per stage."""
    key = name.lower() if isinstance(name, str) else name
    if key not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; choose one of "
            + ", ".join(repr(s) for s in SCHEDULES)
        )
    _check_sizes(P, m, V)
    if key == "interleaved":
        return interleaved_1f1b(P, m, V)
    if V != 1:
        raise ValueError(
            f"the {key!r} schedule runs one chunk per stage, got V={V}; "
            f"virtual chunks need the 'interleaved' schedule"
        )
    return gpipe(P, m) if key == "gpipe" else one_f_one_b(P, m)


# --------------------------------------------------------------------------- checks and views


def _describe(kind: str, microbatch: int, stage: int, chunk: int) -> str:
    word = "forward" if kind == FORWARD else "backward"
    return f"{word} of microbatch {microbatch} chunk {chunk} on stage {stage}"


def validate_schedule(table: Sequence[Sequence[Action]], P: int, m: int, V: int = 1) -> None:
    """Raises ScheduleError naming the first violation, or returns None if the table is sound.

    Checks: one action per stage per tick; microbatch in [0, m) and chunk in [0, V); the forward
    and the backward of every (microbatch, chunk) exactly once on every stage; every action's
    inputs produced in an earlier tick (see the module docstring for the dependencies).
    """
    _check_sizes(P, m, V)
    ran_at: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> tick
    for tick, row in enumerate(table):
        if len(row) != P:
            raise ScheduleError(
                f"tick {tick} has {len(row)} actions, expected one per stage (P={P})"
            )
        for stage, action in enumerate(row):
            if not isinstance(action, Action):
                raise ScheduleError(
                    f"tick {tick}, stage {stage}: expected an Action, got {action!r}"
                )
            if action.is_idle:
                continue
            if not (action.microbatch < m and action.chunk < V):
                raise ScheduleError(
                    f"tick {tick}, stage {stage}: {action} is out of range "
                    f"(microbatch < m={m}, chunk < V={V})"
                )
            key = (action.kind, action.microbatch, action.chunk * P + stage)
            if key in ran_at:
                raise ScheduleError(
                    f"{_describe(action.kind, action.microbatch, stage, action.chunk)} runs "
                    f"twice, at ticks {ran_at[key]} and {tick}"
                )
            ran_at[key] = tick
    missing = [
        (kind, mb, stage, chunk)
        for stage in range(P)
        for chunk in range(V)
        for mb in range(m)
        for kind in (FORWARD, BACKWARD)
        if (kind, mb, chunk * P + stage) not in ran_at
    ]
    if missing:
        more = f" (and {len(missing) - 1} more missing actions)" if len(missing) > 1 else ""
        raise ScheduleError(f"missing {_describe(*missing[0])}{more}")
    for (kind, mb, v), tick in sorted(ran_at.items(), key=lambda item: item[1]):
        stage, chunk = v % P, v // P
        for dep in _dependencies(Action(kind, mb, chunk), stage, P, V):
            if ran_at[dep] >= tick:
                dep_kind, dep_mb, dep_v = dep
                raise ScheduleError(
                    f"dependency violated: {_describe(kind, mb, stage, chunk)} at tick {tick} "
                    f"needs {_describe(dep_kind, dep_mb, dep_v % P, dep_v // P)} in an earlier "
                    f"tick, but it runs at tick {ran_at[dep]}"
                )


def idle_fraction(table: Sequence[Sequence[Action]]) -> float:
    """Idle (tick, stage) slots over all slots."""
    slots = sum(len(row) for row in table)
    idle = sum(action.is_idle for row in table for action in row)
    return idle / slots if slots else 0.0


def max_in_flight(table: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Per stage, the most forwards done whose backward is not yet done, at the end of any tick.

    Each unit is one (microbatch, chunk): the activations a stage stashes for the backward.
    """
    num_stages = len(table[0]) if table else 0
    peak = [0] * num_stages
    live = [0] * num_stages
    for row in table:
        for stage, action in enumerate(row):
            live[stage] += {FORWARD: 1, BACKWARD: -1, IDLE_KIND: 0}[action.kind]
            peak[stage] = max(peak[stage], live[stage])
    return tuple(peak)


def _chunk_letter(chunk: int) -> str:
    return chr(ord("a") + chunk) if chunk < 26 else f".{chunk}"


def render(table: Sequence[Sequence[Action]], show_chunk: bool | None = None) -> str:
    """A text diagram, one row per stage, one column per tick: `F3` is the forward of
    microbatch 3, `B0b` the backward of microbatch 0 on chunk b (chunk letters are shown when
    any chunk other than 0 appears, or when show_chunk is True); dots are idle ticks."""
    if not table:
        return ""
    if show_chunk is None:
        show_chunk = any(a.chunk > 0 for row in table for a in row if not a.is_idle)

    def label(action: Action) -> str:
        if action.is_idle:
            return ""
        return f"{action.kind}{action.microbatch}" + (
            _chunk_letter(action.chunk) if show_chunk else ""
        )

    cells = [[label(a) for a in row] for row in table]  # [tick][stage]
    width = max(2, max(len(cell) for row in cells for cell in row))
    num_stages = len(table[0])
    name_width = len(f"stage {num_stages - 1}")
    lines = []
    for stage in range(num_stages):
        columns = [(row[stage] or "." * width).ljust(width) for row in cells]
        lines.append(f"{f'stage {stage}':<{name_width}}: " + " ".join(columns).rstrip())
    return "\n".join(lines)


def to_arrays(table: Sequence[Sequence[Action]], idle_fill: int = 0) -> dict[str, np.ndarray]:
    """The table as int32 arrays a runtime indexes per tick, each [ticks, stages]:
    "kind" (0 idle, 1 forward, 2 backward), "microbatch" and "chunk". Idle slots hold
    `idle_fill` in "microbatch" and "chunk" (0 keeps them valid indices; "kind" is the mask)."""
    num_stages = len(table[0]) if table else 0
    shape = (len(table), num_stages)
    kind = np.zeros(shape, np.int32)
    microbatch = np.full(shape, idle_fill, np.int32)
    chunk = np.full(shape, idle_fill, np.int32)
    for tick, row in enumerate(table):
        for stage, action in enumerate(row):
            if not action.is_idle:
                kind[tick, stage] = KIND_CODES[action.kind]
                microbatch[tick, stage] = action.microbatch
                chunk[tick, stage] = action.chunk
    return {"kind": kind, "microbatch": microbatch, "chunk": chunk}


def forward_only(P: int, m: int, V: int = 1) -> Table:
    """Forwards only (evaluation): every stage runs its forwards in the training schedule's
    forward order (microbatches in order; in groups of P chunk by chunk when V > 1), as soon
    as their inputs exist. m*V + P - 1 ticks."""
    _check_sizes(P, m, V)
    if V == 1:
        work = [(i, 0) for i in range(m)]
    else:
        work = [(g + j, c) for g in range(0, m, P) for c in range(V) for j in range(min(P, m - g))]
    forwards = [Action(FORWARD, mb, c) for mb, c in work]
    return _execute([forwards] * P, P, V)
