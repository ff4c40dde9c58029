"""An estimated step time read from the compiled GPU program (optimised, scheduled HLO text), kernel
by kernel, beside the analytic model's prediction (mlm_jax/plan/analytic.py).

Each kernel gets a time:

- a matmul (a `dot`, alone or in a fusion such as a Triton GEMM; a `__cublas$gemm` /
  `__cublas$lt$matmul*` custom call): FLOPs = 2 x (product of the output dims) x (contracting
  size), at the target's dense tensor-core peak for its operand types: bf16/fp16 the datasheet's
  (`targets.Gpu.bf16_tflops`), fp8 (and int8) twice that; fp32 operands at DEFAULT or HIGH
  precision at the TF32 rate, half the bf16 peak (XLA:GPU computes them on TF32 tensor cores:
  its `GetBlasComputationType` picks `kTF32AsF32` for an fp32 GEMM with precision <= HIGH while
  TF32 execution is enabled, its default), at HIGHEST on the CUDA cores (`Gpu.fp32_tflops`); a
  dot algorithm named in the program (`algorithm=dot_bf16_bf16_f32`, ...) decides instead;
- cuDNN's fused attention (`__cudnn$fmha*` custom calls): the forward 4*b*h*s*t*d FLOPs (QK^T and
  PV; dims from the call's `intermediate_tensor_shape` [b, h, s, t] and the head dims of Q and
  V), halved under a causal `mask_type`; the backward 2.5 x its forward (FlashAttention's
  convention: five matmuls of the forward's size, one of them recomputing the scores, against
  the forward's two), at the same peaks;
- the experts' grouped matmul (`kernels.grouped_matmul`'s Pallas/Triton kernels, a
  `__gpu$xla.gpu.triton` call named `grouped_matmul*`): 2 x rows x k x n FLOPs plus the row tiles
  its group edges waste, at the bf16 peak (the fp8 peak where its operands are fp8: the fp8
  experts' kernels multiply on fp8 `wgmma`, `kernels/tile_dot.py`); rows are the ones its groups hold, not its buffer's:
  the kernel computes only those, and a dispatch's receive buffer is sized to the worst case
  (`grouped_rows`: the rows the router sends a device's experts in a balanced routing, from the
  config; the buffer's rows where not given); its bytes the rows read, the weights, and its
  whole output (the rows past the groups are written as zeros);
- every other kernel (fusion, copy, reduce, custom call): (bytes its operands are read + bytes it
  writes) / HBM bandwidth (`memory_bandwidth` of the target description); a parameter that a
  fusion only slices counts the slices' bytes, and a buffer updated in place (a
  dynamic-update-slice) the update's;
- a matmul or attention kernel takes the longer of its FLOPs time and its bytes time (a
  roofline), and every kernel a fixed launch overhead (`LAUNCH_SECONDS`); parameters, constants,
  bitcasts, tuples and get-tuple-element cost nothing;
- a collective: the bytes each device sends (`gpu_hlo`'s ring convention: all-reduce 2(n-1)/n of
  the buffer, all-gather, reduce-scatter, all-to-all (n-1)/n, a ragged all-to-all (n-1)/n of the
  rows it sends, collective-permute all of it) at
  NVLink's bandwidth when its device groups stay inside a node, the network's when not
  (`analytic.hardware`), plus the launch overhead; host-memory offload transfers at the PCIe
  link's bandwidth (`HOST_BYTES_PER_S`).

The schedule is replayed with one compute stream and one queue per link: in a scheduled module a
computation's instructions are listed in execution order; an async start begins its transfer
when the link is free, and its done waits for it, so a collective costs the step only what the
compute scheduled between its start and done does not hide; a synchronous one all of its time.
A while loop costs its trip count times its body (and the condition once more); a conditional
its most expensive branch (an upper bound where a loop runs a cheaper branch most times, e.g.
the microbatch loop of --overlap-grad-reduce runs its reductions' branch once); calls nest.

The FLOPs the program executes are its matmul and cuDNN attention kernels' FLOPs times their
runs, one device's program (every device runs the same one); `report` compares them, times the
devices, with the model's (`metrics.flops_per_token`, attention halved as causal: so 1.0 means
nothing is computed twice, a cuDNN backward's recompute of the scores aside, which it states), and
the matmuls alone (the weights' products: every kernel but attention's) with 6NT (the model's less
attention's scores and weighted sum: 6 FLOPs per matmul weight per token);
its MFU counts model FLOPs as the analytic model's does (`analytic.step_flops`).

Limits (it is a model read from a program, not a measurement):

- no autotuning: every GEMM at the datasheet peak (real ones reach less of it, small and skinny
  ones much less; the analytic model assumes 60%), every memory-bound kernel at the datasheet
  bandwidth; no cache effects (L2 reuse between kernels is not credited);
- no concurrency between compute kernels (XLA's GPU runtime runs one stream for them here), only
  between compute and transfers; transfers on one link run one after another, and a transfer in
  flight across a loop does not slow the loop's own;
- the launch overhead is assumed, not measured (CUDA graphs make it smaller, host-side work
  between kernels larger); the while loop's condition's device-to-host copy is not counted;
- collectives at the links' nominal bandwidth with no latency term beyond the launch: small
  collectives, and NCCL's tree algorithms across nodes, are modelled only roughly;
- cuDNN attention's FLOPs from its shape (sliding windows and padding masks not subtracted);
  the experts' grouped matmul at its balanced-routing rows (an imbalanced routing makes the
  busiest expert's rank slower); other Pallas/Triton kernels and custom calls as memory-bound.
"""

from __future__ import annotations

import dataclasses
import math
import re

from mlm_jax.plan import analytic, gpu_hlo
from mlm_jax.plan.gpu_hlo import Instr, _arrays, _nbytes
from mlm_jax.kernels.grouped_matmul import Tiles
from mlm_jax.plan.targets import Gpu

LAUNCH_SECONDS = 3e-6  # per kernel and per collective (an assumption: a few microseconds)
# Host <-> device (activation offloading, `--recompute-granularity offload`): PCIe Gen5 x16
# (H100/H200/B200), Gen4 x16 (A100), bytes/s a direction, nominal.
HOST_BYTES_PER_S = {"a100": 32e9, "h100": 64e9, "h200": 64e9, "b200": 64e9}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id",
         "after-all", "add-dependency", "opt-barrier", "domain"}
_GEMM = "__cublas$"
_ATTENTION = "__cudnn$fmha"
_TRITON = "__gpu$xla.gpu.triton"
_GROUPED = re.compile(r"grouped_matmul(_wt|_dw)?\b")  # the kernels' names, in their op_name


@dataclasses.dataclass
class Kernel:
    """One instruction that costs time, as the step runs it."""

    name: str
    kind: str  # matmul, attention, a collective's kind (all-gather, ...), transfer, async; else its opcode (fusion, copy, ...): memory-bound
    op_name: str  # the source op (metadata)
    seconds: float  # one run's cost to the step (a collective or transfer: its exposed wait)
    flops: float = 0.0  # one run (matmul and attention)
    bytes: float = 0.0  # one run: memory traffic, or sent over the link
    duration: float = 0.0  # one run of a collective or transfer, hidden or not
    runs: int = 0  # per step
    recompute_flops: float = 0.0  # of `flops`: a cuDNN attention backward's recompute of the scores
    fp8_flops: float = 0.0  # of `flops`: products of fp8 operands (--fp8-format)
    queue: str = ""  # a collective's or transfer's: nvlink, network, host, async

    @property
    def total(self) -> float:
        return self.seconds * self.runs


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Per device, one step."""

    seconds: float
    compute_seconds: float  # the kernels on the compute stream
    exposed_seconds: float  # waits for collectives and transfers
    collective_seconds: float  # every collective's and transfer's duration, hidden or not
    matmul_flops: float  # matmul and attention kernels' FLOPs times their runs
    gemm_flops: float  # of which the matmuls' (GEMMs and dots: the weights' products, not attention)
    fp8_gemm_flops: float  # of which products of fp8 operands
    attention_recompute_flops: float  # of which cuDNN backwards recompute the scores (0.5 x forward)
    kernels: list[Kernel]  # those that run, most expensive first
    peak_flops: float  # the bf16 peak assumed, FLOP/s
    memory_bandwidth: float
    links: dict  # "nvlink", "network", "host" -> bytes/s


@dataclasses.dataclass
class _Run:
    seconds: float
    compute: float
    exposed: float
    waits: dict  # async start (or synchronous collective) name -> exposed seconds, one run


def _shape(ins: Instr | None) -> tuple[str, tuple[int, ...]] | None:
    arrays = _arrays(ins.type_text) if ins is not None else []
    return arrays[0] if arrays else None


def _results(ins: Instr) -> list:
    """The arrays an instruction returns, less a custom call's workspace (cuBLAS's s8[...],
    cuDNN's u8[...], the last of its results): scratch, not traffic."""
    arrays = _arrays(ins.type_text)
    if ins.opcode == "custom-call" and len(arrays) > 1 and arrays[-1][0] in ("s8", "u8"):
        return arrays[:-1]
    return arrays


class _Program:
    def __init__(self, text: str, target: Gpu, mesh_shape: dict[str, int], gpus_per_node: int,
                 hw: analytic.Hardware, grouped_rows: int | None = None):
        self.grouped_rows = grouped_rows
        self.instrs = gpu_hlo.parse(text)
        self.by_comp = gpu_hlo.computations(self.instrs)
        entry = re.search(r"^ENTRY\s+%(\S+)", text, re.M)
        if entry is None:
            raise ValueError("not an HLO module: no ENTRY computation")
        self.entry = entry.group(1)
        self.roots = set(re.findall(r"^\s*ROOT\s+%(\S+)\s*=", text, re.M))
        self.target = target
        self.bf16 = target.bf16_tflops * 1e12
        self.bandwidth = target.memory_bandwidth
        self.links = {"nvlink": hw.nvlink_bytes, "network": hw.network_bytes,
                      "host": HOST_BYTES_PER_S.get(target.name, 64e9)}
        devices = math.prod(mesh_shape.values())
        self.collectives = {}  # start name -> (link, bytes sent, kind, mesh axes)
        synchronous = set()  # start/done pairs XLA runs on the compute stream ("is_sync", jax 0.10's XLA)
        for op in gpu_hlo.collective_ops(self.instrs, mesh_shape):
            if op.done is not None and not op.collective.is_async:
                synchronous.add(op.start.name)
            groups = op.groups or [list(range(devices))]
            n = max(len(g) for g in groups)
            across = any(len({d // gpus_per_node for d in g}) > 1 for g in groups)
            c = op.collective
            share = 1.0 if c.kind == "collective-permute" else gpu_hlo._SENT[c.kind] * (n - 1) / n
            self.collectives[op.start.name] = ("network" if across else "nvlink", share * c.bytes if n > 1 else 0.0,
                                               c.kind, "+".join(c.axes) or "one device")
        self.start_of = {}  # done name -> start name, for every async pair in one computation
        for ins in self.instrs.values():
            if ins.opcode.endswith("-done") and ins.operands:
                start = self.instrs.get(ins.operands[0])
                if start is not None and start.computation == ins.computation:
                    self.start_of[ins.name] = start.name
        self.paired = set(self.start_of.values()) - synchronous
        self.kernels: dict[str, Kernel] = {}
        self.runs: dict[str, _Run] = {}

    # ------------------------------------------------------------------ one kernel

    def _called(self, ins: Instr) -> list[str]:
        return re.findall(r"calls=%([\w.\-]+)", ins.rest)

    def _target(self, ins: Instr) -> str:
        m = re.search(r'custom_call_target="([^"]*)"', ins.rest) if ins.opcode == "custom-call" else None
        return m.group(1) if m else ""

    def _matmuls(self, comp: str) -> list[Instr]:
        """The dots, GEMM and attention calls of a fused computation (a Triton GEMM fusion's dot,
        a dynamic-slice fusion's cuBLAS call), nested fusions included."""
        out = []
        for ins in self.by_comp.get(comp, []):
            if ins.opcode == "dot" or self._target(ins).startswith((_GEMM, _ATTENTION)):
                out.append(ins)
            for inner in self._called(ins):
                out += self._matmuls(inner)
        return out

    def _flops(self, ins: Instr) -> tuple[float, float, float]:
        """(FLOPs, seconds at peak, of which an attention backward's recompute) of a dot, GEMM
        or attention call."""
        target = self._target(ins)
        if target.startswith(_ATTENTION):
            return self._attention(ins, target)
        return (*self._dot_cost(ins), 0.0)

    def _peak(self, types: list[str], attrs: str) -> float:
        """FLOP/s of a matmul with these operand types and attributes (module docstring)."""
        alg = re.search(r'(?:algorithm=dot_|"algorithm":"ALG_DOT_)([a-z0-9]+)_[a-z0-9]+_[a-z0-9]+(?:_x(\d))?', attrs, re.I)
        if alg:
            lhs, passes = alg.group(1).lower(), int(alg.group(2) or 1)
            rate = {"bf16": self.bf16, "f16": self.bf16, "tf32": self.bf16 / 2, "f32": self.target.fp32_tflops * 1e12,
                    "any": 2 * self.bf16}.get(lhs)
            if rate:
                return rate / passes
        if any(t.startswith("f8") or t in ("s8", "u8") for t in types):
            return 2 * self.bf16
        if all(t in ("bf16", "f16") for t in types):
            return self.bf16
        if re.search(r"operand_precision=\{highest|\"operand_precision\":\[\"HIGHEST\"", attrs, re.I):
            return self.target.fp32_tflops * 1e12
        return self.bf16 / 2  # fp32 at DEFAULT/HIGH: TF32

    def _fp8(self, ins: Instr) -> bool:
        """Whether a dot or GEMM call multiplies fp8 operands (both: an upcast one is not)."""
        if self._target(ins).startswith(_ATTENTION):
            return False
        shapes = [_shape(self.instrs.get(o)) for o in ins.operands[:2]]
        return all(s is not None and s[0].startswith("f8") for s in shapes)

    def _dot_cost(self, ins: Instr) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of a dot or a GEMM call: 2 x output elements x contracting size
        (the contracting dims: a dot's `lhs_contracting_dims`, a call's `dot_dimension_numbers`)."""
        shapes = [_shape(self.instrs.get(o)) for o in ins.operands[:2]]
        out = _shape(ins)  # a GEMM call's first result (then its workspace)
        dims = re.search(r'lhs_contracting_dim(?:s=\{|ensions":\[)([^}\]]*)', ins.rest)
        if out is None or shapes[0] is None or dims is None:
            return 0.0, 0.0
        lhs = shapes[0][1]
        flops = 2.0 * math.prod(out[1]) * math.prod(lhs[int(d)] for d in re.findall(r"\d+", dims.group(1)))
        return flops, flops / self._peak([s[0] for s in shapes if s], ins.rest)

    def _attention(self, ins: Instr, target: str) -> tuple[float, float, float]:
        """(FLOPs, seconds at peak, of which the backward's recompute of the scores)."""
        q, k, v = (_shape(self.instrs.get(o)) for o in ins.operands[:3])
        cfg = ins.rest
        inter = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', cfg)
        if inter:
            b, h, s, t = (int(x) for x in re.findall(r"\d+", inter.group(1))[:4])
        else:  # BTNH: q [b, s, h, d], k [b, t, g, d]
            b, s, h, t = q[1][0], q[1][1], q[1][2], k[1][1]
        forward = 2.0 * b * h * s * t * (q[1][-1] + v[1][-1])
        if re.search(r'"mask_type":\s*"[A-Z_]*CAUSAL', cfg):
            forward /= 2
        backward = "Backward" in target
        flops = 2.5 * forward if backward else forward
        return flops, flops / self._peak([q[0], k[0]], cfg), 0.5 * forward if backward else 0.0

    def _param_read(self, param: Instr, users: dict[str, list[Instr]], full: float) -> float:
        """Bytes a fusion reads of one parameter: the slices it takes when it only slices it,
        nothing when it only updates it in place, else all of it."""
        read = 0.0
        for u in users.get(param.name, []):
            if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[:1] == [param.name]:
                read += _nbytes(_arrays(u.type_text))
            elif u.opcode == "dynamic-update-slice" and u.operands[:1] == [param.name]:
                continue
            elif u.opcode == "bitcast":
                read += self._param_read(u, users, full)
            else:
                return full
        return min(read, full)

    def _written(self, ins: Instr, comp_instrs: dict[str, Instr]) -> float:
        """Bytes a fused computation's root writes: an in-place update writes its update."""
        if ins.opcode == "tuple":
            return sum(self._written(comp_instrs[o], comp_instrs) for o in ins.operands if o in comp_instrs)
        if ins.opcode == "bitcast" and ins.operands and ins.operands[0] in comp_instrs:
            return self._written(comp_instrs[ins.operands[0]], comp_instrs)
        if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
            return _nbytes(_arrays(self.instrs[ins.operands[1]].type_text))
        return _nbytes(_results(ins))

    def _fusion_bytes(self, ins: Instr, comp: str) -> float:
        """Bytes a fusion (or a wrapped computation) reads and writes."""
        body = self.by_comp.get(comp, [])
        local = {i.name: i for i in body}
        users: dict[str, list[Instr]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        params = {int(i.rest.split(")")[0]): i for i in body if i.opcode == "parameter"}
        read = 0.0
        for n, o in enumerate(ins.operands):
            full = _nbytes(_arrays(self.instrs[o].type_text)) if o in self.instrs else 0.0
            read += self._param_read(params[n], users, full) if n in params else full
        root = next((i for i in body if i.name in self.roots), body[-1] if body else None)
        return read + (self._written(root, local) if root is not None else _nbytes(_arrays(ins.type_text)))

    def _plain_bytes(self, ins: Instr) -> float:
        """Bytes an unfused instruction reads and writes."""
        if ins.opcode == "dynamic-update-slice" and len(ins.operands) > 1:
            return 2.0 * _nbytes(_arrays(self.instrs[ins.operands[1]].type_text))
        if ins.opcode in ("dynamic-slice", "slice", "copy"):
            return 2.0 * _nbytes(_arrays(ins.type_text))
        read = sum(_nbytes(_arrays(self.instrs[o].type_text)) for o in ins.operands if o in self.instrs)
        return read + _nbytes(_results(ins))

    def _grouped(self, ins: Instr, op_name: str) -> Kernel | None:
        """The experts' grouped matmul kernel's cost (module docstring), or None for another."""
        name = _GROUPED.search(op_name) if self._target(ins) == _TRITON else None
        operands = [_shape(self.instrs.get(o)) for o in ins.operands[:3]]
        out = _shape(ins)
        if name is None or out is None or None in operands:
            return None
        (dtype, (R, K)), w, N = operands[1], operands[2], out[1][-1]
        rows = R if self.grouped_rows is None else min(R, self.grouped_rows)
        tiles = Tiles()
        if name.group(1) == "_dw":  # dw [G, K, N] = x_g^T dy_g over the groups' rows, tk at a time
            waste = out[1][0] * tiles.tk
            read = rows * (K + N) * _nbytes([(dtype, (1,))])
        else:  # out [R, N] = x [R, K] @ w[g]: a row tile per group edge
            waste = (w[1][0] - 1) * tiles.tm
            read = rows * K * _nbytes([(dtype, (1,))]) + _nbytes([w])
        flops = 2.0 * (rows + min(waste, rows)) * K * N
        nbytes = read + _nbytes([out])
        seconds = max(flops / self._peak([dtype, w[0]], ""), nbytes / self.bandwidth) + LAUNCH_SECONDS
        fp8 = flops if dtype.startswith("f8") and w[0].startswith("f8") else 0.0  # fp8 wgmma (kernels/tile_dot.py)
        return Kernel(ins.name, "matmul", op_name, seconds, flops, nbytes, fp8_flops=fp8)

    def kernel(self, ins: Instr) -> Kernel:
        """The cost of one compute instruction, one run (memoized)."""
        if ins.name in self.kernels:
            return self.kernels[ins.name]
        op = re.search(r'op_name="([^"]*)"', ins.rest)
        grouped = self._grouped(ins, op.group(1) if op else "")
        if grouped is not None:
            self.kernels[ins.name] = grouped
            return grouped
        kind, flops, compute, recompute = ins.opcode, 0.0, 0.0, 0.0  # memory-bound unless a matmul
        source = ins
        if ins.opcode == "fusion":  # a matmul when it holds one (a Triton GEMM, a dynamic-slice fusion)
            comp = self._called(ins)[0]
            nbytes = self._fusion_bytes(ins, comp)
            inner = self._matmuls(comp)
        else:
            nbytes = self._plain_bytes(ins)
            inner = [ins] if ins.opcode == "dot" or self._target(ins).startswith((_GEMM, _ATTENTION)) else []
        fp8 = 0.0
        for mm in inner:
            f, s, r = self._flops(mm)
            flops, compute, recompute = flops + f, compute + s, recompute + r
            if self._fp8(mm):
                fp8 += f
            kind = "attention" if self._target(mm).startswith(_ATTENTION) else "matmul"
            source = ins if 'op_name="' in ins.rest else mm  # a wrapping fusion may carry none
        op_name = re.search(r'op_name="([^"]*)"', source.rest)
        seconds = max(compute, nbytes / self.bandwidth) + LAUNCH_SECONDS
        k = Kernel(ins.name, kind, op_name.group(1) if op_name else "", seconds, flops, nbytes,
                   recompute_flops=recompute, fp8_flops=fp8)
        self.kernels[ins.name] = k
        return k

    # ------------------------------------------------------------------ async work

    def _async(self, ins: Instr) -> tuple[str, float, Kernel]:
        """(queue, duration, its Kernel) of an async start or a synchronous collective."""
        if ins.name in self.kernels:
            k = self.kernels[ins.name]
            return k.queue, k.duration, k
        op_name = re.search(r'op_name="([^"]*)"', ins.rest)
        source = op_name.group(1) if op_name else ""
        if ins.name in self.collectives:
            queue, sent, kind, axes = self.collectives[ins.name]
            k = Kernel(ins.name, kind, source or f"over {axes}", 0.0, bytes=sent,
                       duration=sent / self.links[queue] + LAUNCH_SECONDS)
        elif ins.opcode in ("fusion-start", "copy-start"):  # e.g. activations offloaded to the host
            if ins.opcode == "fusion-start":
                nbytes = self._fusion_bytes(ins, self._called(ins)[0])
            else:
                nbytes = 2.0 * _nbytes(_arrays(ins.type_text)[:1])
            queue = "host" if "S(5)" in ins.type_text else "async"
            # Over PCIe a transfer moves its bytes once (read on one side, written on the other).
            moved = nbytes / 2 if queue == "host" else nbytes
            k = Kernel(ins.name, "transfer", source, 0.0, bytes=moved,
                       duration=moved / (self.links["host"] if queue == "host" else self.bandwidth) + LAUNCH_SECONDS)
        else:  # an async-start of compute: its computation, on a second stream
            queue = "async"
            comp = self._called(ins)
            body = [i for i in self.by_comp.get(comp[0], []) if i.opcode not in _FREE] if comp else []
            k = Kernel(ins.name, "async", source, 0.0, flops=sum(self.kernel(i).flops for i in body),
                       duration=self.run(comp[0]).seconds if comp else LAUNCH_SECONDS)
        k.queue = queue
        self.kernels[ins.name] = k
        return queue, k.duration, k

    def _starts(self, ins: Instr) -> bool:
        """Whether `ins` hands work to another queue (a collective, an async start)."""
        return ins.name in self.collectives or ins.opcode.endswith("-start")

    # ------------------------------------------------------------------ the schedule

    def run(self, comp: str) -> _Run:
        """Replay one computation's schedule: one compute stream, one queue per link (memoized)."""
        if comp in self.runs:
            return self.runs[comp]
        t, compute = 0.0, 0.0
        free: dict[str, float] = {}
        pending: dict[str, float] = {}
        waits: dict[str, float] = {}
        for ins in self.by_comp.get(comp, []):
            op = ins.opcode
            if op in _FREE:
                continue
            if self._starts(ins):
                queue, duration, _ = self._async(ins)
                if ins.name in self.paired:
                    begin = max(t, free.get(queue, 0.0))
                    free[queue] = pending[ins.name] = begin + duration
                else:  # synchronous (or its done elsewhere): all of it on the stream
                    t += duration
                    waits[ins.name] = duration
                continue
            if op.endswith("-done"):
                start = self.start_of.get(ins.name)
                if start is not None:
                    wait = max(0.0, pending.pop(start, t) - t)
                    t += wait
                    waits[start] = wait
                continue
            if op == "while":
                trips = gpu_hlo.trip_count(ins, self.instrs)
                body, cond = (self.run(re.search(rf"{key}=%([\w.\-]+)", ins.rest).group(1))
                              for key in ("body", "condition"))
                t += trips * body.seconds + (trips + 1) * cond.seconds
                compute += trips * body.compute + (trips + 1) * cond.compute
            elif op in ("conditional", "call"):
                inner = self.run(self._callee(ins))
                t, compute = t + inner.seconds, compute + inner.compute
            else:
                step = self.kernel(ins).seconds
                t, compute = t + step, compute + step
        self.runs[comp] = _Run(t, compute, t - compute, waits)
        return self.runs[comp]

    def _callee(self, ins: Instr) -> str:
        """A call's computation; a conditional's most expensive branch (what it is costed at)."""
        if ins.opcode == "call":
            return re.search(r"to_apply=%([\w.\-]+)", ins.rest).group(1)
        return max(self._branches(ins), key=lambda b: self.run(b).seconds)

    def _branches(self, ins: Instr) -> list[str]:
        listed = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
        if listed:
            return re.findall(r"%([\w.\-]+)", listed.group(1))
        return re.findall(r"(?:true|false)_computation=%([\w.\-]+)", ins.rest)

    def count(self, comp: str, times: int) -> None:
        """Add `times` runs of `comp` to its kernels' run counts (through loops, the costed
        branches and calls); a collective's cost to the step is its exposed wait."""
        waits = self.run(comp).waits
        for ins in self.by_comp.get(comp, []):
            if ins.opcode in _FREE or ins.opcode.endswith("-done"):
                continue
            if self._starts(ins):
                k = self._async(ins)[2]
                k.seconds = waits.get(ins.name, 0.0)
                k.runs += times
            elif ins.opcode == "while":
                trips = gpu_hlo.trip_count(ins, self.instrs)
                self.count(re.search(r"body=%([\w.\-]+)", ins.rest).group(1), times * trips)
                self.count(re.search(r"condition=%([\w.\-]+)", ins.rest).group(1), times * (trips + 1))
            elif ins.opcode in ("conditional", "call"):
                self.count(self._callee(ins), times)
            else:
                self.kernel(ins).runs += times


def estimate(text: str, target: Gpu, mesh_shape: dict[str, int], gpus_per_node: int = 8,
             hw: analytic.Hardware | None = None, grouped_rows: int | None = None) -> Estimate:
    """The step time of a compiled program (`compiled.as_text()`) on `target`, per device.
    `grouped_rows`: the rows each of the experts' grouped matmul kernels computes (`grouped_rows`
    of the config); None: its buffer's."""
    hw = hw or analytic.hardware(target)
    p = _Program(text, target, mesh_shape, gpus_per_node, hw, grouped_rows)
    top = p.run(p.entry)
    p.count(p.entry, 1)
    ran = [k for k in p.kernels.values() if k.runs]
    ran.sort(key=lambda k: k.total, reverse=True)
    flops = sum(k.flops * k.runs for k in ran)
    recompute = sum(k.recompute_flops * k.runs for k in ran)
    gemms = sum(k.flops * k.runs for k in ran if k.kind == "matmul")
    fp8 = sum(k.fp8_flops * k.runs for k in ran)
    moving = sum(k.duration * k.runs for k in ran if k.queue in ("nvlink", "network", "host"))
    return Estimate(top.seconds, top.compute, top.exposed, moving, flops, gemms, fp8, recompute, ran, p.bf16,
                    p.bandwidth, p.links)


def grouped_rows(cfg) -> int | None:
    """The rows a device's experts receive per MoE layer and microbatch in a balanced routing:
    its tokens (a rank's rows x the sequence over context parallelism) x top-k, at most the
    capacity factor's share of them; every expert-parallel dispatch gives a rank's experts that
    many on average. None for a dense model."""
    m = cfg.model
    if not m.num_experts:
        return None
    tokens = cfg.train.micro_batch_size * cfg.train.seq_length // cfg.parallel.context_parallel_size
    return math.ceil(min(1.0, m.moe_expert_capacity_factor or 1.0) * tokens * m.moe_router_topk)


# --------------------------------------------------------------------------- the plan's report


def report(est: Estimate, cfg, target: Gpu, gpus: int, gpus_per_node: int, top: int = 10) -> dict:
    """The estimate beside the analytic model's prediction for the config's own layout, as
    `mlm_jax.plan` reports it (JSON-ready).

    MFU counts model FLOPs as the analytic model does (`analytic.step_flops`: Megatron's, full
    attention); executed / model FLOPs compares the program's matmul and attention FLOPs, per
    device times the devices (every device runs the same program), with
    `metrics.flops_per_token` (attention halved: causal, as the cuDNN kernels are costed)."""
    from mlm_jax.metrics import flops_per_token

    layout = analytic.layout_of(cfg, gpus)
    hw = analytic.hardware(target)
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    mfu_flops = analytic.step_flops(cfg, layout)
    model = flops_per_token(cfg.model, cfg.train.seq_length) * tokens
    # 6NT: the same without attention's scores and weighted sum (causal: half the square)
    attention = 3 * cfg.train.seq_length * cfg.model.attention_core_width \
        * cfg.model.num_layers * tokens
    executed = est.matmul_flops * gpus
    pred = analytic.predict(cfg, layout, hw, gpus, gpus_per_node)
    by_kind: dict[str, float] = {}
    for k in est.kernels:
        by_kind[k.kind] = by_kind.get(k.kind, 0.0) + k.total
    return {
        "seconds": est.seconds, "tokens_per_second": tokens / est.seconds,
        "mfu": mfu_flops / (gpus * target.bf16_tflops * 1e12 * est.seconds),
        "compute_seconds": est.compute_seconds, "exposed_seconds": est.exposed_seconds,
        "collective_seconds": est.collective_seconds, "seconds_by_kind": by_kind,
        "executed_matmul_flops": executed, "model_flops": model, "mfu_model_flops": mfu_flops,
        "executed_matmul_flops_ratio": executed / model,
        "executed_gemm_flops": est.gemm_flops * gpus, "model_gemm_flops": model - attention,
        "executed_gemm_flops_ratio": est.gemm_flops * gpus / (model - attention),
        "attention_recompute_flops": est.attention_recompute_flops * gpus,
        # --fp8-format: the matmul and attention FLOPs whose operands are fp8 (at twice the peak)
        "fp8_matmul_flops": est.fp8_gemm_flops * gpus,
        "fp8_matmul_flops_share": est.fp8_gemm_flops / est.matmul_flops if est.matmul_flops else 0.0,
        # of the GEMMs alone (the fused attention kernels, which stay bf16, left out)
        "fp8_gemm_flops_share": est.fp8_gemm_flops / est.gemm_flops if est.gemm_flops else 0.0,
        "kernels": len(est.kernels),
        "analytic": {"seconds": pred["step_seconds"], "tokens_per_second": pred["tokens_per_second"],
                     "mfu": pred["mfu"], "efficiency": hw.efficiency},
        "assumptions": {"bf16_flops": est.peak_flops, "memory_bytes_per_s": est.memory_bandwidth,
                        "launch_seconds": LAUNCH_SECONDS, "link_bytes_per_s": est.links},
        "top_kernels": [{"name": k.name, "kind": k.kind, "op_name": k.op_name, "runs": k.runs,
                         "seconds": k.total, "seconds_each": k.seconds, "flops_each": k.flops,
                         "bytes_each": k.bytes} for k in est.kernels[:top]],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:,.0f} us"


def _source(op_name: str, width: int = 70) -> str:
    name = op_name.removeprefix("jit(train_step)/")
    return name if len(name) <= width else "..." + name[-(width - 3):]


def text(r: dict) -> str:
    """The lines `python -m mlm_jax.plan` prints for `report`'s dict."""
    a = r["analytic"]
    assumed = r["assumptions"]
    lines = [
        f"step time: estimated from the compiled program {_ms(r['seconds'])} ({r['tokens_per_second']:,.0f} tokens/s, "
        f"MFU {r['mfu']:.1%}); analytic model {_ms(a['seconds'])} ({a['tokens_per_second']:,.0f} tokens/s, MFU "
        f"{a['mfu']:.1%}; {a['efficiency']:.0%} of peak assumed)",
        f"  kernels {_ms(r['compute_seconds'])}, waiting for collectives and transfers {_ms(r['exposed_seconds'])} "
        f"(of {_ms(r['collective_seconds'])} in flight); GEMMs at the {assumed['bf16_flops'] / 1e12:.0f} TFLOP/s "
        f"bf16 peak, memory at {assumed['memory_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"{assumed['launch_seconds'] * 1e6:.0f} us a kernel",
        f"executed matmul FLOPs / model FLOPs: {r['executed_matmul_flops_ratio']:.3f}"
        + (f" (cuDNN attention's backward recomputing the scores: "
           f"{r['attention_recompute_flops'] / r['model_flops']:.3f} of it)" if r["attention_recompute_flops"] else "")
        + f"; the weights' matmuls alone / 6NT: {r['executed_gemm_flops_ratio']:.3f}"
        + (f"; fp8 operands: {r['fp8_matmul_flops_share']:.1%} of the matmul and attention FLOPs, "
           f"{r['fp8_gemm_flops_share']:.1%} of the GEMMs' (at twice the bf16 peak)"
           if r["fp8_matmul_flops"] else ""),
        "top kernels (per step, share of the step, kind, runs, source):",
    ]
    for k in r["top_kernels"]:
        lines.append(f"  {_ms(k['seconds']):>10} {k['seconds'] / r['seconds']:6.1%}  {k['kind']:<10} x{k['runs']:<6} "
                     f"{_source(k['op_name'])}")
    return "\n".join(lines)
