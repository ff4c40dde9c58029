"""What a compiled GPU train step says about a cluster configuration: memory per device against
the GPU's, the attention backend, collectives per mesh axis (bytes, async, overlapped), matmul
operand types, the step time estimated from its kernels (mlm_jax/plan/step_time.py) beside the
analytic model's; fits or not, and what would help when it does not."""

from __future__ import annotations

import dataclasses
import os
import re

from mlm_jax.config import data_parallel_size
from mlm_jax.parallel.data import overlaps_grad_reduce
from mlm_jax.xla_flags import MEM_FRACTION, MEM_FRACTION_ENV, NO_COMPILER_RECOMPUTE, compiler_recompute
from mlm_jax.plan import gpu_hlo, step_time
from mlm_jax.plan.compile import Compiled
from mlm_jax.plan.targets import Gpu

GIB = 2**30
# JAX's GPU allocator takes this fraction of device memory (XLA_PYTHON_CLIENT_MEM_FRACTION; JAX's
# own default is 0.75, a GPU run of mlm_jax sets 0.9 unless the user did: see xla_flags).
def mem_fraction(environ=os.environ) -> float:
    try:
        return float(environ.get(MEM_FRACTION_ENV, MEM_FRACTION))
    except ValueError:
        return float(MEM_FRACTION)


def attention_backend(c: Compiled, program: gpu_hlo.Program) -> str:
    if program.cudnn_attention:
        return "cudnn"
    if c.cfg.parallel.context_parallel_size > 1:
        return f"xla (context-parallel {c.cfg.parallel.cp_comm_type})"
    return "xla"


def _is_gradient_or_gather(col: gpu_hlo.Collective) -> str | None:
    """'gradient reduction' / 'ZeRO parameter gather' for the once-per-step data-parallel
    collectives (outside loops, or in the last microbatch's branch of --overlap-grad-reduce,
    layer by layer), None for the rest."""
    if "data" not in col.axes or (col.in_loop and not col.in_branch) or col.bytes < 1024:
        return None
    if col.kind in ("all-reduce", "reduce-scatter"):
        return "gradient reduction"
    if col.kind == "all-gather":
        return "ZeRO parameter gather"
    return None


def report(c: Compiled, target: Gpu, gpus: int, gpus_per_node: int) -> dict:
    """The plan's findings as a JSON-ready dict."""
    mem = c.compiled.memory_analysis()
    mesh_shape = dict(c.pz.mesh.shape)
    program = gpu_hlo.read(c.text, mesh_shape)
    args, outs, alias, temp = (int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                               int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes))
    total = args + outs - alias + temp
    usable = int(target.memory_bytes * mem_fraction())
    dp_kinds: dict[str, dict] = {}
    for col in program.collectives:
        what = _is_gradient_or_gather(col)
        if what:
            row = dp_kinds.setdefault(what, {"count": 0, "bytes": 0, "overlapped": 0})
            row["count"] += 1
            row["bytes"] += col.bytes
            row["overlapped"] += int(col.overlapped)
    return {
        "gpu": target.name, "device_kind": target.description, "gpus": gpus, "gpus_per_node": gpus_per_node,
        "mesh": mesh_shape,
        "fits": total <= usable,
        "device_memory_bytes": target.memory_bytes,
        "usable_bytes": usable,
        "mem_fraction": mem_fraction(),
        "per_device_bytes": {
            "parameters": c.state_bytes["params"], "optimizer_state": c.state_bytes["opt_state"],
            "batch": c.batch_bytes, "arguments": args, "outputs": outs, "aliased": alias, "temp": temp,
            "total": total,
        },
        "attention_backend": attention_backend(c, program),
        "cudnn_attention_calls": program.cudnn_attention,
        "cudnn_attention_runs": program.cudnn_attention_runs,
        "collectives": gpu_hlo.by_axes(program.collectives),
        "sent_bytes_per_axis": gpu_hlo.sent_per_axis(program.collectives, mesh_shape),
        "collectives_async": sum(col.is_async for col in program.collectives),
        "collectives_overlapped": sum(col.overlapped for col in program.collectives),
        "collectives_total": len(program.collectives),
        "data_parallel": dp_kinds,
        "matmul_dtypes": {f"{a} x {b}": n for (a, b), n in sorted(program.matmul_dtypes.items())},
        "grouped_matmul_kernels": len(_GROUPED_KERNEL.findall(c.text)),
        "collective_list": [dataclasses.asdict(col) for col in program.collectives],
        "overlap_hint": _overlap_hint(c.cfg, c.pz.mesh, dp_kinds.get("gradient reduction")),
        "step_time": step_time.report(step_time.estimate(c.text, target, mesh_shape, gpus_per_node,
                                                            grouped_rows=step_time.grouped_rows(c.cfg)), c.cfg, target,
                                      gpus, gpus_per_node),
        "lower_seconds": round(c.lower_seconds, 2),
        "compile_seconds": round(c.compile_seconds, 2),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_rematerialization": compiler_recompute(os.environ.get("XLA_FLAGS", "")),
    }


# The experts' grouped matmul (kernels.grouped_matmul) as the compiled program calls it: a Triton
# custom call whose source op is one of its kernels.
_GROUPED_KERNEL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"[^\n]*op_name="[^"]*grouped_matmul')


def _overlap_hint(cfg, mesh, reduction: dict | None) -> str | None:
    """What would overlap a gradient reduction that does not overlap compute, or None."""
    if not reduction or reduction["overlapped"] == reduction["count"]:
        return None
    asked = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, overlap_grad_reduce=True))
    if not overlaps_grad_reduce(asked, mesh):
        return None  # the pipeline, expert parallelism, mixed stacks: reduced after the backward
    if not cfg.parallel.overlap_grad_reduce:
        return ("the gradient reduction runs after the backward: --overlap-grad-reduce reduces each layer's "
                "gradient inside the last microbatch's backward, overlapping the rest of it")
    return ("not every gradient reduction overlaps compute: XLA's scheduler keeps some back when memory is "
            "tight (a smaller --micro-batch-size or recompute leaves it room)")


def suggestions(cfg, gpus: int, gpus_per_node: int) -> list[str]:
    """Flags that lower per-device memory, for the one `error:` line of a plan that does not fit."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    out = []
    if m.recompute_granularity is None:
        out.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    elif m.recompute_granularity != "full":
        out.append("--recompute-granularity full")
    if t.micro_batch_size > 1:
        out.append(f"--micro-batch-size {t.micro_batch_size // 2}")
    if not p.use_distributed_optimizer and data_parallel_size(p, gpus) > 1:
        out.append("--use-distributed-optimizer")
    if (m.num_experts and p.expert_model_parallel_size > 1 and m.moe_token_dispatcher_type == "alltoall"
            and m.moe_receive_buffer_factor is None and p.expert_model_parallel_size > 2):
        out.append("--moe-receive-buffer-factor 2")  # the worst case is ep x: receive buffers 2 x a balanced load
    if p.tensor_model_parallel_size * 2 <= gpus_per_node:
        sp = "" if p.sequence_parallel else " --sequence-parallel"
        out.append(f"--tensor-model-parallel-size {p.tensor_model_parallel_size * 2}{sp}")
    if not (m.num_experts and len({m.is_moe_layer(i) for i in range(m.num_layers)}) > 1):  # (refused with mixed layers)
        out.append(f"--pipeline-model-parallel-size {p.pipeline_model_parallel_size * 2}")
    if p.use_megatron_fsdp:  # the state is split over the data ranks: twice as many hold half
        out.append(f"--gpus {gpus * 2}")
    return out


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2**20:.1f} MiB"


def text(r: dict) -> str:
    """The report as the lines `python -m mlm_jax.plan` prints."""
    b = r["per_device_bytes"]
    mesh = " x ".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "one device"
    lines = [
        f"plan: {r['gpus']} x {r['device_kind']} ({r['gpus'] // r['gpus_per_node'] or 1} node(s) of "
        f"{min(r['gpus'], r['gpus_per_node'])}), mesh {mesh}",
        f"compiled in {r['compile_seconds']:.1f} s (lowered in {r['lower_seconds']:.1f} s)",
        "memory per device:",
        f"  parameters       {_gib(b['parameters'])}",
        f"  optimizer state  {_gib(b['optimizer_state'])}",
        f"  batch            {_gib(b['batch'])}",
        f"  temporaries      {_gib(b['temp'])}",
        f"  total            {_gib(b['total'])} of {_gib(r['usable_bytes'])} usable "
        f"({r['mem_fraction']:.2f} of {_gib(r['device_memory_bytes'])}): "
        + ("fits" if r["fits"] else f"does NOT fit, {_gib(b['total'] - r['usable_bytes'])} over"),
        f"attention: {r['attention_backend']}"
        + (f" ({', '.join(f'{k} x{v}' for k, v in r['cudnn_attention_calls'].items())})"
           if r["cudnn_attention_calls"] else ""),
        f"matmul operand types: {', '.join(f'{k} ({v})' for k, v in r['matmul_dtypes'].items()) or 'none'}",
        *([f"experts: the grouped matmul kernel (Pallas/Triton), {r['grouped_matmul_kernels']} calls in the program"]
          if r["grouped_matmul_kernels"] else []),
        "XLA's own rematerialization: " + (
            f"ON (XLA_FLAGS' --xla_disable_hlo_passes leaves it out): near the memory limit XLA may recompute "
            f"on its own, beyond --recompute-granularity (add {NO_COMPILER_RECOMPUTE.split('=')[1]} to that list)"
            if r["xla_rematerialization"] else "off (the recompute flags alone decide what is recomputed)"),
        f"collectives: {r['collectives_total']}, {r['collectives_async']} async, "
        f"{r['collectives_overlapped']} overlapped with compute",
    ]
    for axes, row in sorted(r["collectives"].items()):
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(row["kinds"].items()))
        at_most = "at most " if row.get("at_most") else ""
        lines.append(f"  over {axes:<14} {row['count']:>4} ({kinds}); {at_most}{row['bytes_per_step'] / 2**20:,.1f} MiB "
                     f"per step; {row['async']} async, {row['overlapped']} overlapped")
    for what, row in sorted(r["data_parallel"].items()):
        lines.append(f"  data-parallel {what}: {row['count']} collective(s), {row['bytes'] / 2**20:,.1f} MiB, "
                     f"{row['overlapped']} overlapped with compute")
    if r.get("overlap_hint"):
        lines.append(f"  {r['overlap_hint']}")
    lines.append(step_time.text(r["step_time"]))
    return "\n".join(lines)
