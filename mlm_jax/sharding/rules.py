"""The one table from logical dim names to mesh axes.

Model code names dims (`embed`, `heads`, ...); these tables decide where they live.
Two mappings (Levanter's parameter vs compute mapping):
  - `param_rules`: where parameters and optimizer state are *stored*;
  - `compute_rules`: where parameters and activations live while the step computes.
With the distributed optimizer, storage additionally shards each parameter over `data`
(ZeRO): a choice of storage, not a separate code path. The step gathers parameters to the
compute mapping, and the gradients reduce-scatter back to the storage mapping.

A logical dim maps to one mesh axis, a tuple of axes (split over their product, e.g. `batch` over
data and expert) or None; within one array each mesh axis is used at most once (a later dim
that asks for an axis already taken gets only what is left). Every PartitionSpec the rest of
the code needs is made here or in `specs.py`.
"""

from __future__ import annotations

from typing import Sequence

from jax.sharding import AxisType, PartitionSpec as P

from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import CONTEXT, DATA, EXPERT, REPLICA, TENSOR

Axes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, Axes], ...]

# Megatron's tensor-parallel split: column-parallel (heads, kv_heads, mlp) and vocab-parallel.
_PARAM_RULES: Rules = (
    ("vocab", TENSOR),
    ("heads", TENSOR),
    ("kv_heads", TENSOR),
    ("mlp", TENSOR),
    ("experts", EXPERT),  # MoE expert weights: each expert-parallel rank holds E / ep experts
    ("embed", None),
    ("head_dim", None),
    ("layers", None),
)


def param_rules() -> Rules:
    return _PARAM_RULES


def activation_rules(sequence_parallel: bool) -> Rules:
    """Activations: batch over data (x expert: expert parallelism is carved out of data
    parallelism, as Megatron's; hybrid sharding's instances, `replica`, outermost). The sequence is split over `context` everywhere (context
    parallelism; a size-1 axis is a no-op): `context_seq` is that split, the sequence inside
    the tensor-parallel region (attention, MLP, logits); `seq`, at block boundaries, is
    additionally split over tensor when SP is on (context-major: gathering over tensor gives
    back `context_seq`)."""
    return (
        ("batch", (REPLICA, DATA, EXPERT)),
        ("seq", (CONTEXT, TENSOR) if sequence_parallel else CONTEXT),
        ("context_seq", CONTEXT),
    ) + _PARAM_RULES


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> P:
    """Resolve logical dim names to a PartitionSpec; each mesh axis is used at most once."""
    table = dict(rules)
    used: set[str] = set()
    out: list[Axes] = []
    for name in names:
        if name is not None and name not in table:
            raise KeyError(f"logical dim {name!r} has no rule; known: {sorted(table)}")
        axes = table.get(name) if name is not None else None
        wanted = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        free = tuple(a for a in wanted if a not in used)
        used.update(free)
        out.append(None if not free else free[0] if len(free) == 1 else free)
    return P(*out)


def unsharded(rules: Rules, *names: str) -> Rules:
    """`rules` with the logical dims `names` mapped to no axis (whole on every device)."""
    return tuple((name, None if name in names else axes) for name, axes in rules)


def zero_spec(spec: P, shape: Sequence[int], mesh_sizes: dict[str, int], axis: str = DATA, skip: int = 0) -> P:
    """Add `axis` (`data`) to the first dim (past the first `skip`) that stays evenly divisible:
    the ZeRO storage of one array (over `pipe`: the pipeline's storage of the parameters every
    stage holds whole). `skip` 1 keeps a stacked leaf's layers dim whole, so that one layer's
    gradient can be reduce-scattered on its own (--overlap-grad-reduce).

    Leaves that no dim can split evenly (tiny vectors) stay replicated over `axis`.
    """
    dp = mesh_sizes[axis]
    parts = list(spec) + [None] * (len(shape) - len(spec))
    if dp == 1 or any(axis == p or (isinstance(p, tuple) and axis in p) for p in parts):
        return P(*parts)
    for i, (dim, part) in enumerate(zip(shape, parts)):
        if i < skip:
            continue
        axes = () if part is None else (part if isinstance(part, tuple) else (part,))
        split = 1
        for a in axes:
            split *= mesh_sizes[a]
        if dim % (split * dp) == 0:
            parts[i] = (*axes, axis) if axes else axis
            return P(*parts)
    return P(*parts)


def active_rules() -> Rules:
    """The activation rules in force while a step is traced (`sharding.trace`; empty outside)."""
    return trace.current().rules


def constrain(x, names: Sequence[str | None]):
    """Pin activation `x` to the sharding its logical dims map to; a no-op without rules in force."""
    rules = active_rules()
    if not rules:
        return x
    import jax

    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def specs_if_split(split: Sequence[str | None], whole: Sequence[str | None]) -> tuple[P, P] | None:
    """(split spec, whole spec) of one activation's two logical layouts under the rules in force,
    or None where they are the same (no rules, or the rules do not split what `split` names)."""
    rules = active_rules()
    if not rules:
        return None
    pair = (logical_to_spec(split, rules), logical_to_spec(whole, rules))
    return None if pair[0] == pair[1] else pair


def spec_on_axes(names: Sequence[str | None], axes) -> P:
    """The activation spec of logical `names` under the rules in force, keeping only the mesh
    `axes` (those a shard_map makes manual)."""
    parts = []
    for part in logical_to_spec(names, active_rules()):
        kept = tuple(a for a in ((part,) if isinstance(part, str) else part or ()) if a in axes)
        parts.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*parts)


def free_axes() -> frozenset:
    """The mesh axes of the traced step not manual here (none outside a mesh or without rules)."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    if not active_rules() or mesh.empty:
        return frozenset()
    return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)


def per_device(fn, in_names: Sequence[Sequence[str | None]], out_names: Sequence[str | None]):
    """`fn` run on each device's own block of its arguments: a fully manual shard_map over every
    mesh axis not manual already, the blocks laid out as the logical `in_names` / `out_names`
    map under the rules in force; `fn` itself without rules in force.

    For kernels whose custom partitioner cannot see through a partly manual program (cuDNN's
    fused attention inside the per-rank data-parallel body or a pipeline stage): given per-device
    blocks there is nothing left to partition."""
    def run(*args):
        import jax

        free = free_axes()
        if not free:
            return fn(*args)
        return jax.shard_map(fn, in_specs=tuple(spec_on_axes(n, free) for n in in_names),
                             out_specs=spec_on_axes(out_names, free), axis_names=free,
                             check_vma=False)(*args)

    return run
