"""Context-parallel attention: the sequence split over the `context` mesh axis, in shard_map.

Outside attention every activation is [batch, seq/context, ...] (the rules map `seq` and
`context_seq` to `context`) and GSPMD handles the rest of the layer: weights are replicated
over `context` and their gradients are summed over it. Attention is the one place a token needs
the others' keys and values; `context_attention` runs it manual over every mesh axis that is not
already manual (the pipeline's `pipe` is), with one of Megatron's `--cp-comm-type`s:

  - `p2p` (ring): each rank keeps its queries and passes its K/V block (and the block's segment
    ids) to the next rank with `ppermute`, in a `lax.scan` over the C steps. Each step's
    transfer is issued before its block's attention, with no dependency between them, so the
    scheduler can overlap them. Blocks are merged with an online softmax: each block returns
    its normalised output and log-sum-exp, and the running pair is rescaled (flash attention's
    merge). With the load-balanced chunks an off-diagonal step computes half a block (the
    causal skip below). Each block's scores are recomputed in the backward (`jax.checkpoint`),
    so one block of scores is alive at a time; the cotangents of the K/V blocks travel the
    ring the other way.
  - `allgather`: K/V (and their segment ids) gathered over `context`, then local attention of
    this rank's queries; the backward reduce-scatters dK/dV.
  - `a2a` (Ulysses): all-to-all from sequence-split/heads-whole to sequence-whole/heads-split,
    whole-sequence attention on H/C heads, all-to-all back. Needs heads and KV groups (per
    tensor rank) divisible by C.

On NVIDIA GPUs (`fused` CUDNN) each comm type runs cuDNN's fused kernels where there are no
documents and no dropout: p2p's blocks with their log-sum-exps (`_fused_ring`, Transformer
Engine's scheme), allgather's attention with the causal order as a mask, a2a's whole-sequence
causal attention.

The backward (`_attend`'s custom VJP) keeps only q, k, v and the segment ids and recomputes the
forward inside its own shard_map (the ring runs again: backward traffic is twice the forward's).

In every case the mask comes from the original token indices (`chunks.local_order`) and the
segment ids, and K/V keep their G groups (grouped-query attention never repeats K/V, neither
in memory nor on the wire). Shape letters as in mlm_jax/models/attention.py; `c` = the context
size C, per-device block shapes are in the comments.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from mlm_jax.models.attention import XLA, attention, block_backward, block_forward, causal_mask
from mlm_jax.models.layers import dropout, fp32_einsum
from mlm_jax.models.recompute import keep_attention
from mlm_jax.parallel.chunks import local_order, seq_order
from mlm_jax.sharding.mesh import CONTEXT, PIPE
from mlm_jax.sharding.rules import spec_on_axes

COMM_TYPES = ("p2p", "allgather", "a2a")
NEG = -1e30  # a finite "minus infinity": fully masked rows stay NaN-free in value and gradient

# q k^T [b, g, r, s, t] in fp32 from compute-dtype q [b, s, g, r, k] and k [b, t, g, k].
_scores = fp32_einsum("bsgrk,btgk->bgrst", "bgrst,btgk->bsgrk", "bgrst,bsgrk->btgk")
# The probabilities times the values: the fp32 output's cotangent (the blocks are merged in fp32)
# would otherwise make both backward matmuls fp32 x fp32 under --bf16.
_values = fp32_einsum("bgrst,btgk->bgrsk", "bgrsk,btgk->bgrst", "bgrsk,bgrst->btgk")


def check_comm_type(comm_type: str) -> str:
    """`comm_type` if it is one of Megatron's --cp-comm-type values, else ValueError."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r}: choose one of {', '.join(COMM_TYPES)}")
    return comm_type


# --------------------------------------------------------------------------- one block


def _block(q_bsgrk, k_btgk, v_btgk, mask_bst, rate, key):
    """Attention of queries to one K/V block: (output [b, g, r, s, k] fp32, normalised over
    this block only; log-sum-exp [b, g, r, s] fp32, NEG where the block hides every key)."""
    scores = _scores(q_bsgrk, k_btgk) / math.sqrt(q_bsgrk.shape[-1])  # [b, g, r, s, t] fp32
    mask = mask_bst[:, None, None]  # [b, 1, 1, s, t]
    scores = jnp.where(mask, scores, NEG)
    # The max only keeps exp in range; the result does not depend on it.
    m = jax.lax.stop_gradient(jnp.max(scores, axis=-1))  # [b, g, r, s]
    p = jnp.where(mask, jnp.exp(scores - m[..., None]), 0.0)  # [b, g, r, s, t]
    total = jnp.sum(p, axis=-1)  # [b, g, r, s]
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    p = dropout(p, rate, key).astype(v_btgk.dtype)
    o = _values(p, v_btgk)  # [b, g, r, s, k] fp32
    return o / safe[..., None], jnp.where(seen, m + jnp.log(safe), NEG)


_block_remat = jax.checkpoint(_block, static_argnums=(4,))


def _merge(acc, new):
    """Online-softmax merge of two (output, lse) pairs over disjoint key sets (`acc` may be
    the empty pair: zeros and NEG)."""
    if acc is None:
        return new
    (o_a, lse_a), (o_b, lse_b) = acc, new
    lse = jnp.logaddexp(lse_a, lse_b)  # [b, g, r, s]
    o = o_a * jnp.exp(lse_a - lse)[..., None] + o_b * jnp.exp(lse_b - lse)[..., None]
    return o, lse


def _mask(q_idx_s, k_idx_t, q_seg_bs, k_seg_bt):
    """[b or 1, s, t] bool from original indices (causal) and segment ids (documents)."""
    return causal_mask(q_idx_s[None], k_idx_t[None], q_seg_bs, k_seg_bt)


def _key(key, *ids):
    if key is None:
        return None
    for i in ids:
        key = jax.random.fold_in(key, i)
    return key


# --------------------------------------------------------------------------- comm types


def _ring(q, k, v, seg, key, *, c: int, rate: float, in_pipeline: bool = False, fused: str | None = None):
    """p2p: per device q [b, s/c, h, k], k/v [b, s/c, g, k], seg [b, s/c] or None. `fused` (a
    backend, CUDNN on NVIDIA GPUs): its fused kernels on each block (`_fused_ring`; inside a
    pipeline stage the gathered form, `_allgather`'s), where there are no documents and no
    dropout."""
    if fused is not None and seg is None and key is None:
        if in_pipeline:
            return _allgather(q, k, v, seg, key, c=c, rate=rate, fused=fused)
        return _fused_ring(fused, c, q, k, v)
    rank = jax.lax.axis_index(CONTEXT)
    b, s, h, hd = q.shape
    g = k.shape[2]
    q_bsgrk = q.reshape(b, s, g, h // g, hd)  # [b, s/c, g, r, k]
    q_idx = local_order(rank, c, s, jnp)  # [s/c]
    if in_pipeline:
        return _blocks_gathered(q, q_bsgrk, q_idx, k, v, seg, key, rank, c=c, rate=rate)
    perm = [(i, (i + 1) % c) for i in range(c)]

    def attend(acc, block, step):
        src = (rank - step) % c  # the rank this block came from
        k_idx = local_order(src, c, s, jnp)  # [s/c]
        branches = [functools.partial(f, q_bsgrk, q_idx, seg, block, k_idx, rate, _key(key, rank, src))
                    for f in (_diagonal, _early_block, _late_block)]
        return _merge(acc, jax.lax.switch(_step_kind(rank, step, c), branches))

    def ring_step(carry, step):
        block, acc = carry
        # Issue the next transfer first: it does not depend on this step's compute.
        nxt = jax.lax.ppermute(block, CONTEXT, perm)
        return (nxt, attend(acc, block, step)), None

    # A scan over all C steps keeps one block of scores alive at a time: unrolled (or a scan
    # XLA unrolls, of length 1 at C = 2), XLA merges the independent blocks' matmuls that share
    # q back into one [s/c, s] product. The price: the last step's transfer is not used (C
    # transfers for C-1 blocks).
    q_bgrsk = jnp.einsum("bsgrk->bgrsk", q_bsgrk)
    acc = (jnp.zeros_like(q_bgrsk, jnp.float32), jnp.full_like(q_bgrsk[..., 0], NEG, jnp.float32))
    (_, acc), _ = jax.lax.scan(ring_step, ((k, v, seg), acc), jnp.arange(c))
    return _finish(acc, q)


# The load balance's causal skip (Megatron's): rank r holds chunks r and 2C-1-r, and a block
# from rank j holds chunks j and 2C-1-j. Its own block (j = r) needs the causal mask. From an
# earlier rank (j < r) only the block's first chunk is visible, to both query chunks; from a
# later rank (j > r) only the second query chunk sees anything, the whole block. Each
# off-diagonal step therefore computes half a block; the masks still apply (documents).


def _half(x, first: bool, axis: int = 1):
    if x is None:
        return None
    n = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0 if first else n, n if first else 2 * n, axis=axis)


def _diagonal(q_bsgrk, q_idx, seg, block, k_idx, rate, key):
    k_b, v_b, seg_b = block
    return _block_remat(q_bsgrk, k_b, v_b, _mask(q_idx, k_idx, seg, seg_b), rate, key)


def _early_block(q_bsgrk, q_idx, seg, block, k_idx, rate, key):
    """Every query against the block's first chunk: [s/c] x [s/(2c)] scores."""
    k_b, v_b, seg_b = (_half(x, True) for x in block)
    mask = _mask(q_idx, _half(k_idx, True, 0), seg, seg_b)  # [b or 1, s/c, s/2c]
    return _block_remat(q_bsgrk, k_b, v_b, mask, rate, key)


def _late_block(q_bsgrk, q_idx, seg, block, k_idx, rate, key):
    """The second query chunk against the whole block; the first chunk sees none of it."""
    k_b, v_b, seg_b = block
    q2 = _half(q_bsgrk, False)  # [b, s/2c, g, r, k]
    mask = _mask(_half(q_idx, False, 0), k_idx, _half(seg, False), seg_b)  # [b or 1, s/2c, s/c]
    o2, lse2 = _block_remat(q2, k_b, v_b, mask, rate, key)  # [b, g, r, s/2c, k], [b, g, r, s/2c]
    o = jnp.concatenate([jnp.zeros_like(o2), o2], axis=3)  # [b, g, r, s/c, k]
    lse = jnp.concatenate([jnp.full_like(lse2, NEG), lse2], axis=3)  # [b, g, r, s/c]
    return o, lse


# --------------------------------------------------------------------------- fused kernels
# The ring with a fused attention kernel per block (cuDNN's on NVIDIA GPUs), as Transformer
# Engine runs Megatron's p2p: each block's kernel returns its output and log-sum-exp, merged as
# above; the backward runs the ring once more, each block's backward kernel given the merged
# output and log-sum-exp (so it sees the global softmax), dQ accumulating at home and each
# block's dK/dV travelling the ring with it until it is back at its owner. The same causal skip:
# the diagonal block is plain causal in the local order, the off-diagonal halves unmasked.


def _fused_halves(q, n: int, backend: str):
    """The three kinds of step as (forward, backward) branches for `lax.switch`; `n` = s/(2c),
    one chunk. Each forward returns ([b, s/c, h, k] fp32, [b, h, s/c]); each backward
    (dq, dk, dv) in fp32 for the whole local q and the whole block."""
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731

    def diagonal(kb, vb):
        return f32(*block_forward(q, kb, vb, True, backend))

    def early(kb, vb):  # every query, the block's first chunk
        return f32(*block_forward(q, kb[:, :n], vb[:, :n], False, backend))

    def late(kb, vb):  # the second query chunk, the whole block
        o2, lse2 = f32(*block_forward(q[:, n:], kb, vb, False, backend))
        return (jnp.concatenate([jnp.zeros_like(o2), o2], axis=1),
                jnp.concatenate([jnp.full_like(lse2, NEG), lse2], axis=2))

    def diagonal_bwd(kb, vb, o, lse, do):
        return f32(*block_backward(q, kb, vb, True, o, lse, do, backend))

    def early_bwd(kb, vb, o, lse, do):
        dq, dk, dv = f32(*block_backward(q, kb[:, :n], vb[:, :n], False, o, lse, do, backend))
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)  # noqa: E731
        return dq, pad(dk), pad(dv)

    def late_bwd(kb, vb, o, lse, do):
        dq2, dk, dv = f32(*block_backward(q[:, n:], kb, vb, False, o[:, n:], lse[:, :, n:], do[:, n:], backend))
        return jnp.concatenate([jnp.zeros_like(dq2), dq2], axis=1), dk, dv

    return (diagonal, early, late), (diagonal_bwd, early_bwd, late_bwd)


def _step_kind(rank, step, c: int):
    """0: the own block (diagonal), 1: from an earlier rank, 2: from a later one."""
    src = (rank - step) % c  # the rank this step's block came from
    return jnp.where(step == 0, 0, jnp.where(src < rank, 1, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_ring(backend: str, c: int, q, k, v):
    """Per device q [b, s/c, h, k], k/v [b, s/c, g, k] -> [b, s/c, h, k]."""
    return _fused_ring_fwd(backend, c, q, k, v)[0]


def _fused_ring_fwd(backend, c, q, k, v):
    rank = jax.lax.axis_index(CONTEXT)
    perm = [(i, (i + 1) % c) for i in range(c)]
    forwards, _ = _fused_halves(q, q.shape[1] // 2, backend)

    def ring_step(carry, step):
        block, acc = carry
        nxt = jax.lax.ppermute(block, CONTEXT, perm)  # issued first: independent of this step
        o, lse = jax.lax.switch(_step_kind(rank, step, c), forwards, *block)
        return (nxt, _merge_bshk(acc, (o, lse))), None

    # (zeros_like: the carry varies over the manual axes as q does)
    acc = (jnp.zeros_like(q, jnp.float32), jnp.full_like(jnp.einsum("bshk->bhs", q[..., :1]), NEG, jnp.float32))
    (_, (o, lse)), _ = jax.lax.scan(ring_step, ((k, v), acc), jnp.arange(c))
    out, lse = keep_attention(o.astype(q.dtype), lse)
    return out, (q, k, v, out, lse)


def _fused_ring_bwd(backend, c, residuals, do):
    q, k, v, out, lse = residuals
    rank = jax.lax.axis_index(CONTEXT)
    perm = [(i, (i + 1) % c) for i in range(c)]
    _, backwards = _fused_halves(q, q.shape[1] // 2, backend)

    def ring_step(carry, step):
        block, grads, dq = carry
        nxt = jax.lax.ppermute(block, CONTEXT, perm)
        dq_i, dk_i, dv_i = jax.lax.switch(_step_kind(rank, step, c), backwards, *block, out, lse, do)
        # This block's dK/dV go on with it; after C steps they are back at their owner.
        grads = jax.lax.ppermute((grads[0] + dk_i, grads[1] + dv_i), CONTEXT, perm)
        return (nxt, grads, dq + dq_i), None

    zeros = lambda x: jnp.zeros_like(x, jnp.float32)  # noqa: E731
    (_, (dk, dv), dq), _ = jax.lax.scan(ring_step, ((k, v), (zeros(k), zeros(v)), zeros(q)), jnp.arange(c))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_fused_ring.defvjp(_fused_ring_fwd, _fused_ring_bwd)


def _merge_bshk(acc, new):
    """`_merge` for outputs [b, s, h, k] and log-sum-exps [b, h, s]."""
    (o_a, lse_a), (o_b, lse_b) = acc, new
    lse = jnp.logaddexp(lse_a, lse_b)
    weight = lambda x: jnp.einsum("bhs->bsh", jnp.exp(x - lse))[..., None]  # noqa: E731
    return o_a * weight(lse_a) + o_b * weight(lse_b), lse


def _blocks_gathered(q, q_bsgrk, q_idx, k, v, seg, key, rank, *, c: int, rate: float):
    """The ring's blockwise merge with the C blocks all-gathered once: the p2p path inside a
    pipeline stage, where the ring itself does not lower (its `lax.switch` on the source rank
    leaves rank-derived residuals that Shardy's verifier rejects inside the pipeline's recomputed
    stage: checked again with the two-slot runtime, jax 0.10). All-gather receives the same C-1
    blocks, without the ring's overlap. Full blocks with masks, no causal skip, for the same
    reason."""
    s = q.shape[1]
    k_all = jax.lax.all_gather(k, CONTEXT, axis=0, tiled=False)  # [c, b, s/c, g, k]
    v_all = jax.lax.all_gather(v, CONTEXT, axis=0, tiled=False)  # [c, b, s/c, g, k]
    seg_all = None if seg is None else jax.lax.all_gather(seg, CONTEXT, axis=0, tiled=False)  # [c, b, s/c]
    acc = None
    for src in range(c):  # static: the key indices are constants
        seg_b = None if seg is None else seg_all[src]
        mask = _mask(q_idx, jnp.asarray(local_order(src, c, s)), seg, seg_b)  # [b or 1, s/c, s/c]
        acc = _merge(acc, _block_remat(q_bsgrk, k_all[src], v_all[src], mask, rate, _key(key, rank, src)))
    return _finish(acc, q)


def _finish(acc, q):
    """The merged [b, g, r, s/c, k] output as [b, s/c, h, k] in q's dtype."""
    o, _ = acc
    b, s, h, hd = q.shape
    return jnp.einsum("bgrsk->bsgrk", o).reshape(b, s, h, hd).astype(q.dtype)


def _allgather(q, k, v, seg, key, *, c: int, rate: float, in_pipeline: bool = False, fused: str | None = None):
    """allgather: K/V [b, s/c, g, k] -> [b, s, g, k] (stored order); queries stay local.
    `fused` (CUDNN on NVIDIA GPUs): jax's dot_product_attention with that implementation, the
    causal order as a mask, where there
    are no documents and no dropout."""
    rank = jax.lax.axis_index(CONTEXT)
    s = q.shape[1]
    k_all = jax.lax.all_gather(k, CONTEXT, axis=1, tiled=True)  # [b, s, g, k]
    v_all = jax.lax.all_gather(v, CONTEXT, axis=1, tiled=True)  # [b, s, g, k]
    seg_all = None if seg is None else jax.lax.all_gather(seg, CONTEXT, axis=1, tiled=True)  # [b, s]
    q_idx = local_order(rank, c, s, jnp)[None]  # [1, s/c]
    k_idx = jnp.asarray(seq_order(s * c, c))[None]  # [1, s]
    if fused is not None and seg is None and key is None:
        mask = causal_mask(q_idx, k_idx)[:, None]  # [1, 1, s/c, s]
        return jax.nn.dot_product_attention(q, k_all, v_all, mask=mask, implementation=fused)
    return attention(q, k_all, v_all, q_idx, k_idx, seg, seg_all, dropout_rate=rate,
                     dropout_key=_key(key, rank), inputs_only=True)


def _a2a(q, k, v, seg, key, *, c: int, rate: float, in_pipeline: bool = False, fused: str | None = None):
    """a2a (Ulysses): [b, s/c, n, k] -> [b, s, n/c, k] for q (n = h) and k, v (n = g).

    After the all-to-all each device holds the whole sequence (in the stored chunk order) for its
    heads. `fused` (a backend, e.g. CUDNN on NVIDIA GPUs): put it in the natural order and run
    plain causal attention with that backend, then back; None: XLA attention on the stored order
    with explicit positions (documents and dropout need it)."""
    rank = jax.lax.axis_index(CONTEXT)
    s = q.shape[1]

    def to_heads(x):  # [b, s/c, n, k] -> [b, s, n/c, k]
        return jax.lax.all_to_all(x, CONTEXT, split_axis=2, concat_axis=1, tiled=True)

    order = seq_order(s * c, c)  # stored slot j holds position order[j]
    if fused is not None and seg is None and key is None:
        natural = np.argsort(order)  # position p sits in stored slot natural[p]
        o = attention(*(to_heads(x)[:, natural] for x in (q, k, v)), backend=fused)[:, order]  # [b, s, h/c, k]
    else:
        seg_all = None if seg is None else jax.lax.all_gather(seg, CONTEXT, axis=1, tiled=True)  # [b, s]
        idx = jnp.asarray(order)[None]  # [1, s]
        o = attention(to_heads(q), to_heads(k), to_heads(v), idx, idx, seg_all, seg_all,
                      dropout_rate=rate, dropout_key=_key(key, rank), inputs_only=True)  # [b, s, h/c, k]
    return jax.lax.all_to_all(o, CONTEXT, split_axis=1, concat_axis=2, tiled=True)  # [b, s/c, h, k]


_IMPLS = {"p2p": _ring, "allgather": _allgather, "a2a": _a2a}


def _manual_axes(mesh) -> frozenset:
    """The axes this shard_map makes manual: every axis not manual already (inside the
    pipeline's shard_map, `pipe` is)."""
    return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Manual)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan, q, k, v, seg, key):
    """The shard_map'd attention of `plan` = (body, specs, axes)."""
    body, (q_spec, kv_spec, seg_spec), axes = plan
    return jax.shard_map(body, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, P()), out_specs=q_spec,
                         axis_names=axes)(q, k, v, seg, key)


def _attend_fwd(plan, q, k, v, seg, key):
    # Only the inputs are kept for the backward ([b, s/c, ...] each: nothing grows with C).
    # Left to autodiff, the residuals of a shard_map nested in the pipeline's get a dim sharded
    # (pipe, data) that Shardy rejects; recomputing the forward inside the backward's own
    # shard_map avoids both (flash attention recomputes its blocks too).
    return _attend(plan, q, k, v, seg, key), (q, k, v, seg, key)


def _attend_bwd(plan, res, do):
    body, (q_spec, kv_spec, seg_spec), axes = plan

    def grads(q, k, v, seg, key, do):
        _, vjp = jax.vjp(lambda q, k, v: body(q, k, v, seg, key), q, k, v)
        return vjp(do)  # the K/V cotangents travel the ring backwards

    dq, dk, dv = jax.shard_map(grads, in_specs=(q_spec, kv_spec, kv_spec, seg_spec, P(), q_spec),
                               out_specs=(q_spec, kv_spec, kv_spec), axis_names=axes)(*res, do)
    return dq, dk, dv, None, None


_attend.defvjp(_attend_fwd, _attend_bwd)


def context_attention(q_bshk, k_bsgk, v_bsgk, segment_ids_bs=None, *, dropout_rate: float = 0.0,
                      dropout_key=None, comm_type: str | None = None, fused: str | None = None) -> jax.Array:
    """Causal attention over the context-parallel sequence: [b, s, h, k] sharded [batch,
    s/context, heads, k], keys/values [b, s, g, k]; the stored sequence is in the load-balanced
    order of `chunks.seq_order`. Called inside the mesh and activation rules. `fused`: a
    backend (CUDNN on NVIDIA GPUs) whose fused kernels run each comm type's attention where
    there are no documents and no dropout: p2p's blocks (`_fused_ring`), allgather's masked
    attention, a2a's whole-sequence attention; None: the XLA blocks below (any mask, dropout).
    XLA given here runs the fused paths with XLA's kernels (the tests' check of them on a CPU)."""
    comm_type = check_comm_type(comm_type or "p2p")
    mesh = jax.sharding.get_abstract_mesh()
    c = dict(mesh.shape)[CONTEXT]
    axes = _manual_axes(mesh)
    # Inside the pipeline's stage body (`pipe` manual already) p2p gathers its blocks instead of
    # ringing them; nested only in the per-rank body of the once-per-step gradient reduction
    # (`data` manual), the ring runs as at top level.
    in_pipeline = PIPE in mesh.axis_names and PIPE not in axes
    specs = (spec_on_axes(("batch", "context_seq", "heads", "head_dim"), axes),
             spec_on_axes(("batch", "context_seq", "kv_heads", "head_dim"), axes),
             spec_on_axes(("batch", "context_seq"), axes))
    use_key = dropout_key is not None and dropout_rate > 0
    impl = functools.partial(_IMPLS[comm_type], in_pipeline=in_pipeline, fused=fused)
    body = functools.partial(_body, impl, c, dropout_rate if use_key else 0.0)
    key = dropout_key if use_key else jax.random.key(0)
    return _attend((body, specs, axes), q_bshk, k_bsgk, v_bsgk, segment_ids_bs, key)


def _body(impl, c, rate, q, k, v, seg, key):
    """Per device: q [b, s/c, h, k], k/v [b, s/c, g, k], seg [b, s/c] or None -> [b, s/c, h, k]."""
    return impl(q, k, v, seg, key if rate > 0 else None, c=c, rate=rate)
