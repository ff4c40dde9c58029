"""Expert parallelism: token dispatch to the experts and combine back, written by hand in shard_map.

Expert parallelism is carved out of data parallelism (Megatron): the batch rows are split over
(data, expert), the experts over `expert`, each expert's hidden dim over `tensor`. Inside the
shard_map every device holds its own tokens [T = b/(data*expert) * s, d] and E/ep experts:

  alltoall   each device sorts its T*K (token, expert) rows by destination rank and sends them
             with one all_to_all over `expert`, the experts run, a second all_to_all returns
             the outputs. XLA:CPU has no ragged all-to-all, so every destination's block is
             padded to its worst case (T*K rows dropless; min(T*K, experts per rank x capacity)
             with a capacity factor). Capacity is each rank's (a routing group's, see
             models/moe.py): an expert receives at most C rows from each of the ep sources.
  allgather  every device all-gathers the tokens of its `expert` group, runs its own experts on
             the rows routed to them, and a reduce-scatter over `expert` returns each device's
             tokens (Megatron's allgather dispatcher).

The experts themselves run as the model's grouped matmul (`models.moe.expert_ffn`).
With tensor parallelism the partial outputs are summed over `tensor` once, after the combine.

The dispatch is one shard_map, manual over the axes the step has not made manual already: over
data, expert and tensor in the plain step; over `tensor` alone in the per-rank body of a step
that reduces gradients once (manual over data and expert already: this rank's rows and
experts) and in the pipeline's per-rank schedule; over data, expert and tensor inside the
pipeline's stage otherwise. So every device runs its own f shard of its experts on rows that
are whole over `tensor` (no sharded sort, and the grouped-matmul kernel, which GSPMD cannot
partition, gets per-device operands), and no device holds an expert whole over `tensor`.

`parallel.tracing` installs `dispatch_and_combine` in the trace context; outside a step the model
runs every expert on every token itself (`models.moe.all_experts_here`). Shape letters: t token,
k choice, r row (= token x choice), e expert, d embed, f expert mlp, g expert-parallel rank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mlm_jax.config import ModelConfig
from mlm_jax.models.moe import all_experts_here, expert_ffn, local_experts, route_groups, row_capacity
from mlm_jax.sharding.mesh import EXPERT, TENSOR, psum, varying, varying_axes
from mlm_jax.sharding.rules import active_rules, logical_to_spec


def _alltoall(cfg, x_td, e_tk, w_tk, w1, w2, b1, cap, ep: int):
    """Dispatch rows to the rank owning their expert, run, return, combine: [T, d] -> [T, d]."""
    T, K = e_tk.shape
    n_local, R = w1.shape[0], T * K
    E = n_local * ep
    per_dest = R if cap is None else min(R, n_local * cap)  # a destination's block, padded
    ids = jnp.where(w_tk != 0, e_tk, E).reshape(R)  # global expert per row; E: dropped
    order = jnp.argsort(ids, stable=True)
    ids_s = ids[order]
    dest = ids_s // n_local  # [R]; ep for dropped rows
    per_rank = jnp.bincount(dest, length=ep + 1)
    starts = jnp.cumsum(per_rank) - per_rank  # first sorted row of each destination
    pos = jnp.arange(R) - starts[jnp.minimum(dest, ep)]
    x_rows = jnp.repeat(x_td, K, axis=0)[order]  # [R, d]
    send = jnp.zeros((ep, per_dest, x_td.shape[1]), x_td.dtype).at[dest, pos].set(x_rows, mode="drop")
    send_ids = jnp.full((ep, per_dest), n_local, jnp.int32).at[dest, pos].set(
        (ids_s - dest * n_local).astype(jnp.int32), mode="drop")
    # [ep (destination), per_dest, d] -> [ep (source), per_dest, d]
    recv = jax.lax.all_to_all(send, EXPERT, 0, 0, tiled=True)
    recv_ids = jax.lax.all_to_all(send_ids, EXPERT, 0, 0, tiled=True)
    y = expert_ffn(cfg, recv.reshape(ep * per_dest, -1), recv_ids.reshape(-1), w1, w2, b1,
                   None if cap is None else ep * cap)  # at most `cap` rows per expert from each source
    back = jax.lax.all_to_all(y.reshape(ep, per_dest, -1), EXPERT, 0, 0, tiled=True)  # [dest, per_dest, d]
    y_s = back.at[dest, pos].get(mode="fill", fill_value=0)  # [R, d] in sorted order
    y_rows = jnp.zeros_like(y_s).at[order].set(y_s)
    return jnp.einsum("tk,tkd->td", w_tk, y_rows.reshape(T, K, -1))


def _allgather(cfg, x_td, e_tk, w_tk, w1, w2, b1, cap, ep: int):
    """All-gather the expert group's tokens, run the local experts, reduce-scatter back."""
    n_local = w1.shape[0]
    me = jax.lax.axis_index(EXPERT)
    x_all = jax.lax.all_gather(x_td, EXPERT, axis=0, tiled=True)  # [ep*T, d]
    e_all = jax.lax.all_gather(e_tk, EXPERT, axis=0, tiled=True)  # [ep*T, K]
    w_all = jax.lax.all_gather(w_tk, EXPERT, axis=0, tiled=True)
    mine = (e_all // n_local == me) & (w_all != 0)
    local_e = jnp.where(mine, e_all - me * n_local, 0)
    y_all = local_experts(cfg, x_all, local_e, jnp.where(mine, w_all, 0), w1, w2, b1,
                          None if cap is None else ep * cap)  # [ep*T, d]: ep groups' rows
    return jax.lax.psum_scatter(y_all, EXPERT, scatter_dimension=0, tiled=True)  # [T, d]


def dispatch_and_combine(cfg: ModelConfig, y_bsd, experts_bsk, weights_bsk, w1, w2, b1):
    """sum_k weights[k] * expert_{experts[k]}(y) for every token: [b, s, d] -> [b, s, d].

    Inside parallelize's step (activation rules active): a shard_map over the axes of data,
    expert and tensor not already manual (see the module docstring); rows that do not split
    over the batch axes, or no step: all experts on all tokens here."""
    b, s, d = y_bsd.shape
    rules = active_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules:  # outside a mesh: every expert on every token, here
        return all_experts_here(cfg, y_bsd, experts_bsk, weights_bsk, w1, w2, b1)
    sizes = dict(mesh.shape)
    tok_spec = logical_to_spec(("batch", None, None), rules)  # [b/(data, expert), s, .]
    row_axes = tuple(a for a in (tok_spec[0] if isinstance(tok_spec[0], tuple) else (tok_spec[0],)) if a)
    uneven = b % math.prod(sizes[a] for a in row_axes) != 0
    # Manual already: the per-rank body of a step that reduces gradients once
    # (`parallel.data.reduces_once`: `data`, and `expert` with expert parallelism; the rows and
    # experts here are this rank's own), the pipeline's stage (`pipe`, and per rank as that).
    outer = frozenset(getattr(mesh, "manual_axes", ()))
    if uneven:
        # Rows that do not split over the batch axes (decoding a few prompts): the tokens and
        # experts are gathered (all-gathers only) and every device runs every expert on them.
        # (Inside a pipeline stage this branch once ran every microbatch, holding every layer's
        # experts whole on every tensor rank: see `_recomputing_shard_map` for what the nested
        # shard_map needed there.)
        whole = lambda a: None if a is None else jax.lax.with_sharding_constraint(a, P())  # noqa: E731
        out = all_experts_here(cfg, whole(y_bsd), whole(experts_bsk), whole(weights_bsk),  # every group
                               whole(w1), whole(w2), whole(b1))
        return jax.lax.with_sharding_constraint(out, P())
    ep = sizes[EXPERT]
    # A device's rows below are one routing group (a rank's), or all of them on one device
    # routing as a layout's ranks do: at most `cap` rows per expert.
    groups = route_groups(b)
    cap = row_capacity(cfg, b * s // groups, max(groups // math.prod(sizes[a] for a in row_axes), 1))
    w_specs = [logical_to_spec(n, rules) for n in _weight_names(cfg, w1.ndim)]
    manual = frozenset(a for a in (*row_axes, EXPERT, TENSOR) if a) - outer

    def body(x, e, w, w1_, w2_, b1_):  # [b/(row axes), s, d] rows whole over tensor; w1_ [E/ep, d, (2,) f/tp]
        bl = x.shape[0]
        args = (cfg, x.reshape(bl * s, d), e.reshape(bl * s, -1), w.reshape(bl * s, -1), w1_, w2_, b1_, cap)
        if ep == 1:
            out = local_experts(*args)
        elif cfg.moe_token_dispatcher_type == "allgather":
            out = _allgather(*args, ep)
        else:
            out = _alltoall(*args, ep)
        return (_sum_over_tensor(out) if outer else jax.lax.psum(out, TENSOR)).reshape(bl, s, d)

    specs = (tok_spec, tok_spec, tok_spec, w_specs[0], w_specs[1], None if b1 is None else w_specs[2])
    fn = _recomputing_shard_map(body, specs, tok_spec, manual, check_vma=not outer)
    # Pinned first: inside the pipeline's shard_map, propagation otherwise may hand the nested
    # manual computation an operand sharded over a free axis ahead of the manual ones.
    pin = lambda a: jax.lax.with_sharding_constraint(a, tok_spec)  # noqa: E731
    return fn(pin(y_bsd), pin(experts_bsk), pin(weights_bsk), w1, w2, b1)


@jax.custom_vjp
def _sum_over_tensor(partial):
    """psum over `tensor` whose cotangent is the output's, unchanged: each rank's partial sum
    gets it whole. What a vma-checked shard_map derives for psum; unchecked (nested in the
    per-rank body, which does not check) psum would transpose to a second psum, scaling the
    expert gradients by the tensor size."""
    return psum(partial, TENSOR)


_sum_over_tensor.defvjp(lambda partial: (psum(partial, TENSOR), None), lambda _, g: (g,))


def _recomputing_shard_map(body, in_specs, out_spec, manual, check_vma=True):
    """shard_map(body) whose backward is a second shard_map that recomputes the forward
    (jax.vjp inside it) instead of passing residuals between the two; recomputing also keeps
    the [rows, d] buffers out of memory. Argument 1 (expert ids, integers) gets no cotangent.

    check_vma False: nested in another shard_map (parallelize's per-rank body, which does not
    check, or a pipeline stage, which does). Nested in a stage, jax still splits the forward
    map: the backward slot's vjp partially evaluates the layer scan, which hoists what depends
    on constants alone (the iotas of the sort) out of the loop as residuals of a second map.
    Their sharding names the axes the map makes manual, or, checked, every axis they vary over,
    the stage's manual `pipe` and `data` too: Shardy's verifier rejects that (a manual axis
    after a free one; the `squeeze` of a residual). Unchecked, every value the body computes
    has no varying axes while its inputs keep the enclosing map's: the output is marked varying
    as the inputs are, the backward's inputs are taken as fresh values (`_unvarying`) before
    the vjp inside it, and its gradients are marked varying as their primals were."""
    fwd_map = jax.shard_map(body, in_specs=in_specs, out_specs=out_spec, axis_names=manual,
                            check_vma=check_vma)

    diff_specs = tuple(sp for i, sp in enumerate(in_specs) if i != 1)

    def bwd_body(args, g):
        x, e, w, w1, w2, b1 = args
        if not check_vma:
            x, w, w1, w2, b1, g = map(_unvarying, (x, w, w1, w2, b1, g))
        _, vjp = jax.vjp(lambda x_, w_, w1_, w2_, b1_: body(x_, e, w_, w1_, w2_, b1_), x, w, w1, w2, b1)
        grads = vjp(g)
        if check_vma:
            return grads
        # Unchecked, the sum over the ranks of an input they all hold whole is ours to take.
        return tuple(None if d is None else _sum_over(d, manual - _spec_axes(sp))
                     for d, sp in zip(grads, diff_specs))

    bwd_map = jax.shard_map(bwd_body, in_specs=(in_specs, out_spec), out_specs=diff_specs,
                            axis_names=manual, check_vma=check_vma)

    def forward(*args):  # the output varies over the enclosing map's axes as the inputs do
        return varying(fwd_map(*args), sorted(set().union(*(varying_axes(a) for a in args if a is not None))))

    @jax.custom_vjp
    def fn(*args):
        return forward(*args)

    def fwd(*args):
        return forward(*args), args

    def bwd(args, g):
        grads = bwd_map(args, g)
        x, _, w, w1, w2, b1 = args
        d_x, d_w, d_w1, d_w2, d_b1 = (None if d is None else varying(d, sorted(varying_axes(a)))
                                      for d, a in zip(grads, (x, w, w1, w2, b1)))
        return d_x, None, d_w, d_w1, d_w2, d_b1

    fn.defvjp(fwd, bwd)
    return fn


def _unvarying(a):
    """`a` as a value computed inside an unchecked shard_map: with no varying axes, where an
    input keeps the enclosing checked map's (autodiff inside then sees cotangents of one type;
    a product with ones, which XLA removes)."""
    return None if a is None else a * jnp.ones((), a.dtype)


def _spec_axes(spec) -> set:
    return {a for entry in (spec or ()) for a in (entry if isinstance(entry, tuple) else (entry,)) if a}


def _sum_over(x, axes):
    return psum(x, tuple(sorted(axes))) if axes else x


def _weight_names(cfg: ModelConfig, w1_ndim: int):
    w1 = ("experts", "embed", None, "mlp") if w1_ndim == 4 else ("experts", "embed", "mlp")
    return w1, ("experts", "mlp", "embed"), ("experts", *w1[2:])
