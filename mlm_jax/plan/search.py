"""The layout search of `python -m mlm_jax.plan --search`: every layout Megatron's rules allow
for the model on the cluster, ranked by the analytic model's step time among those that fit
(mlm_jax/plan/analytic.py); pure Python. The best few are then compiled for the target by the
plan's own compile path, one subprocess each (`confirm`).

What is varied: tensor (powers of two within a node, dividing heads and groups), pipeline
(dividing the layers), context (1-8, when the sequence splits into 2*cp chunks), expert (dividing
experts and data), virtual stages (1-4 with a pipeline), micro batch (powers of two dividing
global batch / dp), recompute (none, selective where attention is unfused: it recomputes only the scores, full
uniform 1), FSDP (`optim_grads_params`, without a pipeline) against ZeRO-1. Always on where they apply:
--sequence-parallel with tensor > 1 (same bytes moved as the all-reduce, activations /t: [K]
4.2.2), --use-distributed-optimizer with data > 1 (less memory and fewer bytes than the
all-reduce: [R]). A layout is valid when `validation.finalize` accepts it: the rules training
applies, so no rule is written twice.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile

from mlm_jax.errors import UsageError
from mlm_jax.plan import analytic
from mlm_jax.plan.analytic import GIB, Layout

# The flags the search sets, with whether each takes a value; stripped from the user's argv when
# the winner's command line is written (aliases included).
LAYOUT_FLAGS = {
    "--tensor-model-parallel-size": True, "--pipeline-model-parallel-size": True,
    "--context-parallel-size": True, "--expert-model-parallel-size": True,
    "--num-virtual-stages-per-pipeline-rank": True, "--num-layers-per-virtual-pipeline-stage": True,
    "--sequence-parallel": False, "--use-distributed-optimizer": False, "--micro-batch-size": True,
    "--recompute-granularity": True, "--recompute-method": True, "--recompute-num-layers": True,
    "--pipeline-schedule": True, "--use-megatron-fsdp": False, "--data-parallel-sharding-strategy": True,
}

# The user's flags that need the distributed optimizer: left out of a layout without it (no data
# parallelism to shard over), as Megatron refuses them there.
ZERO_ONLY = ("--overlap-param-gather",)


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def candidates(cfg, gpus: int, per_node: int) -> list[Layout]:
    """Every layout the search considers (before validation)."""
    m, t = cfg.model, cfg.train
    gbs = t.global_batch_size
    if not gbs:
        raise UsageError("--search needs --global-batch-size B (the batch the layouts must split)")
    out = []
    for tp in _powers_of_two(min(per_node, gpus)):
        for pp in [p for p in range(1, m.num_layers + 1) if m.num_layers % p == 0 and gpus % (tp * p) == 0]:
            for cp in [c for c in (1, 2, 4, 8) if t.seq_length % (2 * c) == 0 and gpus % (tp * pp * c) == 0]:
                if cp > 1 and t.seq_length < 8192:
                    continue  # context parallelism pays off only for long sequences (Megatron's guidance)
                dp = gpus // (tp * pp * cp)
                eps = [e for e in _powers_of_two(dp) if m.num_experts and m.num_experts % e == 0] or [1]
                vps = [1] + ([v for v in (2, 3, 4) if m.num_layers % (pp * v) == 0] if pp > 1 else [])
                for ep in eps:
                    for vp in vps:
                        for micro in _powers_of_two(gbs // dp if gbs % dp == 0 else 0):
                            if (gbs // dp) % micro:
                                continue
                            # FSDP (optim_grads_params) beside ZeRO-1 where there is data to
                            # shard over and no pipeline (after it: a tie keeps ZeRO-1's fewer bytes)
                            shards = [None] + (["optim_grads_params"] if dp // ep > 1 and pp == 1 else [])
                            for rec in (None, "selective", "full"):
                                for fsdp in shards:
                                    out.append(Layout(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, vp=vp, sp=tp > 1,
                                                      zero=dp > 1, micro=micro, microbatches=gbs // (micro * dp),
                                                      recompute=rec, fsdp=fsdp))
    return out


def config_of(cfg, L: Layout):
    """`cfg` with layout `L`'s flags (not finalized)."""
    p = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=L.tp, pipeline_model_parallel_size=L.pp,
                            context_parallel_size=L.cp, expert_model_parallel_size=L.ep,
                            virtual_pipeline_model_parallel_size=L.vp if L.vp > 1 else None,
                            num_layers_per_virtual_pipeline_stage=None, sequence_parallel=L.sp,
                            use_distributed_optimizer=L.zero, pipeline_schedule=None,
                            use_megatron_fsdp=L.fsdp is not None,
                            data_parallel_sharding_strategy=L.fsdp or "optim_grads_params",
                            expert_tensor_parallel_size=None,
                            overlap_param_gather=cfg.parallel.overlap_param_gather and L.zero)
    full = L.recompute == "full"
    m = dataclasses.replace(cfg.model, recompute_granularity=L.recompute,
                            recompute_method="uniform" if full else None, recompute_num_layers=1 if full else None,
                            padded_vocab_size=None)
    return cfg.replace(parallel=p, model=m, train=dataclasses.replace(cfg.train, micro_batch_size=L.micro))


def search(cfg, gpus: int, per_node: int, hw: analytic.Hardware, usable: int) -> list[dict]:
    """Every valid layout with its prediction, best first: those that fit by predicted step
    time, then those that do not by memory."""
    from mlm_jax.validation import finalize

    rows = []
    for L in candidates(cfg, gpus, per_node):
        try:
            c = finalize(config_of(cfg, L), gpus)
        except UsageError:
            continue
        if L.recompute == "selective" and analytic.fused_attention(c, L):
            continue  # selective recompute drops only unfused attention's scores: the same layout
        pred = analytic.predict(c, L, hw, gpus, per_node)
        rows.append({"layout": L, "cfg": c, "fits": pred["memory"]["total"] <= usable, **pred})
    rows.sort(key=lambda r: (not r["fits"], r["step_seconds"] if r["fits"] else r["memory"]["total"]))
    return rows


def layout_flags(L: Layout) -> list[str]:
    """The training flags of layout `L`."""
    out = ["--tensor-model-parallel-size", str(L.tp), "--pipeline-model-parallel-size", str(L.pp)]
    if L.cp > 1:
        out += ["--context-parallel-size", str(L.cp)]
    if L.ep > 1:
        out += ["--expert-model-parallel-size", str(L.ep)]
    if L.vp > 1:
        out += ["--num-virtual-stages-per-pipeline-rank", str(L.vp)]
    if L.sp:
        out.append("--sequence-parallel")
    if L.fsdp:
        out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", L.fsdp]
    elif L.zero:
        out.append("--use-distributed-optimizer")
    out += ["--micro-batch-size", str(L.micro)]
    if L.recompute == "full":
        out += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif L.recompute:
        out += ["--recompute-granularity", L.recompute]
    return out


def train_argv(base: list[str], L: Layout) -> list[str]:
    """The user's training flags with the search's layout flags in place of theirs."""
    from mlm_jax.flag_aliases import ALIASES

    out, i = [], 0
    while i < len(base):
        flag, _, inline = base[i].partition("=")
        name = ALIASES.get(flag, flag)
        if name in LAYOUT_FLAGS or (name in ZERO_ONLY and not L.zero):
            i += 1 if (inline or not LAYOUT_FLAGS.get(name, False)) else 2
            continue
        out.append(base[i])
        i += 1
    return out + layout_flags(L)


def describe(L: Layout) -> str:
    """`tp2 x pp4 x dp8 + v4 SP ZeRO`: the sizes over 1, then the options."""
    sizes = [f"{k}{v}" for k, v in (("tp", L.tp), ("pp", L.pp), ("cp", L.cp), ("ep", L.ep), ("dp", L.dp)) if v > 1]
    extras = ([f"v{L.vp}"] if L.vp > 1 else []) + (["SP"] if L.sp else []) + (
        ["FSDP"] if L.fsdp else ["ZeRO"] if L.zero else [])
    return (" x ".join(sizes) or "one device") + (" + " + " ".join(extras) if extras else "")


def _comm_text(comm: dict) -> str:
    return ", ".join(f"{axis} {b / GIB:.1f}" for axis, b in comm.items()) or "-"


def table(rows: list[dict], top: int, compiled: dict | None = None) -> str:
    """The top rows as the table `--search` prints."""
    compiled = compiled or {}
    head = (f"{'#':>3}  {'layout':<32} {'micro':>5} {'recompute':<9} {'GiB/dev':>7} {'compiled':>8} "
            f"{'tokens/s':>10} {'MFU':>5} {'bubble':>6}  comm GiB/step/device")
    lines = [head]
    for i, r in enumerate(rows[:top]):
        L = r["layout"]
        got = compiled.get(i)
        got_text = f"{got:.2f}" if isinstance(got, float) else (got or "")
        lines.append(f"{i + 1:>3}  {describe(L):<32} {L.micro:>5} {L.recompute or '-':<9} "
                     f"{r['memory']['total'] / GIB:>7.2f} {got_text:>8} {r['tokens_per_second']:>10,.0f} "
                     f"{r['mfu']:>5.1%} {r['bubble']:>6.1%}  {_comm_text(r['communication'])}"
                     + ("" if r["fits"] else "  (does not fit)"))
    return "\n".join(lines)


def row_json(r: dict, base_argv: list[str]) -> dict:
    L = r["layout"]
    return {"layout": dataclasses.asdict(L), "describe": describe(L), "fits": r["fits"],
            "predicted_bytes": {k: int(v) for k, v in r["memory"].items()},
            "communication_bytes": {k: int(v) for k, v in r["communication"].items()},
            "bubble": r["bubble"], "step_seconds": r["step_seconds"], "tokens_per_second": r["tokens_per_second"],
            "mfu": r["mfu"], "train_argv": train_argv(base_argv, L)}


def confirm(row: dict, base_argv: list[str], gpu: str, gpus: int, per_node: int, timeout: float | None = None) -> dict:
    """Compile `row`'s layout for the target in a subprocess (`python -m mlm_jax.plan`, which sets
    the GPU run's XLA flags for its own layout before jax starts); its report's memory, or why not
    (also when it takes over `timeout` seconds: the compile is stopped)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "plan.json")
        cmd = [sys.executable, "-m", "mlm_jax.plan", "--gpu", gpu, "--gpus", str(gpus), "--gpus-per-node",
               str(per_node), "--json", path, *train_argv(base_argv, row["layout"])]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the compile took over {timeout:g} s (--confirm-timeout) and was stopped"}
        if os.path.exists(path):
            with open(path) as f:
                r = json.load(f)
            return {"compiled_bytes": r["per_device_bytes"]["total"], "fits": r["fits"],
                    "compile_seconds": r["compile_seconds"]}
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        return {"error": errors[-1] if errors else f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}


def command_line(base_argv: list[str], L: Layout) -> str:
    return "python -m mlm_jax.train " + " ".join(shlex.quote(a) for a in train_argv(base_argv, L))
