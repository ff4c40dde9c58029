"""Workload W on this machine: `python -m mlm_jax.train` against a plain `jax.jit` train step of
the same model, one device, fp32.

W: 4 layers, hidden 256, 8 heads, ffn 1024, vocab 8192, seq 256, batch 8, AdamW, no dropout.
The plain step is the least a JAX program can do for W: the same GPT module's loss, optax's
AdamW, one jit with donated state, one fixed batch already on the device, no microbatch loop,
no logging. The CLI run adds everything a real run has (data loading, the step loop with one
step in flight, --log-interval 1 logging every step, metrics file, TensorBoard). The `scan`
variant of the plain step keeps the layer scan that a CPU unrolls for W's 4 layers
(`recompute._UNROLLED_LAYERS`).

    python benchmarks/workload_w.py [--steps 20] [--rounds 1] [--variants plain,scan] [--no-cli]
        [--torch-python /tmp/torchvenv/bin/python]   # + benchmarks/torch_reference.py's figures
    python benchmarks/workload_w.py --profile [--torch-python ...]   # where one step's time goes
    python benchmarks/workload_w.py --ab keep-host-memory --steps 12    # a change's A/B in one process
    python benchmarks/workload_w.py --ab-rev REV:mlm_jax/models/attention.py:_attend_causal --steps 12
        # this tree against those functions of that file as at git revision REV, in one process

Prints a table (tokens/s, ratio CLI / plain) and writes JSON under benchmarks/results/.
Run it with nothing else on the machine; the load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("MLM_JAX_CPU_DEVICES", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlm_jax.xla_flags import keep_host_memory  # noqa: E402  (imports no jax)

keep_host_memory()  # the plain step's process keeps freed memory as every mlm_jax command does
if "--profile" in sys.argv:  # XLA:CPU's per-instruction trace events, read before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

W_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
           "--ffn-hidden-size", "1024", "--vocab-size", "8192", "--seq-length", "256",
           "--max-position-embeddings", "256", "--micro-batch-size", "8", "--global-batch-size", "8",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--lr-warmup-iters", "0"]


def plain_step(scan: bool = False, compiler_options: dict | None = None):
    """W's plain jitted step, compiled, with its state: (run one step and wait for it, the
    compiled program's HLO text). `scan`: keep the layer scan where the model would unroll it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mlm_jax.arguments import parse_args
    from mlm_jax.models.gpt import GPT
    from mlm_jax.optim import apply_lr, lr_for, make_optimizer
    from mlm_jax.validation import finalize

    cfg = finalize(parse_args(W_FLAGS + ["--train-iters", "1000"]), 1)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GPT(cfg.model, nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    tx = make_optimizer(cfg.optim)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, (8, 257)).astype(np.int32)
    batch = {"tokens": jnp.asarray(toks[:, :-1]), "labels": jnp.asarray(toks[:, 1:]),
             "loss_mask": jnp.ones((8, 256), jnp.float32),
             "position_ids": jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32), (8, 256))}

    def loss_fn(p, b):
        loss_sum, _ = nnx.merge(graphdef, p).loss(b, None)
        return loss_sum / jnp.sum(b["loss_mask"])

    def step(p, o, n, b):  # n: the LR scheduler's sample count, as in the train state
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        updates, o = tx.update(g, o, p)
        updates = apply_lr(updates, lr_for(cfg, n))
        return jax.tree.map(jnp.add, p, updates), o, n + 8, loss

    undo = _without_unrolled_layers() if scan else (lambda: None)
    try:
        state = [params, tx.init(params), jnp.zeros((), jnp.int32)]
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*state, batch).compile(compiler_options)
    finally:
        undo()

    def run_one():
        *state[:], loss = compiled(*state, batch)
        jax.block_until_ready(loss)
        return loss

    run_one()
    return run_one, compiled.as_text()


def _plain_runner(steps: int, scan: bool):
    """A function giving the tokens/s of a plain jitted step of W (compiled once): the median of
    `steps` timed steps."""
    run_one, _ = plain_step(scan)

    def tokens_per_s() -> float:
        run_one()  # warm after the other runs of a round
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            run_one()
            times.append(time.perf_counter() - t)
        return 8 * 256 / statistics.median(times)

    return tokens_per_s


def profile_plain_step(steps: int) -> dict:
    """Where the plain step's time goes (benchmarks/step_profile.py), beside the step's own
    median time and the time W's matmul FLOPs would take at the rate XLA:CPU reaches on W's
    largest matmul shape in this process."""
    import jax
    import jax.numpy as jnp

    import step_profile

    run_one, text = plain_step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        run_one()
        times.append(time.perf_counter() - t)
    prof = step_profile.profile(run_one, text, steps=3)
    a = jnp.ones((2048, 256), jnp.float32)
    w = jnp.ones((256, 1024), jnp.float32)
    mm = jax.jit(lambda a, w: a @ w)
    jax.block_until_ready(mm(a, w))
    reps = []
    for _ in range(30):
        t = time.perf_counter()
        jax.block_until_ready(mm(a, w))
        reps.append(time.perf_counter() - t)
    rate = 2 * 2048 * 256 * 1024 / statistics.median(reps)  # FLOP/s
    flops = step_profile.dot_flops(text)
    prof.update(step_ms=1e3 * statistics.median(times), matmul_gflop=flops / 1e9, matmul_gflops_rate=rate / 1e9,
                matmul_bound_ms=1e3 * flops / rate)
    return prof


def _malloc_default(default: bool) -> None:
    """glibc's mmap of large blocks and trimming of the heap as by default (or as
    `keep_host_memory` sets them); the one-arena setting stays (it is fixed at start)."""
    import ctypes

    from mlm_jax import xla_flags

    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt(xla_flags._M_MMAP_MAX, 65536 if default else 0)
    mallopt(xla_flags._M_TRIM_THRESHOLD, 128 * 1024 if default else 2**31 - 1)


# --ab NAME: the plain step without the change NAME against with it. A model change: a function
# that undoes it (before compiling) and returns the function that puts it back. The allocator
# (`keep_host_memory`) is switched before each round instead, on one compiled step. An XLA flag:
# a dict of compile options the before arm is compiled with (XLA_FLAGS is read once per process).
def _without_head_gradient_dv():
    from mlm_jax.models import gpt

    kept, gpt._WEIGHT_GRADIENT_DV = gpt._WEIGHT_GRADIENT_DV, ()
    return lambda: setattr(gpt, "_WEIGHT_GRADIENT_DV", kept)


def _without_causal_blocks():
    from mlm_jax.models import attention

    kept, attention._CAUSAL_BLOCKS = attention._CAUSAL_BLOCKS, {}
    return lambda: setattr(attention, "_CAUSAL_BLOCKS", kept)


def _without_transposed_input():
    from mlm_jax.models import layers

    kept, layers._TRANSPOSED_INPUT = layers._TRANSPOSED_INPUT, ()
    return lambda: setattr(layers, "_TRANSPOSED_INPUT", kept)


def _without_unrolled_layers():
    from mlm_jax.models import recompute

    kept, recompute._UNROLLED_LAYERS = recompute._UNROLLED_LAYERS, {}
    return lambda: setattr(recompute, "_UNROLLED_LAYERS", kept)


WITHOUT = {"keep-host-memory": None, "head-gradient-dv": _without_head_gradient_dv,
           "transposed-input": _without_transposed_input,
           "causal-blocks": _without_causal_blocks, "unrolled-layers": _without_unrolled_layers}


def _at_revision(spec: str):
    """`--ab-rev REV:PATH:NAME[,NAME]`: put the functions NAME of the module file PATH as at git
    revision REV in place of this tree's (before compiling); returns the function that puts
    this tree's back."""
    import importlib
    import importlib.util

    def usage(why: str):
        print(f"workload_w.py: error: --ab-rev {spec}: {why}", file=sys.stderr)
        raise SystemExit(2)

    rev, path, names = spec.split(":")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
    if source.returncode:
        usage(source.stderr.strip())
    try:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    except ImportError as e:
        usage(f"{path} is not a module of this tree ({e})")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source.stdout)
    loader = importlib.util.spec_from_file_location(f"{module.__name__}_at_{rev}", f.name)
    old = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(old)
    finally:
        os.unlink(f.name)
    missing = [n for n in names.split(",") if not (hasattr(module, n) and hasattr(old, n))]
    if missing:
        usage(f"NAME must be in {path} both at {rev} and in this tree; {', '.join(missing)} is not")
    kept = {n: getattr(module, n) for n in names.split(",")}
    for n in kept:
        setattr(module, n, getattr(old, n))
    return lambda: [setattr(module, n, v) for n, v in kept.items()]


def ab_plain_step(name: str, rounds: int) -> dict:
    """Both arms in this process, `rounds` alternating rounds of 2 steps each (before, after,
    after, before, ...): the median ms per step of each, its page faults and kernel time per
    step, and the load."""
    import resource

    without = functools.partial(_at_revision, name) if name.count(":") == 2 else WITHOUT[name]
    if without is None:
        after, _ = plain_step()
        before = after
    elif isinstance(without, dict):
        before, _ = plain_step(compiler_options=without)
        after, _ = plain_step()
    else:
        undo = without()
        try:
            before, _ = plain_step()
        finally:
            undo()
        after, _ = plain_step()
    times = {"before": [], "after": []}
    faults = {"before": 0, "after": 0}
    kernel = {"before": 0.0, "after": 0.0}
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        for arm in (("before", "after") if r % 2 == 0 else ("after", "before")):
            if without is None:
                _malloc_default(arm == "before")
            run = before if arm == "before" else after
            run()  # the arm's first step after a switch is not counted
            u0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            run()
            run()
            times[arm].append((time.perf_counter() - t) / 2)
            u1 = resource.getrusage(resource.RUSAGE_SELF)
            faults[arm] += (u1.ru_minflt - u0.ru_minflt) / 2 / rounds
            kernel[arm] += (u1.ru_stime - u0.ru_stime) / 2 / rounds * 1e3
    if without is None:
        _malloc_default(False)
    load.append(os.getloadavg()[0])
    return {arm: 1e3 * statistics.median(ts) for arm, ts in times.items()} | {
        "min": {arm: 1e3 * min(ts) for arm, ts in times.items()}, "faults": faults, "kernel_ms": kernel, "load": load}


def print_profile(prof: dict, top: int = 15) -> None:
    print(f"plain step: {prof['step_ms']:.0f} ms median; traced {prof['traced_ms']:.0f} ms/step, of which "
          f"{prof['op_ms']:.0f} ms with an HLO instruction running (the rest: untraced async thunks, runtime, host)")
    print(f"matmul bound: {prof['matmul_gflop']:.2f} GFLOP of matmuls at {prof['matmul_gflops_rate']:.0f} GFLOP/s "
          f"([2048,256]@[256,1024], this process) = {prof['matmul_bound_ms']:.0f} ms")
    for key, title in (("area", "where (source)"), ("kind", "what (HLO)")):
        print(f"| {title} | ms/step | % of traced |\n|---|---|---|")
        for name, ms in sorted(prof[key].items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {ms:.1f} | {100 * ms / prof['traced_ms']:.0f} |")
        gap = prof["traced_ms"] - prof["op_ms"]
        print(f"| (no instruction traced) | {gap:.1f} | {100 * gap / prof['traced_ms']:.0f} |")
    print(f"| top {top} instructions | ms/step | kind | area | source |\n|---|---|---|---|---|")
    for name, ms, kind, area, where in prof["ops"][:top]:
        print(f"| {name} | {ms:.1f} | {kind} | {area} | {where} |")


def cli_tps(steps: int) -> tuple[float, list[float]]:
    """Tokens/s of `python -m mlm_jax.train` for W with --log-interval 1: the median of the
    logged iterations after the first two (the metrics file's tokens_per_sec)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "mlm_jax.train", *W_FLAGS, "--train-iters", str(steps + 2),
                "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1",
                "--sample-tokens", "0", "--no-progress-bar", "--run-dir", os.path.join(tmp, "run"),
                "--peak-flops-per-device", "1e11"]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in open(os.path.join(tmp, "run", "metrics.jsonl"))]
    tps = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][2:]
    return statistics.median(tps), tps


def torch_run(python: str, steps: int, compiled: bool, profile: bool = False) -> dict:
    """`benchmarks/torch_reference.py`'s JSON line (nanoGPT-style W step) under `python`."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_reference.py")
    argv = [python, script, "--steps", str(steps)] + ([] if compiled else ["--no-compile"]) + \
        (["--profile"] if profile else [])
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def torch_tps(python: str, steps: int, compiled: bool) -> float:
    return torch_run(python, steps, compiled)["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1, help="run every row this many times, alternating "
                    "the order; each row's median")
    ap.add_argument("--variants", default="plain,scan")
    ap.add_argument("--no-cli", action="store_true")
    ap.add_argument("--torch-python", help="a Python with torch: also run benchmarks/torch_reference.py "
                    "(torch.compile and eager) for the ratio")
    ap.add_argument("--profile", action="store_true", help="instead: where the plain step's time goes "
                    "(and torch.compile's, with --torch-python)")
    ap.add_argument("--ab", choices=sorted(WITHOUT), help="instead: the plain step without this change "
                    "against with it, alternating in one process (--steps rounds)")
    ap.add_argument("--ab-rev", metavar="REV:PATH:NAME[,NAME]", help="instead: the plain step with the "
                    "functions NAME of PATH as at git revision REV against this tree, as --ab")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.ab_rev is not None and args.ab_rev.count(":") != 2:
        ap.error(f"--ab-rev {args.ab_rev}: expected REV:PATH:NAME[,NAME], e.g. "
                 "HEAD~1:mlm_jax/models/attention.py:_attend_causal")
    if args.profile:
        profile_main(args)
        return
    if args.ab or args.ab_rev:
        r = ab_plain_step(args.ab or args.ab_rev, args.steps)
        print(f"{args.ab or args.ab_rev}: plain step {r['before']:.1f} ms without -> {r['after']:.1f} ms with "
              f"({100 * (r['after'] / r['before'] - 1):+.1f} %; fastest round {r['min']['before']:.1f} -> "
              f"{r['min']['after']:.1f} ms), {args.steps} alternating rounds, "
              f"load average {min(r['load']):.1f}-{max(r['load']):.1f}; page faults per step "
              f"{r['faults']['before']:,.0f} -> {r['faults']['after']:,.0f}, kernel time per step "
              f"{r['kernel_ms']['before']:.0f} -> {r['kernel_ms']['after']:.0f} ms")
        return
    # Every run once per round, the order reversed every other round; a row's figure is the
    # median over the rounds (this machine's speed drifts by 10 % between minutes).
    runs = {}
    for v in args.variants.split(","):
        runs[f"plain jax.jit step ({'layer scan' if v == 'scan' else 'as the model runs'})"] = \
            _plain_runner(args.steps, v == "scan")
    if not args.no_cli:
        runs["python -m mlm_jax.train --log-interval 1"] = lambda: cli_tps(args.steps)[0]
    if args.torch_python:
        for compiled in (True, False):
            runs[f"nanoGPT-style PyTorch step ({'torch.compile' if compiled else 'eager'})"] = \
                functools.partial(torch_tps, args.torch_python, args.steps, compiled)
    rounds = {name: [] for name in runs}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            rounds[name].append(runs[name]())
            load.append(os.getloadavg()[0])
    rows = {name: statistics.median(tps) for name, tps in rounds.items()}
    base = next(iter(rows.values()))
    print(f"workload W, one CPU device, {args.steps} timed steps each, {args.rounds} round(s); load average "
          f"{min(load):.1f}-{max(load):.1f} during the runs")
    print("| run | tokens/s | / first row | each round |\n|---|---|---|---|")
    for name, tps in rows.items():
        print(f"| {name} | {tps:,.0f} | {tps / base:.2f} | {' / '.join(f'{x:,.0f}' for x in rounds[name])} |")
    cli, torch_compiled = "python -m mlm_jax.train --log-interval 1", "nanoGPT-style PyTorch step (torch.compile)"
    if cli in rounds and torch_compiled in rounds:
        ratios = [a / b for a, b in zip(rounds[cli], rounds[torch_compiled])]
        print(f"python -m mlm_jax.train / torch.compile: {rows[cli] / rows[torch_compiled]:.2f} (medians); "
              f"per round {', '.join(f'{x:.2f}' for x in ratios)}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "workload_w.json"), "w") as f:
        json.dump({"tokens_per_sec": rows, "rounds": rounds, "load_average": load, "steps": args.steps}, f, indent=2)


def profile_main(args) -> None:
    load = [os.getloadavg()[0]]
    prof = profile_plain_step(args.steps)
    load.append(os.getloadavg()[0])
    print(f"workload W, one CPU device; load average {min(load):.1f}-{max(load):.1f}")
    print_profile(prof)
    result = {"jax": {k: v for k, v in prof.items() if k != "ops"} | {"top_ops": prof["ops"][:40]}, "load_average": load}
    if args.torch_python:
        torch = torch_run(args.torch_python, args.steps, True, profile=True)
        load.append(os.getloadavg()[0])
        print(f"torch.compile step: {torch['step_ms']:.0f} ms median; profiled step, self CPU time by op "
              f"(both threads summed, so it can exceed the step):")
        print("| op | ms/step |\n|---|---|")
        for name, ms in torch["profile"][:15]:
            print(f"| {name} | {ms:.1f} |")
        result["torch"] = torch
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "workload_w_profile.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
