"""`python -m mlm_jax.plan --gpu h100 --gpus 8 [--gpus-per-node 8] [--json FILE] [--dump-hlo FILE]
<the training flags>`: compile, on this machine and without a GPU, exactly the train step that
`python -m mlm_jax.train` with the same flags compiles on that cluster, say whether it fits, and
estimate its step time from the compiled program's kernels beside the analytic model's.

`--search` (pure Python, no compile but the confirmations): every valid layout of the model on the
cluster ranked by the analytic model (mlm_jax/plan/analytic.py) among those predicted to fit; the
top ones as a table, the best `--confirm K` compiled (default 2) with compiled GiB beside the
prediction, and the winner as a training command line. Exit 0: a layout fits; 1: none does.

Exit 0: it compiles and fits; 1: it does not fit (one `error:` line saying by how much and which
flags would help) or does not compile; 2: bad flags. Needs the compile-only CUDA wheels
(`pip install -e ".[gpu-compile]"`; no GPU or driver).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from mlm_jax.cli import cli
from mlm_jax.errors import RunFailure, UsageError

# Vocab sizes of tokenizers whose files may not be on the planning machine.
_KNOWN_VOCAB = {"GPT2BPETokenizer": 50257, "Llama2Tokenizer": 32000, "Llama3Tokenizer": 128256}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"mlm_jax.plan: {message}")


def _own_parser() -> argparse.ArgumentParser:
    from mlm_jax.plan.targets import GPUS

    p = _Parser(prog="python -m mlm_jax.plan", allow_abbrev=False, add_help=False,
                description="Compile the train step for a GPU cluster on this machine (deviceless).")
    p.add_argument("--gpu", default="h100", help=f"the GPU: {', '.join(GPUS)} (default h100)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the cluster (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--json", default=None, help="write the report as JSON to this file")
    p.add_argument("--dump-hlo", default=None, help="write the optimised GPU HLO text to this file")
    p.add_argument("--search", action="store_true",
                   help="rank every valid layout by predicted step time (tensor, pipeline, context, expert, "
                        "virtual stages, micro batch, recompute); the training flags give the model and batch")
    p.add_argument("--top", type=int, default=10, help="--search: rows of the table (default 10)")
    p.add_argument("--confirm", type=int, default=2,
                   help="--search: compile the best K for the target (default 2; 0: the analytic ranking only)")
    p.add_argument("--confirm-timeout", type=float, default=1800,
                   help="--search: seconds one confirming compile may take before the next is tried (default 1800)")
    p.add_argument("--nvlink-gbps", type=float, default=None, help="--search: GB/s per GPU inside a node")
    p.add_argument("--network-gbps", type=float, default=None, help="--search: GB/s per GPU between nodes")
    p.add_argument("--efficiency", type=float, default=None,
                   help="--search: fraction of the bf16 peak the matmuls reach (default 0.6)")
    p.add_argument("-h", "--help", action="store_true")
    return p


def _with_vocab(cfg, train_argv: list[str]):
    """`cfg` with the vocab size training would learn from the tokenizer (before it is
    finalized, as training does): --vocab-size when given, the tokenizer's own when its files are
    here, a known size for Megatron's standard tokenizers."""
    import dataclasses

    d = cfg.data
    if "--vocab-size" in train_argv or d.tokenizer_type in (None, "NullTokenizer"):
        return cfg
    files = [f for f in (d.tokenizer_model, d.vocab_file, d.merge_file) if f]
    if files and all(os.path.exists(f) for f in files):
        from mlm_jax.data.tokenizers import build_tokenizer

        size = build_tokenizer(d).vocab_size
    elif d.tokenizer_type in _KNOWN_VOCAB:
        size = _KNOWN_VOCAB[d.tokenizer_type]
    else:
        raise UsageError(f"--tokenizer-type {d.tokenizer_type}: its files are not on this machine; give "
                         "--vocab-size N (the tokenizer's vocab size) to plan without them")
    model = dataclasses.replace(cfg.model, vocab_size=size, padded_vocab_size=None)
    return cfg.replace(model=model)


def _writable(path: str | None, flag: str) -> None:
    if path:
        from mlm_jax.paths import writable_file

        writable_file(os.path.abspath(path), flag)


@cli
def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train_argv = _own_parser().parse_known_args(argv)
    if own.help:
        _own_parser().print_help()
        print("\nEvery other flag is a training flag (python -m mlm_jax.train --help).")
        return 0
    from mlm_jax.arguments import parse_args
    from mlm_jax.plan.targets import check_cluster, gpu, plugin_missing

    target = gpu(own.gpu)
    check_cluster(own.gpus, own.gpus_per_node)  # before any parsing or compiling
    _writable(own.json, "--json")
    _writable(own.dump_hlo, "--dump-hlo")
    cfg = parse_args(train_argv)
    if own.search:
        return _search(cfg, train_argv, own, target)
    why = plugin_missing()
    if why:
        raise UsageError(why)

    from mlm_jax import xla_flags

    xla_flags.apply(cfg.parallel, gpu=True)  # the flags a GPU run sets, before JAX starts
    import jax

    # The process's own backend is the CPU (the devices compiled for are compile-only): with the
    # CUDA plugin active its version check calls cuInit, which fails without a driver.
    jax.config.update("jax_platforms", "cpu")
    return _plan(cfg, train_argv, own, target)


def _positive_search_flags(own) -> None:
    for flag, value, low in (("--top", own.top, 1), ("--confirm", own.confirm, 0)):
        if value < low:
            raise UsageError(f"--{flag[2:]} {value}: must be {low} or more")
    for flag, value in (("--nvlink-gbps", own.nvlink_gbps), ("--network-gbps", own.network_gbps)):
        if value is not None and not value > 0:
            raise UsageError(f"{flag} {value}: must be a positive bandwidth in GB/s")
    if not own.confirm_timeout > 0:
        raise UsageError(f"--confirm-timeout {own.confirm_timeout}: must be a positive number of seconds")
    if own.efficiency is not None and not 0 < own.efficiency <= 1:
        raise UsageError(f"--efficiency {own.efficiency}: must be in (0, 1]")


def _what_would_fit(cfg, rows, gpus: int, per_node: int, hw, usable: int) -> str:
    """Why nothing fits and what would: when even the state without activations (parameters,
    optimizer, gradients) overflows every layout, only more GPUs help (the fewest, doubling, that
    the search finds a fitting layout on); else a smaller batch or sequence helps too."""
    from mlm_jax.plan import search

    def state(r):
        m = r["memory"]
        return m["total"] - m.get("activations", 0) - m.get("logits", 0)

    least = min(state(r) for r in rows)
    only_gpus = least > usable
    # The state shrinks about as 1 / GPUs: start the doubling where it would fit, then confirm
    # (at most three searches: each is a few seconds to minutes on a large model).
    k = max(1, math.ceil(math.log2(least / usable))) if least > usable else 1
    more = None
    for g in (gpus * 2 ** k, gpus * 2 ** (k + 1), gpus * 2 ** (k + 2)):
        if cfg.train.global_batch_size and any(r["fits"] for r in search.search(cfg, g, per_node, hw, usable)):
            more = g
            break
    fewest = f" (about {more}: the fewest, doubling, on which the search finds one)" if more else ""
    if only_gpus:
        return (f"the parameters and optimizer state alone overflow every layout, so only more GPUs would fit it"
                f"{fewest}; a smaller batch or sequence would not")
    return f"more GPUs{fewest}, a smaller --global-batch-size or --seq-length would help"


def _search(cfg, train_argv, own, target) -> int:
    from mlm_jax.plan import analytic, search
    from mlm_jax.plan.check import GIB, mem_fraction
    from mlm_jax.plan.targets import check_cluster, plugin_missing

    _positive_search_flags(own)
    per_node = check_cluster(own.gpus, own.gpus_per_node)
    if own.confirm and plugin_missing():
        raise UsageError(f"--confirm {own.confirm}: {plugin_missing()}; --confirm 0 ranks without compiling")
    hw = analytic.hardware(target, own.nvlink_gbps, own.network_gbps, own.efficiency)
    usable = int(target.memory_bytes * mem_fraction())
    cfg = _with_vocab(cfg, train_argv)
    rows = search.search(cfg, own.gpus, per_node, hw, usable)
    if not rows:
        raise UsageError(f"--search: no layout of this model is valid on --gpus {own.gpus} with "
                         f"--global-batch-size {cfg.train.global_batch_size} (Megatron's divisibility rules)")
    fitting = sum(r["fits"] for r in rows)
    print(f"> search: {len(rows)} valid layouts on {own.gpus} x {target.description}, {fitting} predicted to fit "
          f"in {usable / GIB:.1f} GiB; assumed {hw.efficiency:.0%} of {hw.bf16_flops / 1e12:.0f} TFLOP/s, NVLink "
          f"{hw.nvlink_bytes / 1e9:.0f} GB/s, network {hw.network_bytes / 1e9:.0f} GB/s per GPU", flush=True)
    compiled = {}
    confirmed = {}
    if own.confirm:
        print(search.table(rows, own.top), flush=True)
        # The best `--confirm` predicted to fit, compiled in order; one that compiles but does not
        # fit (or fails) is replaced by the next, up to twice as many compiles.
        for i in range(min(fitting, 2 * own.confirm)):
            if sum(c.get("fits", False) for c in confirmed.values()) == own.confirm:
                break
            print(f"> compiling #{i + 1} ({search.describe(rows[i]['layout'])}) for {target.description} ...", flush=True)
            confirmed[i] = got = search.confirm(rows[i], train_argv, own.gpu, own.gpus, per_node,
                                                timeout=own.confirm_timeout)
            compiled[i] = got["compiled_bytes"] / GIB if "compiled_bytes" in got else "failed"
            if "error" in got:
                print(f"  #{i + 1} did not compile: {got['error']}", flush=True)
            elif not got["fits"]:
                print(f"  #{i + 1} compiled to {compiled[i]:.2f} GiB: does not fit", flush=True)
    print(search.table(rows, own.top, compiled), flush=True)
    best = next((i for i in range(len(rows)) if rows[i]["fits"]
                 and not (i in confirmed and not confirmed[i].get("fits", False))), None)
    if own.json:
        out = {"gpu": target.name, "gpus": own.gpus, "gpus_per_node": per_node, "usable_bytes": usable,
               "assumptions": {"efficiency": hw.efficiency, "bf16_flops": hw.bf16_flops,
                               "nvlink_bytes_per_s": hw.nvlink_bytes, "network_bytes_per_s": hw.network_bytes},
               "valid_layouts": len(rows), "fitting_layouts": fitting,
               "top": [dict(search.row_json(r, train_argv), **({"compiled": confirmed[i]} if i in confirmed else {}))
                       for i, r in enumerate(rows[:own.top])],
               "best": None if best is None else dict(search.row_json(rows[best], train_argv),
                                                      **({"compiled": confirmed[best]} if best in confirmed else {}))}
        with open(own.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"> report written to {own.json}")
    if best is None:
        raise RunFailure(f"no layout fits {target.description} ({usable / GIB:.1f} GiB usable) on --gpus {own.gpus}: "
                         + _what_would_fit(cfg, rows, own.gpus, per_node, hw, usable))
    if best in confirmed:
        how = f"compiled: {compiled[best]:.2f} GiB per device, fits"
    elif own.confirm:
        failed = any("error" in c for c in confirmed.values())
        how = ("NOT compiled: the layouts ranked above it did not compile (see above) or did not fit; check it "
               "with python -m mlm_jax.plan" if failed else
               "NOT compiled: the layouts ranked above it compiled but did not fit; check it with python -m mlm_jax.plan")
    else:
        how = "predicted only (--confirm 0)"
    print(f"> best: #{best + 1} {search.describe(rows[best]['layout'])} ({how})\n"
          f"{search.command_line(train_argv, rows[best]['layout'])}")
    return 0


def _plan(cfg, train_argv, own, target) -> int:
    from mlm_jax.plan import check
    from mlm_jax.plan.compile import compile_step
    from mlm_jax.plan.targets import check_cluster, devices
    from mlm_jax.validation import finalize

    gpus, per_node = own.gpus, check_cluster(own.gpus, own.gpus_per_node)
    cfg = finalize(_with_vocab(cfg, train_argv), gpus)  # once, knowing the vocab (as training)
    if cfg.parallel.tensor_model_parallel_size > per_node:
        print(f"> note: --tensor-model-parallel-size {cfg.parallel.tensor_model_parallel_size} spans nodes "
              f"({per_node} GPUs per node): its collectives leave NVLink", flush=True)
    from mlm_jax.parallel.fsdp import recompute_modules_note

    note = recompute_modules_note(cfg)
    if note:  # what the step compiled below recomputes, as training logs it
        print(f"> --recompute-modules: {note}", flush=True)
    print(f"> compiling the train step for {gpus} x {target.description} ...", flush=True)
    try:
        c = compile_step(cfg, devices(target, gpus, per_node), log=lambda m: print(m, flush=True))
    except (UsageError, RunFailure):
        raise
    except Exception as e:  # noqa: BLE001 - XLA's failure, named in one line
        raise RunFailure(f"the train step does not compile for {target.description}: "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:600]}") from e
    r = check.report(c, target, gpus, per_node)
    print(check.text(r), flush=True)
    if own.dump_hlo:
        with open(own.dump_hlo, "w") as f:
            f.write(c.text)
        print(f"> optimised HLO written to {own.dump_hlo}")
    if own.json:
        with open(own.json, "w") as f:
            json.dump(r, f, indent=1)
        print(f"> report written to {own.json}")
    if not r["fits"]:
        over = (r["per_device_bytes"]["total"] - r["usable_bytes"]) / check.GIB
        raise RunFailure(
            f"the train step needs {r['per_device_bytes']['total'] / check.GIB:.2f} GiB per device, "
            f"{over:.2f} GiB more than the {r['usable_bytes'] / check.GIB:.2f} GiB usable on a {target.description}; "
            f"try {' or '.join(check.suggestions(cfg, gpus, per_node))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
