"""Where one compiled step's time goes on XLA:CPU: a `jax.profiler` trace of the step with
XLA:CPU's per-thunk trace events (`--xla_cpu_enable_xprof_traceme=true`, set before jax starts),
each event's self time joined to its HLO instruction in the compiled program, and grouped by
what the instruction is (matmul, elementwise, reduction, copy/transpose, ...) and by where in
the model its source line is (attention, MLP, norms, loss, optimizer, the layer scan's plumbing).

Used by `benchmarks/workload_w.py --profile`; not part of mlm_jax.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

TRACEME_FLAG = "--xla_cpu_enable_xprof_traceme=true"

# Trace events that are not HLO instructions (the runtime's own spans).
_RUNTIME = ("Thread", "Thunk", "Slinky", "Wait", "$", "end: ", "PjitFunction", "ProfilerSession")

# (area, source test): the first frame of an instruction's stack that matches names its area;
# tested innermost frame first.
_AREAS = (
    ("attention core", lambda f, fn: f.endswith("models/attention.py") and fn in (
        "_xla_attention", "_probs", "_attend_forward", "_attend_backward", "_attend_plain", "attention",
        "causal_mask", "_causal_forward", "_causal_backward", "_causal_plain", "_block_rows", "_join_rows")),
    ("attention projections", lambda f, fn: f.endswith("models/attention.py")),
    ("norms", lambda f, fn: fn in ("norm", "_norm_forward", "_norm_backward", "_normalized", "Norm.__call__")),
    ("MLP activation", lambda f, fn: fn.startswith(("_gelu", "_swiglu", "mlp_activation"))),
    ("MLP matmuls", lambda f, fn: f.endswith("models/mlp.py")),
    ("LM head + loss", lambda f, fn: fn.startswith(("_ce_", "linear_cross_entropy", "GPT.head", "cross_entropy",
                                                    "_onehot", "_masked_logits"))),
    ("embedding", lambda f, fn: fn == "GPT.embed_tokens"),
    ("optimizer", lambda f, fn: "/optax/" in f or f.endswith("mlm_jax/optim.py")),
    ("residual adds", lambda f, fn: fn == "Block.__call__"),
    ("layer scan", lambda f, fn: f.endswith(("models/recompute.py",)) or fn.startswith("GPT.run_layers")),
)


# models/layers.py's projection functions (QKV, output, MLP): an instruction's stack ends in them.
_PROJECTIONS = ("column_parallel", "row_parallel", "_product", "_transposed_input_product",
                "_transposed_input_forward", "_transposed_input_backward", "_pinned_product",
                "_pinned_product_forward", "_pinned_product_backward")


class Hlo:
    """The compiled module's instructions by name: kind, fused computation, source stack."""

    def __init__(self, text: str):
        tables = {}
        for table in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            m = re.search(rf"^{table}\n((?:\d+ .*\n)+)", text, re.M)
            tables[table] = dict(line.split(" ", 1) for line in m.group(1).splitlines()) if m else {}
        files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
        funcs = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
        locs = {}
        for k, v in tables["FileLocations"].items():
            d = dict(re.findall(r"(\w+)=(\d+)", v))
            locs[k] = (files.get(d.get("file_name_id")), funcs.get(d.get("function_name_id")), int(d.get("line", 0)))
        self._frames = {}
        for k, v in tables["StackFrames"].items():
            d = dict(re.findall(r"(\w+)=(\d+)", v))
            self._frames[k] = (d.get("file_location_id"), d.get("parent_frame_id"))
        self._locs = locs
        self.computations: dict[str, str] = {}
        self.instructions: dict[str, dict] = {}
        current = None
        for line in text.splitlines():
            m = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
            if m:
                current = m.group(1)
                self.computations[current] = ""
                continue
            if current is None:
                continue
            self.computations[current] += line + "\n"
            m = re.match(r"^\s*(?:ROOT )?%(\S+) = (\S+) (\S+?)\(", line)
            if m:
                name, shape, op = m.groups()
                called = re.search(r"calls=%([\w.\-]+)", line)
                frame = re.search(r"stack_frame_id=(\d+)", line)
                op_name = re.search(r'op_name="([^"]*)"', line)
                self.instructions[name] = {"op": op, "shape": shape, "calls": called.group(1) if called else None,
                                           "frame": frame.group(1) if frame else None,
                                           "op_name": op_name.group(1) if op_name else ""}

    def stack(self, frame_id):
        """[(file, function, line)] innermost first."""
        out, seen = [], set()
        while frame_id and frame_id not in seen and frame_id in self._frames:
            seen.add(frame_id)
            loc, parent = self._frames[frame_id]
            if loc in self._locs:
                out.append(self._locs[loc])
            if parent == frame_id:
                break
            frame_id = parent
        return out

    def kind(self, name: str) -> str:
        """matmul, elementwise/fusion, reduction, copy/transpose, broadcast, slice/update, loop, other."""
        ins = self.instructions.get(name)
        if ins is None:
            return "unknown"
        op, body = ins["op"], self.computations.get(ins["calls"] or "", "")
        if op in ("dot", "convolution") or re.search(r"= \S+ (dot|convolution)\(", body):
            return "matmul"
        if op == "while" or op == "conditional" or op == "call":
            return "loop/call (self)"
        ops = set(re.findall(r"= \S+ ([\w\-]+)\(", body)) or {op}
        if "reduce" in ops or "reduce-window" in ops or op in ("reduce", "reduce-window"):
            return "reduction"
        if ops <= {"copy", "transpose", "bitcast", "parameter", "reshape"}:
            return "copy/transpose"
        if ops <= {"broadcast", "bitcast", "parameter", "constant", "reshape"}:
            return "broadcast/fill"
        if ops & {"dynamic-update-slice", "dynamic-slice", "scatter", "gather", "slice", "concatenate", "pad"} and \
                not ops & {"exponential", "multiply", "add", "subtract", "divide", "select", "log", "erf", "tanh"}:
            return "slice/update/gather"
        return "elementwise"

    def area(self, name: str) -> str:
        ins = self.instructions.get(name)
        if ins is None:
            return "unknown"
        stack = self.stack(ins["frame"])
        if stack and stack[0][1] in _PROJECTIONS:
            # models/layers.py's projections: their stacks end there, so the einsum in the
            # instruction's name says whose they are (QKV "dgjk", output "hkd", MLP the rest).
            return "attention projections" if re.search(r"gjk|hkd|bshk", ins["op_name"]) else "MLP matmuls"
        for file, func, _ in stack:  # innermost first
            for area, test in _AREAS:
                if file and func and test(file, func):
                    return area
        if "while" in ins["op_name"]:
            return "layer scan"
        return "step (other)"

    def where(self, name: str) -> str:
        ins = self.instructions.get(name)
        stack = self.stack(ins["frame"]) if ins else []
        for file, func, line in stack:
            if file and "/mlm_jax/" in file or (file and "/optax/" in file):
                return f"{os.path.basename(file)}:{line} {func}"
        return ins["op_name"][-60:] if ins else ""


def self_times(trace_dir: str) -> tuple[dict[str, float], float, float]:
    """({HLO instruction: wall microseconds}, busy us, traced us) over every step traced into
    `trace_dir`. Each instant of the trace is shared among the instructions running then (the
    innermost span of each thread; XLA:CPU runs independent thunks and a thunk's partitions on
    both cores), so the figures add up to the time some instruction ran, never more than wall."""
    path = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")))[-1]
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    points = []  # (time, 0 end / 1 start, thread, name)
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(_RUNTIME):
            points.append((e["ts"], 1, e["tid"], e["name"], e["ts"] + e["dur"]))
            points.append((e["ts"] + e["dur"], 0, e["tid"], e["name"], None))
    points.sort(key=lambda p: (p[0], p[1], -(p[4] or 0)))
    stacks = collections.defaultdict(list)  # thread -> open spans, innermost last
    out, busy = collections.Counter(), 0.0
    last = points[0][0] if points else 0.0
    for t, is_start, tid, name, _ in points:
        active = [s[-1] for s in stacks.values() if s]
        if active and t > last:
            for a in active:
                out[a] += (t - last) / len(active)
            busy += t - last
        last = t
        if is_start:
            stacks[tid].append(name)
        elif name in stacks[tid]:
            stacks[tid].reverse()
            stacks[tid].remove(name)
            stacks[tid].reverse()
    traced = points[-1][0] - points[0][0] if points else 0.0
    return dict(out), busy, traced


def profile(run_step, compiled_text: str, steps: int = 3) -> dict:
    """Trace `steps` calls of `run_step()` (one blocking step each) and return the breakdown:
    {"ops": [(name, ms/step, kind, area, where)], "kind": {...}, "area": {...}, "traced_ms": ...}."""
    import time

    import jax

    hlo = Hlo(compiled_text)
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        t = time.perf_counter()
        for _ in range(steps):
            run_step()
        wall = (time.perf_counter() - t) / steps
        jax.profiler.stop_trace()
        times, busy, _ = self_times(tmp)
    ops = sorted(((n, us / steps / 1e3, hlo.kind(n), hlo.area(n), hlo.where(n)) for n, us in times.items()),
                 key=lambda r: -r[1])
    by_kind, by_area = collections.Counter(), collections.Counter()
    for _, ms, kind, area, _ in ops:
        by_kind[kind] += ms
        by_area[area] += ms
    return {"ops": ops, "kind": dict(by_kind), "area": dict(by_area), "traced_ms": wall * 1e3,
            "op_ms": busy / steps / 1e3}


def dot_flops(compiled_text: str) -> float:
    """FLOPs of the program's matmuls (2 x output elements x contracted size), loops counted
    by their trip counts where XLA states them (`known_trip_count`)."""
    hlo = Hlo(compiled_text)
    # how many times each computation runs: while bodies by their trip count, nested
    trips = {}
    for comp, body in hlo.computations.items():
        for m in re.finditer(r"while\(.*?body=%([\w.\-]+).*?known_trip_count\D+(\d+)", body):
            trips[m.group(1)] = (comp, int(m.group(2)))
    for comp, body in hlo.computations.items():
        for m in re.finditer(r"calls=%([\w.\-]+)", body):
            trips.setdefault(m.group(1), (comp, 1))

    def times(comp, depth=0):
        if comp not in trips or depth > 20:
            return 1
        parent, n = trips[comp]
        return n * times(parent, depth + 1)

    total = 0.0
    for comp, body in hlo.computations.items():
        for m in re.finditer(r"= (\w+)\[([\d,]*)\]\{?[^ ]* (?:dot)\((?:%[\w.\-]+), (?:%[\w.\-]+)\), (.*)", body):
            out = [int(x) for x in m.group(2).split(",") if x]
            line = m.group(3)
            lhs_c = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
            # contracted size: read from the lhs operand's shape
            ops = re.search(r"dot\((%[\w.\-]+), ", m.group(0))
            total += 2 * _prod(out) * _contracted(body, ops.group(1)[1:], lhs_c.group(1) if lhs_c else "") * times(comp)
    return total


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def _contracted(body: str, operand: str, dims: str) -> int:
    m = re.search(rf"%{re.escape(operand)} = \w+\[([\d,]*)\]", body) or \
        re.search(rf"%{re.escape(operand)}: \w+\[([\d,]*)\]", body)
    if not m or not dims:
        return 1
    shape = [int(x) for x in m.group(1).split(",") if x]
    return _prod(shape[int(d)] for d in dims.split(","))
