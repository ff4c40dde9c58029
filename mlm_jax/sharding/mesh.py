"""The device mesh: six named axes, outer to inner, sizes from the parallel config.

Axis order mirrors Megatron's rank order (tp fastest, then cp, ep, dp, pp): the tensor axis is
innermost so that tensor-parallel groups are neighbouring devices (one node's NVLink domain).
Data parallelism is two axes: `replica` (--num-distributed-optimizer-instances, hybrid
sharding's copies) outside `data` (the ranks of one instance, which split the sharded state):
an instance is dp/N neighbouring data-parallel ranks, as Megatron groups them.
Every axis always exists; a size of 1 is a no-op.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh

from mlm_jax.config import ParallelConfig, data_parallel_size

PIPE, REPLICA, DATA, EXPERT, CONTEXT, TENSOR = "pipe", "replica", "data", "expert", "context", "tensor"
AXES = (PIPE, REPLICA, DATA, EXPERT, CONTEXT, TENSOR)


def mesh_shape(parallel: ParallelConfig, world_size: int) -> dict[str, int]:
    """Axis name -> size. Expert parallelism is carved out of data parallelism (as Megatron)."""
    dp = data_parallel_size(parallel, world_size)
    ep = parallel.expert_model_parallel_size
    instances = parallel.num_distributed_optimizer_instances
    return {
        PIPE: parallel.pipeline_model_parallel_size,
        REPLICA: instances,
        DATA: dp // ep // instances,
        EXPERT: ep,
        CONTEXT: parallel.context_parallel_size,
        TENSOR: parallel.tensor_model_parallel_size,
    }


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    """The mesh over `devices` (default: every device of every process, in global order).

    Axes are Auto (GSPMD) rather than jax's Explicit default: the logical-rules design lets the
    compiler derive the collectives from annotations (see shared/notes/jax-stack.md).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(parallel, len(devices))
    grid = np.asarray(devices, dtype=object).reshape(tuple(shape.values()))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def in_mesh_order(axes) -> tuple[str, ...]:
    """Mesh `axes` (any iterable) in the mesh's order, as a spec's entry must name them (jax 0.12
    aborts on manual axes out of it)."""
    axes = set(axes)
    return tuple(a for a in AXES if a in axes)


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which `x` (an array or a jax.ShapeDtypeStruct) varies inside
    a shard_map: its values may differ per device there."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; older releases: aval.vma
    return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def varying(x, axes) -> jax.Array:
    """`x` marked as varying over the manual mesh `axes` inside a shard_map (a no-op for those
    it already varies over): its cotangent may then differ per device, and autodiff sums it
    where `x` came from a value the same on every device."""
    for axis in (axes,) if isinstance(axes, str) else axes:
        if axis not in varying_axes(x):
            x = jax.lax.pcast(x, axis, to="varying")
    return x


def zeros_like_typed(like, shape=None) -> jax.Array:
    """Zeros typed and varying like `like`, shaped like it or `shape` (e.g. a scan's initial
    carry for a body whose outputs vary over manual axes)."""
    return varying(jnp.zeros(like.shape if shape is None else shape, like.dtype), sorted(varying_axes(like)))


def psum(x, axes, scatter_dimension: int | None = None) -> jax.Array:
    """`jax.lax.psum` of `x` over manual mesh `axes` (with `scatter_dimension`, `psum_scatter`
    tiled on it); a bf16/fp16 `x` on a CPU mesh is summed in fp32 and rounded back: XLA:CPU
    promotes those reductions to fp32 anyway, and its promotion pass aborts on some of them
    (`Invalid binary instruction opcode copy`: a reduction region ending in a copy, as a custom
    backward's sum can have). GPUs reduce in `x`'s dtype."""
    from mlm_jax.sharding import trace

    def reduce(v):
        if scatter_dimension is None:
            return jax.lax.psum(v, axes)
        return jax.lax.psum_scatter(v, axes, scatter_dimension=scatter_dimension, tiled=True)

    on_cpu = (trace.current().platform or jax.devices()[0].platform) == "cpu"  # the traced step's, else here
    if x.dtype in (jnp.bfloat16, jnp.float16) and on_cpu:
        return reduce(x.astype(jnp.float32)).astype(x.dtype)
    return reduce(x)

