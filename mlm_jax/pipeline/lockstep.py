"""The two-slot lockstep schedules the runtime executes (pure Python, tested without devices).

`schedules` holds Megatron's per-stage orders as one-action-per-tick tables: the reference an
asynchronous (MPMD) executor runs. One SPMD program cannot run them as fast: a tick lasts as
long as its slowest action, and in 1F1B's steady state neighbouring stages alternate F and B,
so every tick lasts a backward (P=4, m=8: 58 units against 44, with F=1, B=3).

Here every tick has two slots per stage, a FORWARD slot and then a BACKWARD slot, and the work
in them is static index arithmetic (no search, no per-tick choice of action):

- forward unit k = t - s on stage s (valid while 0 <= k < m*V);
- backward unit j = t - (V*P - 1) - (P - 1 - s) (1F1B, interleaved), or, for GPipe, the same
  after a forward-only phase of m + P - 1 ticks, with j = t' - (P - 1 - s);
- a unit maps to (microbatch, chunk) in Megatron's interleaved order: group g = k // (P*V),
  chunk c = (k % (P*V)) // P, microbatch g*P + k % P (V = 1: microbatch k, chunk 0); a backward
  unit runs chunk V-1-c.

Every dependency is met one tick early or, for the last virtual stage's backward, in the same
tick after its forward: F of (mb, v) runs exactly one tick after F of (mb, v-1) (including the
hand-over from stage P-1 to stage 0 between chunks), and B of (mb, v) exactly one tick after B
of (mb, v+1). So a stage consumes what arrived in the previous tick at once: activations and
gradients need no receive buffer; only the stage inputs wait in a stash for their backward.

The ticks fall into phases by which slots any stage uses (`phases`): 1F1B and interleaved have
a warmup of V*P-1 forward-only ticks, m*V - V*P + P ticks with both, and a cooldown of V*P-1
backward-only ticks; GPipe m+P-1 forward-only then m+P-1 backward-only ticks; evaluation one
forward-only phase. A phase runs only its slots, on every stage (a slot with no valid unit runs
masked), so the lockstep cost is sum over phases of ticks * (F_c if forward + B_c if backward),
with chunk costs F_c = F/V, B_c = B/V:
  1F1B / interleaved: (V*P-1) F_c + (m*V-V*P+P)(F_c+B_c) + (V*P-1) B_c = (m*V+P-1)(F+B)/V,
  GPipe: (m+P-1)(F+B),
exactly the asynchronous executor's time for Megatron's orders; except 1F1B at P=2, whose
one-tick cooldown runs in the steady phase (`phases` says why): one forward F more. The stash of stage s holds its
stage inputs from forward to backward: at most 2(V*P-1) - 2s + 1 units for 1F1B/interleaved
(flat in m; about twice Megatron's P-s, the price of lockstep round trips of 2(P-1-s) ticks),
m for GPipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mlm_jax.pipeline.schedules import (
    BACKWARD, FORWARD, IDLE, SCHEDULES, Action, ScheduleError, _check_sizes, _describe,
)

# One tick: (forward slot per stage, backward slot per stage), each an Action or IDLE.
Tick = tuple[tuple[Action, ...], tuple[Action, ...]]


@dataclasses.dataclass(frozen=True)
class Phase:
    """Ticks [start, stop) that run the forward slot and/or the backward slot."""

    start: int
    stop: int
    forward: bool
    backward: bool

    @property
    def ticks(self) -> int:
        return self.stop - self.start


def unit(k: int, P: int, V: int) -> tuple[int, int]:
    """(microbatch, chunk) of a stage's k-th forward in Megatron's interleaved order."""
    if V == 1:
        return k, 0
    group, r = divmod(k, P * V)
    return group * P + r % P, r // P


def _slot(kind: str, k: int, n: int, P: int, V: int) -> Action:
    if not 0 <= k < n:
        return IDLE
    mb, c = unit(k, P, V)
    return Action(kind, mb, c if kind == FORWARD else V - 1 - c)


def _check(name: str, P: int, m: int, V: int) -> str:
    key = name.lower() if isinstance(name, str) else name
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of "
                         + ", ".join(repr(s) for s in SCHEDULES))
    _check_sizes(P, m, V)
    if (key == "interleaved") != (V > 1):
        need = "V >= 2" if key == "interleaved" else "V = 1"
        raise ValueError(f"the {key!r} schedule needs {need}, got V={V}")
    if V > 1 and m % P:
        raise ValueError(f"interleaved 1F1B needs m a multiple of P, got m={m}, P={P}")
    return key


def two_slot(name: str, P: int, m: int, V: int = 1, forward_only: bool = False) -> list[Tick]:
    """The two-slot table of schedule `name` (or its forward phase alone, for evaluation)."""
    key = _check(name, P, m, V)
    n = m * V
    forward_ticks = n + P - 1
    if forward_only:
        return [(tuple(_slot(FORWARD, t - s, n, P, V) for s in range(P)), (IDLE,) * P)
                for t in range(forward_ticks)]
    if key == "gpipe":
        fwd = [tuple(_slot(FORWARD, t - s, n, P, V) for s in range(P)) for t in range(forward_ticks)]
        bwd = [tuple(_slot(BACKWARD, t - (P - 1 - s), n, P, V) for s in range(P))
               for t in range(forward_ticks)]
        return [(f, (IDLE,) * P) for f in fwd] + [((IDLE,) * P, b) for b in bwd]
    lag = V * P - 1  # the last virtual stage's first backward: the tick of its first forward
    return [(tuple(_slot(FORWARD, t - s, n, P, V) for s in range(P)),
             tuple(_slot(BACKWARD, t - lag - (P - 1 - s), n, P, V) for s in range(P)))
            for t in range(n + lag + P - 1)]


def phases(table: Sequence[Tick]) -> list[Phase]:
    """Maximal runs of ticks that use the same slots (on any stage), except that a backward-only
    run of one tick after a run with both slots joins that run (its forward slot masked): XLA
    inlines a scan of one tick, and the inlined backward's stage-recompute buffers did not share
    the steady loop's, which a second loop's do (1F1B at P=2, the only schedule with a one-tick
    cooldown: GPT 1.3B pp2 x dp4 ZeRO, micro 4, 8 H100, compiled 26.51 GiB per device with the
    cooldown apart, 17.66 joined; at P=4 the two loops share. benchmarks/RESULTS.md, issue 31).
    The price: one masked forward per step."""
    out: list[Phase] = []
    for t, (fwd, bwd) in enumerate(table):
        use = (any(not a.is_idle for a in fwd), any(not a.is_idle for a in bwd))
        if out and (out[-1].forward, out[-1].backward) == use:
            out[-1] = dataclasses.replace(out[-1], stop=t + 1)
        else:
            out.append(Phase(t, t + 1, *use))
    if len(out) >= 2 and out[-1].ticks == 1 and out[-1].backward and not out[-1].forward \
            and out[-2].forward and out[-2].backward:
        out[-2:] = [dataclasses.replace(out[-2], stop=out[-1].stop)]
    return out


def lockstep_cost(table: Sequence[Tick], V: int, forward: float = 1.0, backward: float = 3.0) -> float:
    """Time of the SPMD program: every tick of a phase runs the phase's slots on every stage."""
    return sum(p.ticks * (forward * p.forward + backward * p.backward) / V for p in phases(table))


def async_cost(P: int, m: int, V: int = 1, forward: float = 1.0, backward: float = 3.0) -> float:
    """An asynchronous executor's time for Megatron's orders: (m*V + P - 1)(F + B)/V."""
    return (m * V + P - 1) * (forward + backward) / V


def validate(table: Sequence[Tick], P: int, m: int, V: int = 1, forward_only: bool = False) -> None:
    """Every (microbatch, chunk) runs forward (and backward) once per stage, and each input is
    produced exactly one tick before it is used (the runtime keeps no receive buffer), except
    the last virtual stage's backward, which follows its forward in the same tick."""
    last = P * V - 1
    when: dict[tuple[str, int, int], int] = {}  # (kind, microbatch, virtual stage) -> tick
    for t, slots in enumerate(table):
        for kind, row in zip((FORWARD, BACKWARD), slots):
            for s, a in enumerate(row):
                if a.is_idle:
                    continue
                if a.kind != kind:
                    raise ScheduleError(f"tick {t}: a {a.kind} action in the {kind} slot of stage {s}")
                key = (kind, a.microbatch, a.chunk * P + s)
                if key in when:
                    raise ScheduleError(f"{_describe(kind, a.microbatch, s, a.chunk)} runs twice")
                when[key] = t
    kinds = (FORWARD,) if forward_only else (FORWARD, BACKWARD)
    want = {(k, mb, v) for k in kinds for mb in range(m) for v in range(P * V)}
    if set(when) != want:
        missing = sorted(want - set(when))[:3]
        raise ScheduleError(f"missing or extra actions, e.g. {missing}")
    for (kind, mb, v), t in when.items():
        if kind == FORWARD:
            needs = [(FORWARD, mb, v - 1, t - 1)] if v > 0 else []
        else:
            needs = [(FORWARD, mb, v, t)] + ([(BACKWARD, mb, v + 1, t - 1)] if v < last else [])
        for dep_kind, dep_mb, dep_v, at in needs:
            got = when[(dep_kind, dep_mb, dep_v)]
            if (got != at) if dep_kind == kind else (got > at):
                raise ScheduleError(
                    f"{_describe(kind, mb, v % P, v // P)} at tick {t} needs "
                    f"{_describe(dep_kind, dep_mb, dep_v % P, dep_v // P)} at tick {at}, it runs at {got}")


def stash_in_flight(table: Sequence[Tick], P: int) -> tuple[int, ...]:
    """Per stage, the most stage inputs held for a backward at once (virtual stages v > 0: the
    first one recomputes its input, the embedding, from the tokens). A unit is held from the
    forward that stores it through the backward that reads it."""
    live, peak = [0] * P, [0] * P
    for fwd, bwd in table:
        for s in range(P):
            if not fwd[s].is_idle and fwd[s].chunk * P + s > 0:
                live[s] += 1
                peak[s] = max(peak[s], live[s])
        for s in range(P):
            if not bwd[s].is_idle and bwd[s].chunk * P + s > 0:
                live[s] -= 1
    return tuple(peak)


def render(table: Sequence[Tick]) -> str:
    """A text diagram: per stage, its forward-slot row over its backward-slot row, one column
    per tick (`F3`/`B3` microbatch 3, a chunk letter when V > 1, dots for masked slots), with
    `|` between phases."""
    if not table:
        return ""
    P = len(table[0][0])
    chunks = any(a.chunk > 0 for f, b in table for a in f + b if not a.is_idle)

    def label(a: Action) -> str:
        return "" if a.is_idle else f"{a.kind}{a.microbatch}" + (chr(97 + a.chunk) if chunks else "")

    width = max(2, max(len(label(a)) for f, b in table for a in f + b))
    cuts = {p.start for p in phases(table)} - {0}
    lines = []
    for s in range(P):
        for slot, name in ((0, "F"), (1, "B")):
            cells = [("| " if t in cuts else "") + (label(row[slot][s]) or "." * width).ljust(width)
                     for t, row in enumerate(table)]
            lines.append(f"stage {s} {name}: " + " ".join(cells).rstrip())
    return "\n".join(lines)
