"""What a step is traced in: the mesh and the trace context (`sharding/trace.py`), with the
hand-written parallel pieces the model calls installed in it."""

from __future__ import annotations

import contextlib
import functools
import math

import jax
from jax.sharding import Mesh

from mlm_jax.parallel.chunks import seq_order
from mlm_jax.parallel.context import check_comm_type, context_attention
from mlm_jax.parallel.experts import dispatch_and_combine
from mlm_jax.platform import compiling_for, mesh_platform
from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import CONTEXT
from mlm_jax.sharding.rules import logical_to_spec


@contextlib.contextmanager
def tracing(mesh: Mesh, rules: tuple, cp_comm_type: str | None = None):
    """The mesh, its activation `rules`, its devices' platform (and, compiling for GPUs without
    one, their compute capability: `platform.compiling_for`) and the expert dispatch in force
    while a step is traced. `cp_comm_type` (the train and eval steps, whose batches are in the
    load-balanced chunk order) installs context-parallel attention where the mesh splits the
    sequence over `context`; without it attention runs on the whole sequence. A MoE router gives
    each rank of the batch rows its own capacity (`route_groups`); on a mesh whose batch rows are
    whole (one device) the groups of the context outside stay: a test's single-device reference
    routes as a layout's ranks do."""
    cp = order = None
    if cp_comm_type is not None and check_comm_type(cp_comm_type) and dict(mesh.shape)[CONTEXT] > 1:
        cp = functools.partial(context_attention, comm_type=cp_comm_type)
        order = functools.partial(seq_order, context_size=dict(mesh.shape)[CONTEXT])
    groups = row_blocks(mesh, rules)
    with jax.set_mesh(mesh), compiling_for(mesh), trace.using(
            rules=rules, platform=mesh_platform(mesh), context_attention=cp, seq_order=order,
            expert_dispatch=dispatch_and_combine, route_groups=groups if groups > 1 else trace.current().route_groups):
        yield


def row_blocks(mesh: Mesh, rules: tuple) -> int:
    """Into how many blocks the activation `rules` split the batch rows on `mesh`."""
    if not rules:
        return 1
    spec = logical_to_spec(("batch",), rules)[0]
    axes = () if spec is None else spec if isinstance(spec, tuple) else (spec,)
    return math.prod(dict(mesh.shape)[a] for a in axes)
