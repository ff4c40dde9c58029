"""Pipeline schedule figures: cost, bubble, per-device memory and step time per schedule and m.

    python benchmarks/pipeline.py [--stages 4] [--microbatches 4 8 16] [--hidden 256]
        [--layers 8] [--seq 128] [--micro-batch 1] [--steps 5] [--out runs/benchmarks/pipeline.json]

For each schedule (GPipe, 1F1B, interleaved 1F1B with 2 chunks per stage) and each number of
microbatches m, on P pipeline stages x the remaining devices as data parallel:
  - the program the runtime compiles (mlm_jax/pipeline/lockstep.py): ticks, phases, and its
    lockstep cost -- every tick of a phase runs the phase's forward and/or backward slot on every
    stage, so the sum over phases of ticks x (F_c + B_c) with a stage forward costing 1 and a
    backward 3 (the stage forward recomputed, then the backward: ~2 forwards), chunk costs /V --
    against (m*V + P - 1) * 4 / V, what an asynchronous (Megatron, MPMD) executor of Megatron's
    order takes in the same unit model. They are equal for every schedule. For reference, the
    previous runtime (one action per tick, Megatron's table) cost the table's sum over ticks of
    the slowest action ("one-action" column);
  - the masked fraction of slot runs (a slot with no unit runs masked) against the bubble
    formula (P-1)/(m*V + P - 1);
  - the stage-input stash the runtime allocates (slots, from the program) and its bytes per
    device: flat in m for 1F1B and interleaved, m for GPipe;
  - per-device temp bytes of the compiled forward-backward (`loss_and_grads`: the whole
    schedule; XLA's memory analysis, where params and batch are arguments, not temp), and its
    growth over the smallest m;
  - its wall time (median of --steps after a warm-up call) and tokens/s, the schedules of one
    m timed in turns (one step of each per round: a drift in the machine's speed then falls on
    all of them alike), and 1F1B's step time over GPipe's. The optimizer update that follows
    in a train step does not depend on the schedule.

Without --devices the run makes 8 fake CPU devices (set before jax is imported). On the fake
CPU mesh every "device" shares the host's cores, so step time there tracks total work (the
same for every schedule at the same m: a masked slot costs as much as a real one), not the
bubble; the lockstep cost is what a device per stage would see.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if "--devices" not in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "--devices" not in sys.argv:
    from mlm_jax.xla_flags import cpu_collective_threads  # noqa: E402  (before jax starts)

    cpu_collective_threads(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mlm_jax.config import (  # noqa: E402
    Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig,
)
from mlm_jax.build import parallelize  # noqa: E402
from mlm_jax.pipeline import lockstep, schedules  # noqa: E402
from mlm_jax.sharding import make_mesh  # noqa: E402
from mlm_jax.validation import finalize  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
BACKWARD_COST = 3.0  # recompute (1 forward) + backward (~2 forwards)


def one_action_cost(table, V: int) -> float:
    """The previous runtime (one action per tick, Megatron's table): sum over ticks of the
    slowest stage's action, in units of one whole-stage forward."""
    cost = {"F": 1.0 / V, "B": BACKWARD_COST / V, "idle": 0.0}
    return sum(max(cost[a.kind] for a in row) for row in table)


def config(args, schedule: str, V: int, m: int, dp: int) -> Config:
    return Config(
        model=ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                          num_attention_heads=max(1, args.hidden // 64), vocab_size=args.vocab,
                          max_position_embeddings=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                          untie_embeddings_and_output_weights=args.untied),
        parallel=ParallelConfig(pipeline_model_parallel_size=args.stages, pipeline_schedule=schedule,
                                virtual_pipeline_model_parallel_size=V if V > 1 else None),
        optim=OptimConfig(lr=1e-4, lr_decay_style="constant"),
        train=TrainConfig(micro_batch_size=args.micro_batch, global_batch_size=m * args.micro_batch * dp,
                          seq_length=args.seq, train_iters=10),
    )


def batch_for(pz, seed: int) -> dict:
    m, rows, seq = pz.batch_shape()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, pz.cfg.model.vocab_size, (m, rows, seq + 1))
    host = {
        "tokens": tokens[..., :-1].astype(np.int32),
        "labels": tokens[..., 1:].astype(np.int32),
        "loss_mask": np.ones((m, rows, seq), np.float32),
        "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int32), (m, rows, seq)).copy(),
    }
    return {k: jax.device_put(v, pz.batch_sharding()) for k, v in host.items()}


def prepare(args, schedule: str, V: int, m: int):
    """(one call of the compiled forward-backward of `schedule` at m, its figures but time)."""
    devices = jax.devices()
    dp = len(devices) // args.stages
    cfg = finalize(config(args, schedule, V, m, dp), len(devices))
    pz = parallelize(cfg, make_mesh(cfg.parallel, devices))
    program = pz.pipeline.program(m)
    P = args.stages
    table = program.table
    rows_per_device = args.micro_batch  # one microbatch's rows on one data-parallel rank
    slot_bytes = rows_per_device * args.seq * args.hidden * 4  # fp32 [b, s, d]
    state = pz.init(0)
    batch = batch_for(pz, 0)
    t0 = time.perf_counter()
    params = state["params"]
    compiled = pz.loss_and_grads.lower(params, batch, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t0
    memory = compiled.memory_analysis()

    def step(i: int) -> float:
        """Run step i (0: the warm-up); its loss."""
        loss, grads = compiled(params, batch, jax.random.key(i))
        jax.block_until_ready(grads)
        return float(loss)

    row = {
        "schedule": schedule, "stages": P, "chunks": V, "microbatches": m, "data_parallel": dp,
        "ticks": program.ticks,
        "phases": [(p.ticks, p.forward, p.backward) for p in program.phases],
        "masked_fraction": 1 - 2 * m * V * P / sum(p.ticks * P * (p.forward + p.backward)
                                                   for p in program.phases),
        "idle_fraction_formula": schedules.ideal_idle_fraction(P, m, V),
        "lockstep_cost": lockstep.lockstep_cost(table, V, 1.0, BACKWARD_COST),
        "async_cost": lockstep.async_cost(P, m, V, 1.0, BACKWARD_COST),
        "one_action_cost": one_action_cost(schedules.build_schedule(schedule, P, m, V), V),
        "stash_slots": program.num_stash_slots,
        "stash_per_stage": list(lockstep.stash_in_flight(table, P)),
        "stash_bytes": program.num_stash_slots * slot_bytes,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "compile_s": compile_s,
        "tokens": m * rows_per_device * dp * args.seq,
    }
    return step, row


def time_alternating(steps: dict, rounds: int) -> tuple[dict, dict]:
    """Wall time of each schedule's step, the schedules taking turns: round r runs step r of
    each, so a drift in the machine's speed (other load, thermal, the fake devices' threads)
    falls on all of them alike instead of on whichever ran last.
    -> ({name: [seconds]}, {name: loss of its last step})."""
    losses = {name: step(0) for name, step in steps.items()}  # warm-up
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            losses[name] = step(r + 1)
            times[name].append(time.perf_counter() - t0)
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--untied", action="store_true", help="untied embedding and LM head (Llama-style)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--devices", action="store_true", help="use the real devices, not 8 fake CPUs")
    parser.add_argument("--out", default="runs/benchmarks/pipeline.json")
    args = parser.parse_args()

    rows = []
    header = (f"{'schedule':<16}{'m':>4}{'ticks':>7}{'masked':>8}{'formula':>9}{'stash':>7}"
              f"{'stash KiB':>10}{'temp KiB':>10}{'d temp':>9}{'step ms':>9}{'tok/s':>9}"
              f"{'lockstep':>10}{'async':>7}{'1-action':>10}")
    print(f"P={args.stages} stages, {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"layers {args.layers}, hidden {args.hidden}, seq {args.seq}, micro batch {args.micro_batch}, "
          f"vocab {args.vocab}{' untied' if args.untied else ''}")
    print(header)
    print("-" * len(header))
    base = {}
    for m in args.microbatches:
        steps, figures = {}, {}
        for schedule, V in SCHEDULES:
            if schedule == "interleaved" and m % args.stages:
                continue
            name = schedule + (f" V={V}" if V > 1 else "")
            steps[name], figures[name] = prepare(args, schedule, V, m)
        times, losses = time_alternating(steps, args.steps)
        for name, r in figures.items():
            r["step_times_s"] = times[name]
            r["step_s"] = float(np.median(times[name]))
            r["tokens_per_s"] = r["tokens"] / r["step_s"]
            r["loss"] = losses[name]
            base.setdefault(name, r["temp_bytes"])
            r["temp_growth_bytes"] = r["temp_bytes"] - base[name]
            rows.append(r)
            print(f"{name:<16}{m:>4}{r['ticks']:>7}{r['masked_fraction']:>8.3f}"
                  f"{r['idle_fraction_formula']:>9.3f}{r['stash_slots']:>7}{r['stash_bytes'] / 1024:>10.0f}"
                  f"{r['temp_bytes'] / 1024:>10.0f}{r['temp_growth_bytes'] / 1024:>+9.0f}"
                  f"{r['step_s'] * 1e3:>9.1f}{r['tokens_per_s']:>9.0f}"
                  f"{r['lockstep_cost']:>10.0f}{r['async_cost']:>7.0f}{r['one_action_cost']:>10.0f}",
                  flush=True)
        if "gpipe" in figures and "1f1b" in figures:
            ratio = figures["1f1b"]["step_s"] / figures["gpipe"]["step_s"]
            print(f"  m={m}: 1F1B / GPipe step time {ratio:.3f}", flush=True)
    out = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "jax": jax.__version__,
                    "devices": [str(d) for d in jax.devices()]},
        "args": vars(args), "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
