"""Checkpoint cost on the present devices: how long training is blocked by an async save versus
how long the write takes, a blocking save for comparison, restore time (same layout and another
one), and bytes on disk per parameter (fp32 params + two fp32 Adam moments: about 12).

    python benchmarks/checkpoint.py [--sizes small,medium] [--repeats 3] [--out runs/benchmarks]

Each size saves the full train state (params + optimizer state + metadata) through the same
`mlm_jax.checkpoint.Saver` training uses. The first save of a process also pays Orbax's one-time
setup; it is reported separately ("first save") and left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from mlm_jax import checkpoint as ckpt
from mlm_jax.config import CheckpointConfig, Config, ModelConfig, ParallelConfig, TrainConfig
from mlm_jax.models.build import count_params
from mlm_jax.build import parallelize
from mlm_jax.sharding import make_mesh
from mlm_jax.validation import finalize

SIZES = {
    "small": ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=8192),
    "medium": ModelConfig(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=32000),
    "large": ModelConfig(num_layers=12, hidden_size=1024, num_attention_heads=16, vocab_size=50257,
                         max_position_embeddings=1024),
}


def layouts(n: int) -> tuple[ParallelConfig, ParallelConfig]:
    """(the saving layout, another one to restore onto)."""
    if n >= 4 and n % 2 == 0:
        return (ParallelConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True),
                ParallelConfig(tensor_model_parallel_size=n // 2 if n // 2 <= 4 else 4))
    return ParallelConfig(use_distributed_optimizer=n > 1), ParallelConfig()


def _cfg(model: ModelConfig, parallel: ParallelConfig, folder: str, async_save: bool) -> Config:
    return finalize(Config(model=model, parallel=parallel, train=TrainConfig(micro_batch_size=1, seq_length=128),
                           checkpoint=CheckpointConfig(save=folder, async_save=async_save)), jax.device_count())


def _trained_like(opt_state):
    """Random Adam moments: freshly initialised ones are zeros, which compress to nothing on disk
    and would understate the bytes of a real checkpoint."""
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(opt_state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [
        jnp.abs(jax.random.normal(k, x.shape, x.dtype)) * 1e-3
        if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x for k, x in zip(keys, leaves)])


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench(name: str, model: ModelConfig, repeats: int, root: str) -> dict:
    save_layout, other_layout = layouts(jax.device_count())
    quiet = lambda *_: None  # noqa: E731
    out = {"size": name}
    for mode in ("async", "sync"):
        folder = os.path.join(root, f"{name}_{mode}")
        cfg = _cfg(model, save_layout, folder, mode == "async")
        pz = parallelize(cfg, make_mesh(cfg.parallel))
        state = pz.init(0)
        state["opt_state"] = jax.jit(_trained_like, out_shardings=pz.opt_sharding)(state["opt_state"])
        jax.block_until_ready(state)
        out["parameters"] = count_params(pz.shapes)
        saver = ckpt.Saver(cfg, pz, None, root, ckpt.Start(), log=quiet)
        blocked, total = [], []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            b = saver.save(i + 1, state, 0, None)
            saver.mngr.wait_until_finished()
            t = time.perf_counter() - t0
            if i == 0:  # Orbax's one-time setup
                out[f"{mode}_first_save_blocked_s"], out[f"{mode}_first_save_total_s"] = b, t
            else:
                blocked.append(b)
                total.append(t)
        saver.close()
        out[f"{mode}_save_blocked_s"] = float(np.median(blocked))
        out[f"{mode}_save_total_s"] = float(np.median(total))
        if mode == "async":
            path = os.path.join(folder, str(repeats + 1))
            out["checkpoint_bytes"] = _du(path)
            out["bytes_per_param"] = out["checkpoint_bytes"] / out["parameters"]
            found = ckpt.find_checkpoint(folder)
            for label, layout in (("same", save_layout), ("other", other_layout)):
                rcfg = _cfg(model, layout, folder, True)
                rpz = parallelize(rcfg, make_mesh(rcfg.parallel))
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    restored, _ = ckpt.restore_train_state(rcfg, rpz, found, log=quiet)
                    jax.block_until_ready(restored)
                    times.append(time.perf_counter() - t0)
                    del restored
                out[f"restore_{label}_layout_s"] = float(np.median(times))
            out["save_layout"] = ckpt._describe(ckpt._layout_record(pz))
            out["other_layout"] = ckpt._describe(ckpt._layout_record(rpz))
        del state
        shutil.rmtree(folder, ignore_errors=True)
    out["throughput_GBps_async_total"] = out["checkpoint_bytes"] / out["async_save_total_s"] / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="small,medium", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp folder)")
    ap.add_argument("--out", default="runs/benchmarks")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="mlm_jax_ckpt_bench_")
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind} ({jax.devices()[0].platform})"
    rows = []
    try:
        for name in args.sizes.split(","):
            rows.append(bench(name, SIZES[name], args.repeats, root))
            r = rows[-1]
            print(f"{name:7s} {r['parameters'] / 1e6:7.2f} M params | {r['checkpoint_bytes'] / 1e6:8.1f} MB "
                  f"({r['bytes_per_param']:.2f} B/param) | async save: blocked {r['async_save_blocked_s']:.3f} s "
                  f"of {r['async_save_total_s']:.3f} s | sync save {r['sync_save_total_s']:.3f} s | "
                  f"first save blocked {r['async_first_save_blocked_s']:.2f} s | restore same layout "
                  f"{r['restore_same_layout_s']:.3f} s, onto [{r['other_layout']}] {r['restore_other_layout_s']:.3f} s",
                  flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "checkpoint.json")
    with open(path, "w") as f:
        json.dump({"device": device, "jax": jax.__version__, "results": rows}, f, indent=2)
    print(f"device: {device}; wrote {path}")


if __name__ == "__main__":
    main()
