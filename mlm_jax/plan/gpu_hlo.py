"""Read a compiled GPU program (optimised, scheduled HLO text): its collectives, matmuls and
attention kernels, as `mlm_jax.plan` reports them and the GPU-compile tests assert them.

- Collectives: kind, the mesh axes their device groups span (from `replica_groups` /
  `source_target_pairs`, over the mesh's logical device order), bytes of the whole buffer (an
  all-gather's or all-reduce's result, a reduce-scatter's input; a ragged all-to-all's rows
  sent, see `_ragged_bytes`), whether asynchronous (a
  `-start`/`-done` pair XLA runs as one: its backend config not `"is_sync":true`, see `_SYNC`)
  and overlapped (compute scheduled between start and done: in a scheduled module the
  instructions of a computation are listed in execution order), and how
  many times a step runs them (trip counts of the enclosing while loops, e.g. the layer scan;
  inside a branch of a conditional in a loop, `in_branch`, an upper bound: e.g. the last
  microbatch's branch of --overlap-grad-reduce runs once per step, not once per microbatch).
- Matmuls: the element types of both operands of every cuBLAS call and `dot` (in fusions too).
- Attention: cuDNN's fused kernels (`__cudnn$fmha...` custom calls), as instructions and as
  executions per step.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.+?)\s+([a-z][a-z0-9-]*)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s+\(.*\)\s*->\s*.*\{\s*$")
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
          "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# Instructions that do work on the device (what overlapping a collective means).
_COMPUTE = ("fusion", "custom-call", "dot", "convolution", "while", "call", "conditional")
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")
# A collective XLA runs synchronously (on the compute stream): one the scheduler put nothing
# beside (XLA's async-to-sync conversion) or with async collectives off. XLA of jax 0.10 left it
# a -start/-done pair, XLA of jax 0.12 the plain instruction; both say so in the backend config.
_SYNC = re.compile(r'"is_sync":\s*true')


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type_text: str
    opcode: str
    rest: str  # operands and attributes
    computation: str
    index: int  # position in its computation (schedule order)

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.rest.split("), ")[0].split(")")[0])


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]  # mesh axes the groups span; () for a group of one device
    bytes: int  # of the whole buffer, per device, one execution
    dtypes: tuple[str, ...]  # element types of the buffers moved
    bytes_by_dtype: dict  # element type -> bytes of `bytes`
    is_async: bool
    overlapped: bool  # compute scheduled between start and done
    runs: int  # executions per step (product of enclosing loops' trip counts; at most, if in_branch)
    in_loop: bool
    op_name: str
    in_branch: bool = False  # inside a conditional's branch that a loop runs


@dataclasses.dataclass(frozen=True)
class Program:
    collectives: list[Collective]
    matmul_dtypes: dict[tuple[str, str], int]  # (lhs, rhs) element types -> count
    cudnn_attention: dict[str, int]  # custom-call target -> count
    cudnn_attention_runs: dict[str, int]  # custom-call target -> executions per step (loops' trips)


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(type_text)]


def _nbytes(arrays) -> int:
    return int(sum(math.prod(shape) * _BYTES[dt] for dt, shape in arrays))


def parse(text: str) -> dict[str, Instr]:
    """Every instruction of the module by name, with its computation and schedule position."""
    instrs: dict[str, Instr] = {}
    current, index = None, 0
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            current, index = m.group(1), 0
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            name, type_text, opcode, rest = m.groups()
            instrs[name] = Instr(name, type_text, opcode, rest, current, index)
            index += 1
    return instrs


def _loop_runs(instrs: dict[str, Instr]) -> dict[str, tuple[int, bool, bool]]:
    """computation -> (times one step runs it, inside a while loop, inside a conditional's branch
    in a loop: the count is then an upper bound), through whiles, calls and conditionals."""
    calls: dict[str, list[tuple[str, int, bool, bool]]] = {}
    for ins in instrs.values():
        if ins.opcode == "while":
            body = re.search(r"body=%([\w.\-]+)", ins.rest)
            cond = re.search(r"condition=%([\w.\-]+)", ins.rest)
            n = trip_count(ins, instrs)
            for target in (body, cond):
                if target:
                    calls.setdefault(ins.computation, []).append((target.group(1), n, True, False))
        else:
            branch = ins.opcode == "conditional"
            targets = re.findall(r"(?:calls|to_apply|true_computation|false_computation)=%([\w.\-]+)", ins.rest)
            branches = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
            targets += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
            for target in targets:
                calls.setdefault(ins.computation, []).append((target, 1, False, branch))
    called = {t for edges in calls.values() for t, *_ in edges}
    runs: dict[str, tuple[int, bool, bool]] = {}
    stack = [(c, 1, False, False) for c in calls if c not in called]
    while stack:
        comp, n, looped, branched = stack.pop()
        if comp in runs and runs[comp][0] >= n:
            continue
        runs[comp] = (n, looped, branched)
        stack += [(t, n * k, looped or loop, branched or (branch and looped)) for t, k, loop, branch in calls.get(comp, [])]
    return runs


def trip_count(loop: Instr, instrs: dict[str, Instr]) -> int:
    """Iterations of a `while`: XLA's `known_trip_count`, else counted from its induction variable."""
    trips = re.search(r'known_trip_count":\{"n":"(\d+)"', loop.rest)
    return int(trips.group(1)) if trips else _counted_trips(loop, instrs)


def _constant(instrs: dict[str, Instr], name: str) -> int | None:
    ins = instrs.get(name)
    if ins is None or ins.opcode != "constant" or not re.match(r"s32\[\]", ins.type_text):
        return None
    return int(ins.rest.split(")")[0])


def _counted_trips(loop: Instr, instrs: dict[str, Instr]) -> int:
    """Trips of a while XLA gave no known trip count but an induction variable: its condition's
    `i < N` (or `<=`) against a constant, from the constant the loop starts `i` at (0 if not a
    constant); 1 where the loop is not of that form. (The microbatch loop of a context-parallel
    step is such a loop: counted once, its collectives were a quarter of the step's.)"""
    index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', loop.rest)
    cond = re.search(r"condition=%([\w.\-]+)", loop.rest)
    if not index or not cond:
        return 1
    comps = {cond.group(1)}
    for ins in instrs.values():  # the condition and the fusions it calls
        if ins.computation == cond.group(1):
            comps.update(re.findall(r"calls=%([\w.\-]+)", ins.rest))
    bound = None
    for ins in instrs.values():
        if ins.computation in comps and ins.opcode == "compare":
            direction = re.search(r"direction=(\w+)", ins.rest)
            limits = [_constant(instrs, o) for o in ins.operands[:2]]
            if direction and direction.group(1) in ("LT", "LE") and limits[0] is None and limits[1] is not None:
                bound = limits[1] + (direction.group(1) == "LE")
    init = instrs.get(loop.operands[0]) if loop.operands else None
    start = 0
    if init is not None and init.opcode == "tuple":
        start = _constant(instrs, init.operands[int(index.group(1))]) or 0
    return max(bound - start, 1) if bound is not None else 1


def _groups(rest: str) -> list[list[int]] | None:
    """Device groups of a collective: explicit `{{0,1},{2,3}}` or iota `[G,S]<=[dims]T(perm)`."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
                  rest)
    if m:  # mesh form: groups over the named axes of a (possibly permuted) device mesh
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        if m.group(2):
            ids = np.arange(math.prod(sizes)).reshape([int(d) for d in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(p) for p in m.group(3).split(",")])
            ids = ids.reshape(sizes)
        else:
            ids = np.arange(math.prod(sizes)).reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        rest_axes = [i for i in range(len(names)) if i not in over]
        size = math.prod(sizes[i] for i in over)
        return ids.transpose(rest_axes + over).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(g, s).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}", rest)
    if m:
        return [[int(x) for x in grp.split(",") if x] for grp in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return None


def _axes(groups: list[list[int]] | None, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ (logical ids in mesh order)."""
    if not groups:
        return ()
    names, shape = list(mesh_shape), tuple(mesh_shape.values())
    varying: set[str] = set()
    for group in groups:
        coords = np.array([np.unravel_index(i, shape) for i in group if i < math.prod(shape)])
        if len(coords) > 1:
            varying |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
    return tuple(n for n in names if n in varying)


def _group_size(groups) -> int:
    return max((len(g) for g in groups), default=1) if groups else 1


def computations(instrs: dict[str, Instr]) -> dict[str, list[Instr]]:
    """computation -> its instructions in schedule order."""
    by_comp: dict[str, list[Instr]] = {}
    for ins in instrs.values():
        by_comp.setdefault(ins.computation, []).append(ins)
    return by_comp


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction: its start (the instruction itself when synchronous), its done
    (None when synchronous or not found), what `read` reports of it and its device groups."""

    start: Instr
    done: Instr | None
    collective: Collective
    groups: list[list[int]] | None


def collective_ops(instrs: dict[str, Instr], mesh_shape: dict[str, int]) -> list[CollectiveOp]:
    """Every collective of the module (async `-start`/`-done` pairs, `async-start` wrappers of
    one, synchronous ones), in text order."""
    runs = _loop_runs(instrs)
    by_comp = computations(instrs)
    done_of = {}
    for ins in instrs.values():
        if ins.opcode.endswith("-done") and ins.operands:
            done_of[ins.operands[0]] = ins
    found = []
    for ins in instrs.values():
        kind = ins.opcode.removesuffix("-start")
        wrapped = None
        if ins.opcode == "async-start":  # e.g. an all-to-all wrapped in an async computation
            wrapped = wrapped_collective(ins, by_comp)
            kind = wrapped.opcode if wrapped else kind
        if kind not in COLLECTIVES or ins.opcode.endswith("-done") or ins.computation.startswith("async"):
            continue
        source = wrapped or ins
        started = ins.opcode.endswith("-start")
        is_async = started and not any(_SYNC.search(i.rest) for i in (ins, source))
        done = done_of.get(ins.name) if started else None
        result = _arrays((done or ins).type_text) if started and done else _arrays(source.type_text)
        if kind == "ragged-all-to-all":
            result = _ragged_bytes(ins, result, instrs)
        groups = _groups(source.rest)
        scale = _group_size(groups) if kind == "reduce-scatter" else 1
        by_dtype: dict[str, int] = {}
        for dt, shape in result:
            by_dtype[dt] = by_dtype.get(dt, 0) + _nbytes([(dt, shape)]) * scale
        size = sum(by_dtype.values())
        overlapped = False
        if is_async and done is not None and done.computation == ins.computation:
            between = by_comp[ins.computation][ins.index + 1:done.index]
            overlapped = any(b.opcode in _COMPUTE for b in between)
        n, looped, branched = runs.get(ins.computation, (1, False, False))
        op_name = re.search(r'op_name="([^"]*)"', ins.rest)
        col = Collective(kind, _axes(groups, mesh_shape), size, tuple(sorted(by_dtype)), by_dtype,
                         is_async, overlapped, n, looped, op_name.group(1) if op_name else "", branched)
        found.append(CollectiveOp(ins, done, col, groups))
    return found


def _ragged_bytes(ins: Instr, output, instrs: dict[str, Instr]):
    """The rows a ragged all-to-all sends, as (dtype, shape) arrays: its operand (all a rank may
    send), or its output buffer where that is smaller: every row sent is received, so averaged
    over the ranks a rank sends at most what its output holds (an expert-parallel return sends
    from the receive buffer, sized to the worst case, into the rows the dispatch sent)."""
    operand = instrs.get(ins.operands[0]) if ins.operands else None
    sent = _arrays(operand.type_text)[:1] if operand is not None else []
    return sent if sent and _nbytes(sent) < _nbytes(output[:1]) else output[:1]


def wrapped_collective(start: Instr, by_comp: dict[str, list[Instr]]) -> Instr | None:
    """The collective an `async-start` runs (None: it wraps something else)."""
    target = re.search(r"calls=%([\w.\-]+)", start.rest)
    inner = by_comp.get(target.group(1), []) if target else []
    return next((i for i in inner if i.opcode in COLLECTIVES), None)


def read(text: str, mesh_shape: dict[str, int]) -> Program:
    """The collectives, matmul operand types and cuDNN attention calls of a compiled program."""
    instrs = parse(text)
    runs = _loop_runs(instrs)
    found = [op.collective for op in collective_ops(instrs, mesh_shape)]
    matmuls: dict[tuple[str, str], int] = {}
    attention: dict[str, int] = {}
    attention_runs: dict[str, int] = {}
    for ins in instrs.values():
        target = re.search(r'custom_call_target="([^"]*)"', ins.rest) if ins.opcode == "custom-call" else None
        if target and target.group(1).startswith("__cudnn$fmha"):
            attention[target.group(1)] = attention.get(target.group(1), 0) + 1
            attention_runs[target.group(1)] = attention_runs.get(target.group(1), 0) + runs.get(ins.computation,
                                                                                                (1,))[0]
        if ins.opcode == "dot" or (target and target.group(1).startswith(_GEMMS)):  # __cublas$lt$matmul$f8 too
            ops = [instrs[o] for o in ins.operands[:2] if o in instrs]
            types = tuple(_arrays(o.type_text)[0][0] if _arrays(o.type_text) else "?" for o in ops)
            if len(types) == 2:
                matmuls[types] = matmuls.get(types, 0) + 1
    return Program(found, matmuls, attention, attention_runs)


def by_axes(collectives: list[Collective]) -> dict[str, dict]:
    """Per mesh-axis group ("data", "tensor", "data+tensor", ...): count, bytes per step (an upper
    bound where `at_most`: some run in a conditional's branch), and how many of them are async
    and overlapped."""
    out: dict[str, dict] = {}
    for c in collectives:
        key = "+".join(c.axes) or "none"
        row = out.setdefault(key, {"count": 0, "bytes_per_step": 0, "async": 0, "overlapped": 0, "kinds": {},
                                   "at_most": False})
        row["count"] += 1
        row["at_most"] |= c.in_branch
        row["bytes_per_step"] += c.bytes * c.runs
        row["async"] += int(c.is_async)
        row["overlapped"] += int(c.overlapped)
        row["kinds"][c.kind] = row["kinds"].get(c.kind, 0) + 1
    return out


# Bytes a device sends for one collective of `n` devices over a buffer of B bytes, on a ring:
# all-reduce 2B(n-1)/n (reduce-scatter then all-gather), all-gather, reduce-scatter and
# all-to-all B(n-1)/n (a ragged one's B: the rows sent), a collective-permute its whole buffer
# (plan/analytic.py counts the same).
_SENT = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0, "ragged-all-to-all": 1.0}


def sent_per_axis(collectives: list[Collective], mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes each device sends per step, per mesh axis the groups span (as `by_axes` names them;
    a collective in a conditional's branch counted at every run of its loop)."""
    out: dict[str, float] = {}
    for c in collectives:
        if not c.axes:
            continue
        n = math.prod(mesh_shape[a] for a in c.axes)
        share = 1.0 if c.kind == "collective-permute" else _SENT[c.kind] * (n - 1) / n
        key = "+".join(c.axes)
        out[key] = out.get(key, 0.0) + share * c.bytes * c.runs
    return out
