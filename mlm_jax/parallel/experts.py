"""Expert parallelism: token dispatch to the experts and combine back, written by hand in shard_map.

Expert parallelism is carved out of data parallelism (Megatron): the batch rows are split over
(data, expert), the experts over `expert`, each expert's hidden dim over `tensor`. Inside the
shard_map every device holds its own tokens [T = b/(data*expert) * s, d] and E/ep experts:

  alltoall   each device sorts its T*K (token, expert) rows by destination rank and sends them
             over `expert`, the experts run, a second exchange returns the outputs. On NVIDIA
             targets both are ragged all-to-alls: a device sends exactly the rows each
             destination takes (two small all_to_alls of counts and offsets first), into a
             receive buffer of static size, the worst case (ep x T*K rows dropless; ep x
             min(T*K, experts per rank x capacity) with a capacity factor). XLA:CPU has no
             ragged all-to-all: there one all_to_all each way sends every destination a block
             padded to that worst case (T*K rows dropless; min(T*K, experts per rank x
             capacity)). Capacity is each rank's (a routing group's, see models/moe.py): an
             expert receives at most C rows from each of the ep sources.
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

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from mlm_jax import platform
from mlm_jax.config import ModelConfig
from mlm_jax.models.moe import (EXPERT_HIDDEN, EXPERT_OUT, EXPERT_ROWS, all_experts_here, expert_ffn,
                                 local_experts, route_groups, row_capacity)
from mlm_jax.sharding.mesh import EXPERT, TENSOR, in_mesh_order, psum, varying, varying_axes, zeros_like_typed
from mlm_jax.sharding.rules import active_rules, logical_to_spec


def _alltoall(cfg, x_td, e_tk, w_tk, w1, w2, b1, cap, ep: int):
    """Dispatch rows to the rank owning their expert, run, return, combine: [T, d] -> ([T, d],
    the rows the receive buffers dropped).

    The T*K rows go sorted by global expert (so by destination, then by its local expert;
    dropped rows last). On NVIDIA targets (`_ragged_here`) each destination gets exactly its
    rows (`_ragged_exchange`), elsewhere a block padded to its worst case (`_padded_exchange`).
    With --moe-receive-buffer-factor a destination takes at most `receive_rows` rows (`within`)."""
    T, K = e_tk.shape
    n_local, R = w1.shape[0], T * K
    E = n_local * ep
    ids = jnp.where(w_tk != 0, e_tk, E).reshape(R)  # global expert per row; E: dropped
    order = jnp.argsort(ids, stable=True)
    ids_s = ids[order]
    x_rows = jnp.repeat(x_td, K, axis=0)[order]  # [R, d]
    exchange = _ragged_exchange if _ragged_here() else _padded_exchange
    buffer = receive_rows(cfg, R, n_local, cap, ep)
    # [R, d] in sorted order, dropped rows 0 (kept for the backward: the router weights' gradient
    # needs it, and recomputing it would run the exchanges again)
    y_s, dropped = exchange(cfg, x_rows, ids_s, w1, w2, b1, cap, ep, buffer)
    y_s = checkpoint_name(y_s, EXPERT_OUT)
    y_rows = jnp.zeros_like(y_s).at[order].set(y_s)
    return jnp.einsum("tk,tkd->td", w_tk, y_rows.reshape(T, K, -1)), dropped


def receive_rows(cfg: ModelConfig, rows: int, n_local: int, cap: int | None, ep: int) -> int | None:
    """The rows an expert-parallel rank's receive buffer holds when each rank sends `rows`:
    --moe-receive-buffer-factor x rows, where that is below the worst case (ep x rows dropless,
    ep x min(rows, n_local x capacity) with a capacity factor); None: the worst case (no row is
    ever dropped for want of room)."""
    factor = cfg.moe_receive_buffer_factor
    worst = ep * (rows if cap is None else min(rows, n_local * cap))
    if factor is None or math.ceil(factor * rows) >= worst:
        return None
    return max(math.ceil(factor * rows), 1)


def within(sizes_in, rows: int):
    """sizes_in [source, e] (the rows each source sends each local expert here) cut to at most
    `rows` in all: every local expert keeps at most c rows, c the largest with sum_e min(rows_e,
    c) <= rows (the busiest experts give up rows first, as a capacity drops them), each expert's
    kept rows the first in source order (its buffer's order), each source's its first."""
    per_e = jnp.sum(sizes_in, axis=0)  # [e]
    n = per_e.shape[0]
    s = jnp.sort(per_e)
    below = jnp.cumsum(s) - s  # the rows of the experts smaller than the k-th
    c_k = (rows - below) // (n - jnp.arange(n))  # c if the k-th and larger experts are the ones cut
    prev = jnp.concatenate([jnp.zeros((1,), s.dtype), s[:-1]])
    c = jnp.max(jnp.where(c_k >= prev, jnp.minimum(c_k, s), -1))  # the largest c that fits
    before = jnp.cumsum(sizes_in, axis=0) - sizes_in  # [source, e]: rows of lower sources
    return jnp.clip(c - before, 0, sizes_in).astype(sizes_in.dtype)


def _ragged_here() -> bool:
    """Whether the step is compiled for NVIDIA GPUs, whose XLA has a ragged all-to-all (the
    trace context's platform: a deviceless GPU compile runs in a CPU process)."""
    return platform.current() == platform.CUDA


def _padded_exchange(cfg, x_rows, ids_s, w1, w2, b1, cap, ep: int, buffer: int | None = None):
    """Sorted rows [R, d] -> (their experts' outputs [R, d], rows dropped), with one all_to_all
    each way of [ep, per_dest, d] blocks: every destination's block padded to its worst case.
    With `buffer` (`receive_rows`) the rows a destination's buffer would not hold (`within`,
    as the ragged exchange cuts them) go as empty rows (output 0)."""
    n_local, R = w1.shape[0], x_rows.shape[0]
    per_dest = R if cap is None else min(R, n_local * cap)  # a destination's block, padded
    dest = ids_s // n_local  # [R]; ep for dropped rows
    per_rank = jnp.bincount(dest, length=ep + 1)
    starts = jnp.cumsum(per_rank) - per_rank  # first sorted row of each destination
    pos = jnp.arange(R) - starts[jnp.minimum(dest, ep)]
    local = (ids_s - dest * n_local).astype(jnp.int32)
    dropped = jnp.zeros((), jnp.float32)
    if buffer is not None:  # the first `sent` rows of each (destination, expert) go
        counts = jnp.bincount(ids_s, length=ep * n_local + 1)
        (_, sent, _, _), _, _ = ragged_offsets(counts[:-1].reshape(ep, n_local).astype(jnp.int32), cap, buffer)
        group_at = jnp.cumsum(counts) - counts  # first sorted row of each (destination, expert)
        kept = jnp.arange(R) - group_at[ids_s] < jnp.append(sent, 0)[ids_s]
        local = jnp.where(kept, local, n_local)
        dropped = (jnp.sum(counts[:-1]) - jnp.sum(sent)).astype(jnp.float32)
    send = jnp.zeros((ep, per_dest, x_rows.shape[1]), x_rows.dtype).at[dest, pos].set(x_rows, mode="drop")
    send_ids = jnp.full((ep, per_dest), n_local, jnp.int32).at[dest, pos].set(local, mode="drop")
    # [ep (destination), per_dest, d] -> [ep (source), per_dest, d]
    recv = checkpoint_name(jax.lax.all_to_all(send, EXPERT, 0, 0, tiled=True), EXPERT_ROWS)
    recv_ids = checkpoint_name(jax.lax.all_to_all(send_ids, EXPERT, 0, 0, tiled=True), EXPERT_ROWS)
    y = expert_ffn(cfg, recv.reshape(ep * per_dest, -1), recv_ids.reshape(-1), w1, w2, b1,
                   None if cap is None else ep * cap)  # at most `cap` rows per expert from each source
    back = jax.lax.all_to_all(y.reshape(ep, per_dest, -1), EXPERT, 0, 0, tiled=True)  # [dest, per_dest, d]
    return back.at[dest, pos].get(mode="fill", fill_value=0), dropped


def _ragged_exchange(cfg, x_rows, ids_s, w1, w2, b1, cap, ep: int, buffer: int | None = None):
    """Sorted rows [R, d] -> (their experts' outputs [R, d], rows dropped), with one ragged
    all-to-all each way: a rank sends exactly the rows each destination's experts take
    (`ragged_offsets`).

    A destination's rows arrive sorted by its local expert, into a receive buffer of static
    size, the worst case a rank may receive: ep x T*K rows dropless, ep x min(T*K, n_local x
    capacity) with a capacity factor (each source sends at most `cap` rows per expert: more are
    dropped, as the padded blocks drop them); `buffer` rows with --moe-receive-buffer-factor
    (`within` decides which rows fit). The buffer's unused tail is empty (id n_local: the
    experts skip it). The outputs go back with the reverse offsets; rows not sent come back 0."""
    n_local, R = w1.shape[0], x_rows.shape[0]
    received = ep * (R if cap is None else min(R, n_local * cap)) if buffer is None else buffer
    counts = jnp.bincount(ids_s, length=ep * n_local + 1)[:-1].reshape(ep, n_local)  # [dest, e]
    # (kept for the backward, as the rows received are: no collective runs again there)
    dispatch, combine, expert_rows = checkpoint_name(ragged_offsets(counts.astype(jnp.int32), cap, buffer),
                                                     EXPERT_ROWS)
    recv = checkpoint_name(_ragged_all_to_all(x_rows, dispatch, combine, received, R), EXPERT_ROWS)
    # [received, d]: expert 0's rows from source 0, 1, ..., expert 1's, ...; then the empty tail
    ids = jnp.sum(jnp.arange(received)[:, None] >= jnp.cumsum(expert_rows)[None, :], axis=1)  # [received]
    y = expert_ffn(cfg, recv, ids.astype(jnp.int32), w1, w2, b1, None if cap is None else ep * cap, grouped=True)
    dropped = (jnp.sum(counts) - jnp.sum(dispatch[1])).astype(jnp.float32)
    return _ragged_all_to_all(y, combine, dispatch, R, received), dropped  # [R, d] sorted


def ragged_offsets(counts, cap: int | None = None, buffer: int | None = None):
    """The offsets and sizes of the dispatch's and the return's ragged all-to-alls, on one rank of
    `expert` (inside a shard_map or a vmap over it).

    counts [dest, e] int32: this rank's rows for each destination's local experts, its rows
    sorted by (dest, e). With `cap`, at most `cap` rows of each (dest, e) are sent (the first).
    A destination's receive buffer holds its expert 0's rows from source 0, 1, ..., then expert
    1's, ...: where a source's rows land depends on the other sources' counts, so the counts
    (and where each slice starts in its source's rows, for the return) go to the destinations
    in one all_to_all of [ep, 2, n_local] int32 and the destinations' offsets come back in a
    second ([ep, n_local]). With `buffer` a destination takes at most that many rows
    (`within`), and tells each source how many of its rows it takes in the second all_to_all
    ([ep, 2, n_local]); a source sends the first that many of each (dest, e).

    Returns (dispatch, combine, expert_rows): dispatch and combine are (input_offsets,
    send_sizes, output_offsets, recv_sizes), each [ep * n_local] int32, one slice per (peer,
    local expert), as `jax.lax.ragged_all_to_all` takes them; expert_rows [n_local] the rows
    this rank receives per local expert."""
    ep, n_local = counts.shape
    sizes = counts if cap is None else jnp.minimum(counts, cap)  # [dest, e]: rows sent
    flat = counts.reshape(ep * n_local)
    send_at = (jnp.cumsum(flat) - flat).reshape(ep, n_local)  # [dest, e]: in my sorted rows
    # -> [source, 2, e]: what each source sends me, and where it sits in that source's rows
    got = jax.lax.all_to_all(jnp.stack([sizes, send_at], 1), EXPERT, 0, 0, tiled=True)
    sizes_in, source_at = got[:, 0], got[:, 1]  # [source, e]
    if buffer is not None:
        sizes_in = within(sizes_in, buffer)
    expert_rows = sizes_in.sum(0)  # [e]
    recv_at = (jnp.cumsum(expert_rows) - expert_rows)[None] + jnp.cumsum(sizes_in, 0) - sizes_in  # [source, e]
    if buffer is None:
        out_at = jax.lax.all_to_all(recv_at, EXPERT, 0, 0, tiled=True)  # [dest, e]: in its buffer
    else:  # and how many of my rows each destination takes
        out_at, sizes = jnp.unstack(jax.lax.all_to_all(jnp.stack([recv_at, sizes_in], 1), EXPERT, 0, 0,
                                                       tiled=True), axis=1)
    flat_ = lambda a: a.reshape(ep * n_local).astype(jnp.int32)  # noqa: E731
    # Slices (dest, e) of my sorted rows into each destination's buffer; I receive (source, e).
    dispatch = tuple(map(flat_, (send_at, sizes, out_at, sizes_in)))
    # Back: slices (source, e) of my buffer to where they came from; I receive (dest, e).
    combine = tuple(map(flat_, (recv_at, sizes_in, source_at, sizes)))
    return dispatch, combine, expert_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_all_to_all(operand, offsets, reverse, rows: int, back_rows: int):
    """`operand`'s slices sent over `expert` as `offsets` (input_offsets, send_sizes,
    output_offsets, recv_sizes) say, into `rows` rows of zeros. Its cotangent goes back by the
    `reverse` exchange into `back_rows` (operand's) rows: the same slices the other way, known
    here (jax's own transpose rule would all_to_all the offsets again)."""
    out = zeros_like_typed(operand, (rows, *operand.shape[1:]))
    return jax.lax.ragged_all_to_all(operand, out, *offsets, axis_name=EXPERT)


def _ragged_fwd(operand, offsets, reverse, rows, back_rows):
    return _ragged_all_to_all(operand, offsets, reverse, rows, back_rows), reverse


def _ragged_bwd(rows, back_rows, reverse, g):
    return _ragged_all_to_all(g, reverse, None, back_rows, rows), None, None


_ragged_all_to_all.defvjp(_ragged_fwd, _ragged_bwd)


def _allgather(cfg, x_td, e_tk, w_tk, w1, w2, b1, cap, ep: int):
    """All-gather the expert group's tokens, run the local experts, reduce-scatter back."""
    n_local = w1.shape[0]
    me = jax.lax.axis_index(EXPERT)
    x_all, e_all, w_all = (checkpoint_name(jax.lax.all_gather(a, EXPERT, axis=0, tiled=True), EXPERT_ROWS)
                           for a in (x_td, e_tk, w_tk))  # [ep*T, d], [ep*T, K] x 2
    mine = (e_all // n_local == me) & (w_all != 0)
    local_e = jnp.where(mine, e_all - me * n_local, 0)
    y_all = local_experts(cfg, x_all, local_e, jnp.where(mine, w_all, 0), w1, w2, b1,
                          None if cap is None else ep * cap)  # [ep*T, d]: ep groups' rows
    return jax.lax.psum_scatter(y_all, EXPERT, scatter_dimension=0, tiled=True)  # [T, d]


def dispatch_and_combine(cfg: ModelConfig, y_bsd, experts_bsk, weights_bsk, w1, w2, b1):
    """sum_k weights[k] * expert_{experts[k]}(y) for every token: [b, s, d] -> ([b, s, d], the
    (token, choice) rows the receive buffers dropped: --moe-receive-buffer-factor, fp32, this
    program's rows: a rank's own in a per-rank body).

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
        # experts whole on every tensor rank: see `_saving_shard_map` for what the nested
        # shard_map needed there.)
        whole = lambda a: None if a is None else jax.lax.with_sharding_constraint(a, P())  # noqa: E731
        out = all_experts_here(cfg, whole(y_bsd), whole(experts_bsk), whole(weights_bsk),  # every group
                               whole(w1), whole(w2), whole(b1))
        return jax.lax.with_sharding_constraint(out, P()), jnp.zeros((), jnp.float32)
    ep = sizes[EXPERT]
    # A device's rows below are one routing group (a rank's), or all of them on one device
    # routing as a layout's ranks do: at most `cap` rows per expert.
    groups = route_groups(b)
    cap = row_capacity(cfg, b * s // groups, max(groups // math.prod(sizes[a] for a in row_axes), 1))
    w_specs = [logical_to_spec(n, rules) for n in _weight_names(cfg, w1.ndim)]
    manual = frozenset(a for a in (*row_axes, EXPERT, TENSOR) if a) - outer
    split_here = in_mesh_order(set(row_axes) & manual)  # the axes this map splits the rows over

    def body(x, e, w, w1_, w2_, b1_):  # [b/(row axes), s, d] rows whole over tensor; w1_ [E/ep, d, (2,) f/tp]
        bl = x.shape[0]
        args = (cfg, x.reshape(bl * s, d), e.reshape(bl * s, -1), w.reshape(bl * s, -1), w1_, w2_, b1_, cap)
        dropped = jnp.zeros((), jnp.float32)
        if ep == 1:
            out = local_experts(*args)
        elif cfg.moe_token_dispatcher_type == "allgather":
            out = _allgather(*args, ep)
        else:
            out, dropped = _alltoall(*args, ep)
        out = (_sum_over_tensor(out) if outer else psum(out, TENSOR)).reshape(bl, s, d)
        if cfg.moe_receive_buffer_factor is None:  # nothing drops (and nothing to sum over the ranks)
            return out, jnp.zeros((), jnp.float32)
        return out, (psum(dropped, split_here) if split_here else dropped)

    specs = (tok_spec, tok_spec, tok_spec, w_specs[0], w_specs[1], None if b1 is None else w_specs[2])
    fn = _saving_shard_map(body, specs, tok_spec, manual, check_vma=not outer)
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


def _saving_shard_map(body, in_specs, out_spec, manual, check_vma=True):
    """shard_map(body) (body: inputs -> (output, a statistic without gradient, replicated over
    the manual axes)) whose forward also returns, per device, the residuals of its own jax.vjp
    (each stacked on a new leading dim split over the manual axes it varies over, so that their
    sharding is ours, not jax's partial evaluation's: nested in a shard_map, jax gave residuals a
    sharding Shardy rejects, the outer manual axis `pipe` as a free axis ahead of `data`; the
    first trace, abstract, learns which axes each varies over), and whose backward is a
    second shard_map applying that vjp: the experts' products and the dispatch's collectives run
    once (recomputing them in the backward cost a third more expert FLOPs). The vjp keeps the
    values named EXPERT_HIDDEN, EXPERT_OUT and EXPERT_ROWS (models/moe.py: the products, the
    rows received) and recomputes the rest (sorts, gathers, the activation); residuals that are
    the body's own inputs (the weights, the tokens) are not stored again. Argument 1 (expert
    ids, integers) gets no cotangent.

    check_vma False: nested in another shard_map (parallelize's per-rank body, which does not
    check, or a pipeline stage, which does). Unchecked, every value the body computes varies
    over no axis while its inputs keep the enclosing map's: the body takes its inputs as fresh
    values (`_unvarying`) so that autodiff inside sees cotangents of one type, the output is
    marked varying as the inputs are, and the gradients as their primals were."""
    diff_specs = tuple(sp for i, sp in enumerate(in_specs) if i != 1)
    kept = {}  # the vjp's structure, which of its leaves are inputs, the others' specs (from the trace)

    keep = jax.checkpoint_policies.save_only_these_names(EXPERT_HIDDEN, EXPERT_OUT, EXPERT_ROWS)

    def vjp_of(x, e, w, w1, w2, b1):  # (output, vjp, the body's second output: no gradient)
        fn = jax.checkpoint(lambda x_, w_, w1_, w2_, b1_: body(x_, e, w_, w1_, w2_, b1_), policy=keep)
        return jax.vjp(fn, x, w, w1, w2, b1, has_aux=True)

    def fresh(*inputs):
        # Unchecked, the inputs keep the enclosing map's varying axes and what the body computes
        # has none: taken as fresh values, autodiff inside sees cotangents of one type.
        return inputs if check_vma else tuple(map(_unvarying, inputs))

    def fwd_body(x, e, w, w1, w2, b1):
        x, w, w1, w2, b1 = inputs = fresh(x, w, w1, w2, b1)
        out, vjp, aux = vjp_of(x, e, w, w1, w2, b1)
        leaves, kept["tree"] = jax.tree.flatten(vjp)
        kept["input_of"] = [next((i for i, a in enumerate(inputs) if a is leaf), None) for leaf in leaves]
        stored = [leaf for leaf, i in zip(leaves, kept["input_of"]) if i is None]
        kept["varying"] = [in_mesh_order(varying_axes(leaf)) for leaf in stored]
        return out, aux, [leaf[None] for leaf in stored]

    def bwd_body(args, residuals, g):
        x, _, w, w1, w2, b1 = args
        inputs, stored = fresh(x, w, w1, w2, b1), iter(residuals)
        leaves = [next(stored)[0] if i is None else inputs[i] for i in kept["input_of"]]
        (g,) = fresh(g)
        grads = jax.tree.unflatten(kept["tree"], leaves)(g)
        if check_vma:
            return grads
        # Unchecked, the sum over the ranks of an input they all hold whole is ours to take.
        return tuple(None if d is None else _sum_over(d, manual - _spec_axes(sp))
                     for d, sp in zip(grads, diff_specs))

    def stacked():
        # a residual per device (unchecked: every manual axis), on a new leading dim
        return [P(axes if check_vma else in_mesh_order(manual)) for axes in kept["varying"]]

    def fwd_map(*args):
        every = P(in_mesh_order(manual))
        jax.eval_shape(lambda *a: jax.shard_map(fwd_body, in_specs=in_specs, out_specs=(out_spec, P(), every),
                                                axis_names=manual, check_vma=check_vma)(*a), *args)
        return jax.shard_map(fwd_body, in_specs=in_specs, out_specs=(out_spec, P(), stacked()), axis_names=manual,
                             check_vma=check_vma)(*args)

    def bwd_map(args, residuals, g):
        return jax.shard_map(bwd_body, in_specs=(in_specs, stacked(), out_spec), out_specs=diff_specs,
                             axis_names=manual, check_vma=check_vma)(args, residuals, g)

    def forward(*args):  # the outputs vary over the enclosing map's axes as the inputs do
        out, aux, residuals = fwd_map(*args)
        axes = sorted(set().union(*(varying_axes(a) for a in args if a is not None)))
        return (varying(out, axes), varying(aux, axes)), residuals

    @jax.custom_vjp
    def fn(*args):
        return forward(*args)[0]

    def fwd(*args):
        outs, residuals = forward(*args)
        return outs, (args, residuals)

    def bwd(saved, cotangents):
        args, _ = saved
        g = cotangents[0]  # (the second output has no gradient)
        x, _, w, w1, w2, b1 = args
        d_x, d_w, d_w1, d_w2, d_b1 = (None if d is None else varying(d, sorted(varying_axes(a)))
                                      for d, a in zip(bwd_map(*saved, g), (x, w, w1, w2, b1)))
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
    return psum(x, in_mesh_order(axes)) if axes else x


def _weight_names(cfg: ModelConfig, w1_ndim: int):
    w1 = ("experts", "embed", None, "mlp") if w1_ndim == 4 else ("experts", "embed", "mlp")
    return w1, ("experts", "mlp", "embed"), ("experts", *w1[2:])
