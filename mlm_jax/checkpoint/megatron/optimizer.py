"""Megatron-LM's Adam state read without PyTorch, in mlm_jax's plain layout.

What a torch_dist checkpoint holds, by Megatron-Core 0.16.1's `DistributedOptimizer.sharded_state_dict`:

- `fully_reshardable` (Megatron-LM's --dist-ckpt-optim-fully-reshardable): every parameter's
  state in the model's own keys and shapes, `optimizer.state.exp_avg.<model key>`,
  `optimizer.state.exp_avg_sq.<model key>` and the fp32 master `optimizer.state.param.<model key>`;
  Adam's step in common.pt's `optimizer.optimizer.param_groups[*].step`. Read here: the moments
  go through the weights' own layout code (QKV groups, gate/up, stacked layers, vocab padding).
- `dp_reshardable` (Megatron-LM's default with --use-distributed-optimizer) and
  `fully_sharded_bucket_space` / `dp_zero_gather_scatter`: the optimizer's flat per-bucket
  buffers, whose order is that of the saving run's gradient buckets; refused by name.
- `fully_sharded_model_space` (deprecated) stores flattened slices; the non-distributed
  optimizer stores `optimizer.state.exp_avg.<key>` with `common_step`; neither is covered by a
  Megatron-Core fixture yet, so both are refused by name too.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mlm_jax.checkpoint.megatron import dcp
from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.checkpoint.megatron.layout import Tensors, to_params

READABLE = "fully_reshardable"
_STATES = {"mu": "exp_avg", "nu": "exp_avg_sq", "master": "param"}


@dataclasses.dataclass
class AdamState:
    """Adam's moments (and fp32 master weights, when stored) as numpy trees in the plain layout."""

    mu: dict
    nu: dict
    step: int  # Adam's update count: its bias corrections use it
    master: dict | None = None


def unreadable_reason(ck) -> str | None:
    """Why `ck`'s (a MegatronCheckpoint) optimizer state cannot be read, or None."""
    where = os.path.join(ck.path, dcp.COMMON if ck.format == "torch_dist" else "mp_rank_*")
    if getattr(ck.args, "no_save_optim", False) or "optimizer" not in ck.common:
        return f"{where} holds no optimizer state (saved with --no-save-optim)"
    if ck.format != "torch_dist":
        return (f"{ck.path} is a legacy ('torch' format) checkpoint, whose optimizer state is Megatron's "
                "per-rank flat buffers; save with --ckpt-format torch_dist --use-distributed-optimizer "
                "--dist-ckpt-optim-fully-reshardable for a readable one")
    if not getattr(ck.args, "use_distributed_optimizer", False):
        return (f"{where}: the non-distributed optimizer's state (args.use_distributed_optimizer is False) is "
                f"not read; only the distributed optimizer's {READABLE!r} format is "
                "(--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable)")
    meta = ck.common.get("content_metadata") or {}
    kind = meta.get("distrib_optim_sharding_type") or ck.common["optimizer"].get("param_state_sharding_type")
    if kind != READABLE:
        return (f"{where}: the distributed optimizer's state is saved as {kind!r} (content_metadata "
                "distrib_optim_sharding_type), the flat per-bucket buffers of the saving run's layout; only "
                f"{READABLE!r} (Megatron-LM's --dist-ckpt-optim-fully-reshardable) is read")
    return None


def adam_step(ck) -> int:
    """Adam's step count from common.pt's param groups (one shared step, as Megatron-Core keeps)."""
    groups = ck.common["optimizer"].get("optimizer", {}).get("param_groups", [])
    steps = {int(g["step"]) for g in groups if g.get("step") is not None}
    if len(steps) != 1:
        raise MegatronCheckpointError(f"{os.path.join(ck.path, dcp.COMMON)}: key 'optimizer.optimizer.param_groups' "
                                      f"should hold one Adam step, has {sorted(steps) or 'none'}")
    return steps.pop()


def read_adam_state(ck) -> AdamState:
    """`ck`'s Adam state in the plain layout of `ck.params` (its `config`, vocab padded alike);
    a MegatronCheckpointError naming the file and the reason when it cannot be read."""
    from mlm_jax.checkpoint.megatron import _dist_tensors

    why = unreadable_reason(ck)
    if why:
        raise MegatronCheckpointError(why)
    distcp = dcp.Distcp(ck.path)
    trees = {}
    for name, state in _STATES.items():
        tensors = _dist_tensors(distcp, ck.config.num_layers, f"optimizer.state.{state}.")
        if not tensors and name == "master":
            trees[name] = None  # not every optimizer keeps fp32 masters apart
            continue
        if not tensors:
            raise MegatronCheckpointError(f"{os.path.join(ck.path, dcp.DCP_METADATA)}: no 'optimizer.state.{state}.*' "
                                          f"keys, though the optimizer state is saved as {READABLE!r}")
        trees[name] = to_params(Tensors(tensors), ck.config, ck.checkpoint_vocab)
    return AdamState(trees["mu"], trees["nu"], adam_step(ck), trees["master"])


def check_master(ck, master: dict | None) -> None:
    """The fp32 master weights, when stored, equal the model's weights (an fp32 run's do):
    else the checkpoint's weights are not the ones its optimizer continues."""
    if master is None:
        return
    import jax

    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ck.params), jax.tree.leaves(master)):
        if not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)):
            raise MegatronCheckpointError(
                f"{ck.path}: the optimizer's fp32 master weights ('optimizer.state.param.*') differ from the "
                f"model's at {jax.tree_util.keystr(path)}")
