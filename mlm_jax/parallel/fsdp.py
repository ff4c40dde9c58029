"""Sharded data parallelism: Megatron-FSDP's `--data-parallel-sharding-strategy optim_grads`
(ZeRO-2) and `optim_grads_params` (ZeRO-3), for the layers.

Both store each layer's parameters split over `data` as ZeRO-1 stores them (the checkpoint
format is the same global arrays), and neither gathers the layers whole before the step: the
per-rank body (`step.reduce_once_loss_and_grads`) receives each rank's shard of the stacked
layers, and inside the layer scan each layer's weights pass through `GatherPerLayer.at_layer`:

  forward   the shard cast to the compute dtype (bf16: half the bytes), all-gathered over `data`;
  backward  the rank's gradient of the gathered weight, widened to fp32 and reduce-scattered
            over `data` (in bf16 with --grad-reduce-in-bf16) as that layer's backward ends: the
            gradient of the shard. It is accumulated over the microbatches in fp32, shard-sized,
            and never reduced whole (`parallel.data.reduce_over_ranks` leaves it as it is).

optim_grads keeps the gathered weights of the forward for the backward (the compute-dtype copy
of every layer lives through the step, as Megatron's ZeRO-2 keeps its model weights);
optim_grads_params drops them and gathers again in the backward (the layer is rematerialized
with a policy that saves everything but the gathered weights, `GatherPerLayer.wrap`; under
--recompute-granularity no policy keeps them, `GatherPerLayer.keeps`), so one or two layers'
weights are whole at a time.

The parameters outside the layers (embeddings, head, final norm) and the fp8 amax histories stay
as ZeRO-1 handles them: gathered once per step, reduced once after the microbatches.

The stored split of a layer weight (`storage_spec`) puts `data` on a dim that no other mesh axis
splits (so a rank's shard is one contiguous block of the layer's compute layout and its gather
needs no reordering); a leaf with no such dim that divides evenly (a tiny vector) stays whole on
every rank, its gradient all-reduced in the layer's backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlm_jax.config import Config
from mlm_jax.models import fp8
from mlm_jax.models.layers import compute_dtype, used_in_compute_dtype
from mlm_jax.sharding.mesh import DATA
from mlm_jax.sharding.specs import auto_part, entry_axes

# The parameters' keys of the stacked layers (dense, and MoE in a mixed stack).
STACKS = ("layers", "moe_layers")


def shards_layers(cfg: Config) -> bool:
    """Whether the layers' gradients (and, under optim_grads_params, their parameters) stay split
    over `data` through the step: optim_grads or optim_grads_params."""
    return cfg.parallel.sharding_strategy in ("optim_grads", "optim_grads_params")


def regathers(cfg: Config) -> bool:
    """Whether each layer's weights are gathered again in the backward (optim_grads_params)."""
    return cfg.parallel.sharding_strategy == "optim_grads_params"


def recompute_modules_note(cfg: Config) -> str | None:
    """What --recompute-modules runs as under optim_grads_params (the run logs it); None elsewhere."""
    m = cfg.model
    if not (cfg.parallel.use_megatron_fsdp and regathers(cfg) and m.recompute_granularity == "selective"
            and any(name != "core_attn" for name in m.recompute_modules or ())):
        return None
    return (f"{' '.join(m.recompute_modules)} under --data-parallel-sharding-strategy optim_grads_params: each "
            "layer is recomputed whole, as --recompute-granularity full (the layer's weights are gathered again "
            "in the backward under one checkpoint, whose policy would override the modules' own and keep "
            "what they recompute)")


def torch_fsdp2_note(cfg: Config) -> str | None:
    """What --use-torch-fsdp2 runs as (the run logs it); None without it."""
    p = cfg.parallel
    if not p.use_torch_fsdp2:
        return None
    return (f"runs as --use-megatron-fsdp --data-parallel-sharding-strategy {p.sharding_strategy} "
            "(one FSDP here, PyTorch's FSDP2 has no meaning on XLA)")


def layer_leaf(path) -> bool:
    """Whether the parameter at `path` is a layer weight that FSDP handles layer by layer (an amax
    history is not: its record is combined by a max, once per step)."""
    first = path[0]
    return str(getattr(first, "key", getattr(first, "name", first))) in STACKS and not fp8.is_history(path)


def storage_spec(spec: P, shape: Sequence[int], mesh_sizes: dict[str, int]) -> P:
    """A stacked layer leaf's storage: `data` added to the first dim past the layers dim that no
    other axis splits and that `data` divides evenly; `spec` itself where there is none."""
    dp = mesh_sizes[DATA]
    parts = list(spec) + [None] * (len(shape) - len(spec))
    if dp == 1:
        return P(*parts)
    for i in range(1, len(shape)):
        if parts[i] is None and shape[i] % dp == 0:
            parts[i] = DATA
            return P(*parts)
    return P(*parts)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One layer weight's gather (`reduction.gather`) and gradient reduction (`reduction`), sent
    in `dtype` (None: as stored). A plain object: a leaf of the trees below."""
    reduction: Any  # parallel.data.LeafReduction
    dtype: Any = None


def _gathered(leaf: _Leaf):
    """w (this rank's fp32 shard) -> the layer's weight, gathered in the compute dtype; its
    backward reduce-scatters the gradient in fp32 (`leaf.reduction`)."""

    def fsdp_gather(w):  # the name `_all_but_gathered` knows
        return leaf.reduction.gather(w if leaf.dtype is None else w.astype(leaf.dtype))

    def forward(w):
        return gather(w), None

    def backward(_, g):
        return (leaf.reduction(g.astype(jnp.float32)),)

    gather = jax.custom_vjp(fsdp_gather)
    gather.defvjp(forward, backward)
    return gather


@dataclasses.dataclass(frozen=True)
class GatherPerLayer:
    """The layer scan's hook (the trace's `layer_grad_hook`) under optim_grads /
    optim_grads_params inside the per-rank body: each layer's weights gathered as the layer
    starts, their gradients reduce-scattered as its backward ends (see the module docstring)."""
    stacks: dict  # stack key -> a tree like one layer's parameters of `_Leaf` (or None: passed through)
    regather: bool  # optim_grads_params: gathered again in the backward
    per_stack = True  # a mixed dense/MoE scan hooks each stack's row (`at_layer`'s `stack`)

    @classmethod
    def of(cls, cfg: Config, storage, compute, manual: tuple[str, ...], bf16: bool) -> "GatherPerLayer":
        """The hook for parameters stored as `storage` and computed with as `compute` (shardings),
        in a per-rank body manual over `manual`."""
        from mlm_jax.parallel.data import leaf_reduction

        sizes = dict(jax.tree.leaves(storage)[0].mesh.shape)
        dtype = compute_dtype(cfg.model)

        def leaf(path, st, co):
            if not layer_leaf(path):
                return None
            r = leaf_reduction(st.spec, co.spec, sizes, True, bf16)
            # Rows are split over every manual axis: a weight not split over one (expert) sums over it too.
            held = {a for e in st.spec for a in entry_axes(e)}
            r = dataclasses.replace(r, compute=auto_part(r.compute, manual),
                                    also_over=tuple(a for a in manual if a != DATA and a not in held))
            return _Leaf(r, dtype if used_in_compute_dtype(path) else None)

        stacks = {key: jax.tree_util.tree_map_with_path(lambda p, st, co: leaf(((jax.tree_util.DictKey(key),) + p), st, co),
                                                         storage[key], compute[key])
                  for key in STACKS if key in storage}
        return cls(stacks, regathers(cfg))

    def layer_inputs(self, layer_state):
        return ()

    def at_layer(self, state_l, inputs_l=(), stack: str = "layers"):
        """One layer's weights (this rank's shards) gathered."""
        leaves = jax.tree.leaves(self.stacks[stack], is_leaf=lambda x: x is None)
        flat, treedef = jax.tree.flatten(state_l)
        assert len(leaves) == len(flat), "GatherPerLayer: another stack"
        out = [w if lf is None else _gathered(lf)(w) for w, lf in zip(flat, leaves)]
        return jax.tree.unflatten(treedef, out)

    def wrap(self, body):
        """A layer scan's `body` (gathering its layer's weights through `at_layer`) where no
        recompute policy covers it: under optim_grads_params rematerialized with everything
        saved but the gathered weights (which the backward gathers again); as it is otherwise."""
        if not self.regather:
            return body
        return jax.checkpoint(body, policy=lambda prim, *_, **params: not _is_gathered(prim, params),
                              prevent_cse=False)

    def keeps(self, prim, params) -> bool:
        """What a recompute policy of the layers keeps besides its own: under optim_grads the
        gathered weights (kept from the forward for the backward, as ZeRO-2 keeps its model
        weights); under optim_grads_params nothing (no policy keeps them: gathered again)."""
        return not self.regather and _is_gathered(prim, params)


def _is_gathered(prim, params) -> bool:
    """Whether an equation makes a layer's gathered weight (`_gathered`'s custom VJP, whose
    function is named `fsdp_gather`)."""
    jaxpr = getattr(params.get("call_jaxpr"), "jaxpr", None)
    name = getattr(getattr(jaxpr, "debug_info", None), "func_name", None)
    return prim.name.startswith("custom_vjp_call") and name == "fsdp_gather"
