"""Self-attention: the `Attention` module (projections) and `attention`, the one entry point
that turns q, k, v plus positions and segment ids into the attended values.

The mask is built here, from positions (causal: a key attends to a query when its position is
not later) and segment ids (documents: only within the same segment), so no [batch, seq, seq]
mask array exists outside this file, is carried through the layer scan or crosses a pipeline
stage. Queries and keys may differ in length (decoding one token against a cache) and positions
may be any integers (context-parallel chunks are not contiguous).

Backends (Megatron's `--attention-backend`):
  - `xla` (flags unfused, local): einsums in the compute dtype with fp32 accumulation and an
    fp32 softmax; grouped-query attention without repeating K/V (queries are grouped instead);
  - `cudnn` (flags flash, fused): `jax.nn.dot_product_attention(implementation="cudnn")`, the
    fused flash kernel of NVIDIA GPUs (bf16, causal, GQA native);
  - `auto`: cuDNN where it applies (NVIDIA GPU, bf16/fp16, no attention dropout, plain causal
    order, no document mask), XLA otherwise.

Shape letters: b batch, s query seq, t key seq, h heads, g kv groups, r heads per group,
k head dim, d embed.
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax import platform
from mlm_jax.config import ConfigError, ModelConfig
from mlm_jax.models import fp8
from mlm_jax.models.layers import (add_bias, cast, column_parallel, dropout, fp32_einsum, normal, param, rope_scaling,
                                    row_offset, row_parallel, rotary, value, zeros)
from mlm_jax.models.recompute import keep_attention
from mlm_jax.sharding import trace
from mlm_jax.sharding.rules import constrain, per_device

XLA, CUDNN = "xla", "cudnn"
_FLAG_TO_BACKEND = {"unfused": XLA, "local": XLA, "flash": CUDNN, "fused": CUDNN}
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def on_nvidia_gpu() -> bool:
    """Is the step being traced for NVIDIA (CUDA) GPUs? cuDNN's kernels exist nowhere else. The
    mesh's devices decide (a deviceless compile for GPUs runs in a CPU process)."""
    return platform.current() == platform.CUDA


def fused_attention_obstacle(m: ModelConfig, documents: bool) -> str | None:
    """Why cuDNN's fused attention cannot run this model (None: it can, on an NVIDIA GPU)."""
    if not (m.bf16 or m.fp16):
        return "cuDNN fused attention needs bf16 compute (add --bf16) or fp16 compute (--fp16)"
    if m.attention_dropout > 0:
        return f"cuDNN fused attention has no attention dropout (--attention-dropout {m.attention_dropout}; set 0)"
    if documents:
        return "cuDNN fused attention cannot mask documents (--reset-attention-mask)"
    if m.multi_latent_attention:  # values padded to the query/key width (models/mla.py)
        widest = _widest_cudnn_head()
        if m.head_dim % 8 or m.head_dim > widest or m.value_head_dim > m.head_dim:
            return ("cuDNN fused attention of multi-latent attention needs a query/key head dim (--qk-head-dim + "
                    f"--qk-pos-emb-head-dim) that is a multiple of 8, <= {widest} and >= --v-head-dim; got "
                    f"{m.head_dim} and {m.value_head_dim}"
                    + ("" if widest > 128 else " (256 on a Hopper or newer GPU)"))
    elif m.head_dim % 8 or m.head_dim > 128:
        return f"cuDNN fused attention needs a head dim that is a multiple of 8 and <= 128, got {m.head_dim}"
    return None


def _widest_cudnn_head() -> int:
    """The widest head jax lets cuDNN's fused attention take here: 256 on Hopper (or newer) GPUs,
    else 128. jax asks the device (`check_compute_capability`): the GPU this process runs on, or
    the target of a deviceless compile while its step is traced (`platform.compiling_for`)."""
    return 256 if platform.cudnn_capability_at_least("9.0") else 128


def choose_backend(cfg: ModelConfig, dtype, *, documents: bool, aligned: bool, dropout_on: bool,
                   nvidia_gpu: bool | None = None) -> str:
    """XLA or CUDNN for `cfg.attention_backend` in this call; ConfigError if flash/fused cannot
    run on the NVIDIA GPU this is for. Off NVIDIA GPUs flash/fused run XLA attention (a laptop
    smoke test of a GPU script; `backend_note` says so once).

    `documents`: segment ids are given; `aligned`: the plain causal order (no explicit
    positions, queries and keys the same tokens); `dropout_on`: attention dropout will be drawn.
    """
    flag = cfg.attention_backend
    if flag in ("unfused", "local"):
        return XLA
    nvidia_gpu = on_nvidia_gpu() if nvidia_gpu is None else nvidia_gpu
    if not nvidia_gpu:
        return XLA
    why = fused_attention_obstacle(cfg, documents)
    if why is None and jnp.dtype(dtype) not in [jnp.dtype(d) for d in _CUDNN_DTYPES]:
        why = f"cuDNN fused attention needs bf16 or fp16 inputs, got {jnp.dtype(dtype).name}"
    if why is None and dropout_on:
        why = "cuDNN fused attention has no attention dropout"
    if why is None and not aligned:
        why = "cuDNN fused attention here takes only the plain causal order (no explicit positions)"
    if flag == "auto":
        return XLA if why else CUDNN
    if why:
        raise ConfigError(f"--attention-backend {flag}: {why}; use --attention-backend auto or unfused")
    return _FLAG_TO_BACKEND[flag]


def backend_note(cfg: ModelConfig, platform_name: str) -> str | None:
    """The one line a run logs when --attention-backend flash/fused cannot mean cuDNN on
    `platform_name` (XLA attention runs instead); None otherwise."""
    if cfg.attention_backend in ("flash", "fused") and platform_name != platform.CUDA:
        return (f"--attention-backend {cfg.attention_backend}: cuDNN fused attention needs an NVIDIA GPU, "
                f"this is {platform_name}: XLA attention runs instead (the same math)")
    return None


def causal_mask(q_pos_bs, k_pos_bt, q_seg_bs=None, k_seg_bt=None) -> jax.Array:
    """[b or 1, s, t] bool: key position <= query position, and the same segment when given."""
    mask = k_pos_bt[:, None, :] <= q_pos_bs[:, :, None]
    if q_seg_bs is not None:
        mask = mask & (q_seg_bs[:, :, None] == k_seg_bt[:, None, :])
    return mask


def _xla_attention(q_bshk, k_btgk, v_btgk, mask_bst, rate: float, key, autodiff: bool = False,
                   blocks: int = 1) -> jax.Array:
    """softmax(q k^T / sqrt(k) + mask) v, grouped-query aware; softmax in fp32.

    Heads-major 4-d operands: each group's r query heads are folded into its rows
    ([b, g, r*s, k]), so K/V are never repeated and every product and the softmax are plain
    [b, g, rows, t] batched matrices. XLA:CPU runs these ~10% faster per step of workload W than
    the same math on [b, g, r, s, t] (benchmarks/RESULTS.md). `autodiff`: the core without its
    custom VJP (autodiff keeps the probabilities; see `attention`'s `inputs_only`). `blocks` > 1:
    the plain causal order without dropout in that many query blocks (`_attend_causal`)."""
    b, s, h, k = q_bshk.shape
    g, kv = k_btgk.shape[2], v_btgk.shape[3]  # kv: the value head dim (MLA's differs from k)
    r = h // g
    q = q_bshk.reshape(b, s, g, r, k).transpose(0, 2, 3, 1, 4).reshape(b, g, r * s, k)
    mask = jnp.tile(mask_bst, (1, r, 1))[:, None]  # [b or 1, 1, r*s, t]: row r*s_i + j is query j
    k_bgtk, v_bgtk = k_btgk.transpose(0, 2, 1, 3), v_btgk.transpose(0, 2, 1, 3)
    if blocks > 1:
        out = _attend_causal(q, k_bgtk, v_bgtk, mask, (r, blocks))
    else:
        core = _attend_plain if autodiff else _attend
        out = core(q, k_bgtk, v_bgtk, mask, key, row_offset(), rate)
    return out.reshape(b, g, r, s, kv).transpose(0, 3, 1, 2, 4).reshape(b, s, h, kv)


# q k^T in fp32 from compute-dtype operands; differentiated by autodiff (the `inputs_only` core),
# its backward matmuls stay in the compute dtype too (else the fp32 cotangent makes them fp32).
_scores = fp32_einsum("bgqk,bgtk->bgqt", "bgqt,bgtk->bgqk", "bgqt,bgqk->bgtk")


def _probs(q, k, mask, lse=None, scaled=False):
    """Softmax probabilities [b, g, q, t] (fp32) and, without `lse`, their log-normaliser
    [b, g, q, 1]; with it (the backward) the probabilities are exp(scores - lse). `scaled`:
    q already carries the scores' 1/sqrt(k)."""
    scores = _scores(q, k)
    scores = jnp.where(mask, scores if scaled else scores / math.sqrt(q.shape[-1]), jnp.finfo(jnp.float32).min)
    if lse is not None:
        return jnp.exp(scores - lse), lse
    top = jnp.max(scores, axis=-1, keepdims=True)
    exp = jnp.exp(scores - top)
    total = jnp.sum(exp, axis=-1, keepdims=True)
    return exp / total, top + jnp.log(total)


def _attend_plain(q, k, v, mask, key, row0, rate):
    return _attend_forward(q, k, v, mask, key, row0, rate)[0]  # autodiff differentiates this


def _attend_forward(q, k, v, mask, key, row0, rate, scaled=False):
    probs, lse = _probs(q, k, mask, scaled=scaled)
    with trace.using(row_offset=row0):
        probs = dropout(probs, rate, key)
    out, lse = keep_attention(jnp.einsum("bgqt,bgtk->bgqk", probs.astype(v.dtype), v), lse)
    return out, (q, k, v, mask, key, row0, lse, out)


def _attend_backward(rate, residuals, d_out, scaled=False, keys_minor=False):
    """The softmax's backward from the saved log-normaliser: the [b, g, q, t] probabilities
    are recomputed (one product and one exp), never kept between forward and backward.
    `scaled`: q carries the scores' 1/sqrt(k) (as `_probs`), so the gradient of q lacks it.
    `keys_minor`: the gradients of k and v come back as [b, g, k, t] fp32, products of q and
    d_out transposed first (see `_causal_backward`)."""
    q, k, v, mask, key, row0, lse, out = residuals
    probs, _ = _probs(q, k, mask, lse, scaled)
    d_probs = jnp.einsum("bgqk,bgtk->bgqt", d_out.astype(v.dtype), v, preferred_element_type=jnp.float32)
    with trace.using(row_offset=row0):  # the forward's mask again (a function of the key and the global rows)
        dropped = dropout(probs, rate, key).astype(v.dtype)
        d_probs = dropout(d_probs, rate, key)  # through the dropout: the same mask and scale
    # softmax: d_scores = p * (d_p - sum_t d_p p), and sum_t d_p p = sum_k d_out out.
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    d_scores = probs * (d_probs - row)
    d_scores = (d_scores if scaled else d_scores / math.sqrt(q.shape[-1])).astype(q.dtype)
    d_q = jnp.einsum("bgqt,bgtk->bgqk", d_scores, k, preferred_element_type=jnp.float32)
    if keys_minor:  # plain products [k, q] x [q, t]: no row-contracting product of the scores
        def minor(x):  # [b, g, q, k] -> [b, g, k, q], kept so (XLA would fold it into the product)
            return jax.lax.optimization_barrier(jnp.swapaxes(x, 2, 3))
        d_v = jnp.einsum("bgkq,bgqt->bgkt", minor(d_out.astype(v.dtype)), dropped, preferred_element_type=jnp.float32)
        d_k = jnp.einsum("bgkq,bgqt->bgkt", minor(q), d_scores, preferred_element_type=jnp.float32)
        return d_q.astype(q.dtype), d_k, d_v, None, None, None
    d_v = jnp.einsum("bgqt,bgqk->bgtk", dropped, d_out.astype(v.dtype),
                     preferred_element_type=jnp.float32).astype(v.dtype)
    d_k = jnp.einsum("bgqt,bgqk->bgtk", d_scores, q, preferred_element_type=jnp.float32)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v, None, None, None


# The XLA attention core on heads-major operands, q [b, g, rows, k], k and v [b, g, t, k], mask
# [b or 1, 1, rows, t], the dropout key and the global index of row 0 (the trace's `row_offset`). Like a
# fused (flash) kernel it keeps only the output and the softmax's log-normaliser [b, g, rows]
# for the backward, not the [b, g, rows, t] probabilities; products in the compute dtype with
# fp32 accumulation, the softmax in fp32.
_attend = jax.custom_vjp(_attend_plain, nondiff_argnums=(6,))
_attend.defvjp(_attend_forward, _attend_backward)


# The plain causal order (queries and keys the same tokens, no dropout) in query blocks on a CPU:
# block i (rows [i*B, (i+1)*B) of each query head) is attended against keys [0, (i+1)*B) only,
# so the products, the softmax and their backward skip the blocks above the diagonal that the
# mask would zero ((n + 1) / 2n of the square's work for n blocks), and each block's [B, t]
# scores stay in the caches. `_attend`'s forward and backward run per block; key and value
# gradients sum over the blocks that see them. Workload W (seq 256, 8 blocks of 32 rows): one
# layer's attention forward and backward 42.6 -> 29.2 ms (benchmarks/RESULTS.md). q carries the
# 1/sqrt(k) scale (one multiply of q, where XLA:CPU otherwise fills a [rows, t] array with the
# constant for each block's fused softmax backward), and the key and value gradients are plain
# products of q and d_out transposed ([k, rows] x [rows, t], `keys_minor`) where XLA:CPU ran the
# row-contracting product of the scores through Eigen: 28.4 -> 22.7 ms. Accelerators keep one
# square (cuDNN's kernel skips those blocks itself).
_CAUSAL_BLOCKS = {platform.CPU: 8}
_MIN_BLOCK_ROWS = 32


def causal_blocks(s: int, t: int, dropout_on: bool) -> int:
    """How many query blocks the plain causal order of `s` queries and `t` keys runs in here
    (1: one square): on a CPU, without dropout, as many queries as keys."""
    blocks = _CAUSAL_BLOCKS.get(platform.current(), 1) if s == t and not dropout_on else 1
    while blocks > 1 and (s % blocks or s // blocks < _MIN_BLOCK_ROWS):
        blocks //= 2
    return blocks


def _block_rows(x, r, i, rows):
    """Rows [i*rows, (i+1)*rows) of each of the r query heads of x [.., r*s, ..] (axis 2)."""
    lead, rs, rest = x.shape[:2], x.shape[2], x.shape[3:]
    x = x.reshape(*lead, r, rs // r, *rest)[:, :, :, i * rows:(i + 1) * rows]
    return x.reshape(*lead, r * rows, *rest)


def _join_rows(parts, r):
    """The inverse of `_block_rows` over all blocks: [.., r*rows, ..] parts -> [.., r*s, ..]."""
    lead, rest = parts[0].shape[:2], parts[0].shape[3:]
    parts = [p.reshape(*lead, r, -1, *rest) for p in parts]
    joined = jnp.concatenate(parts, axis=3)
    return joined.reshape(*lead, -1, *rest)


def _causal_forward(q, k, v, mask, static):
    r, blocks = static
    rows = q.shape[2] // r // blocks
    q = q * (1 / math.sqrt(q.shape[-1]))  # once, not on every block's scores
    outs, lses = [], []
    for i in range(blocks):
        seen = (i + 1) * rows
        out, residuals = _attend_forward(_block_rows(q, r, i, rows), k[:, :, :seen], v[:, :, :seen],
                                         _block_rows(mask, r, i, rows)[..., :seen], None, 0, 0.0, scaled=True)
        outs.append(out)
        lses.append(residuals[6])
    out, lse = keep_attention(_join_rows(outs, r), _join_rows(lses, r))
    return out, (q, k, v, mask, lse, out)  # q scaled


def _causal_backward(static, residuals, d_out):
    r, blocks = static
    q, k, v, mask, lse, out = residuals
    rows = q.shape[2] // r // blocks
    minor = lambda x: (*x.shape[:2], x.shape[3], x.shape[2])  # noqa: E731 - [b, g, k, t]: the blocks' gradients
    d_q, d_k, d_v = [], jnp.zeros(minor(k), jnp.float32), jnp.zeros(minor(v), jnp.float32)
    for i in range(blocks):
        seen = (i + 1) * rows
        block = lambda x: _block_rows(x, r, i, rows)  # noqa: E731
        dq, dk, dv, *_ = _attend_backward(0.0, (block(q), k[:, :, :seen], v[:, :, :seen], block(mask)[..., :seen],
                                                None, 0, block(lse), block(out)), block(d_out),
                                          scaled=True, keys_minor=True)
        d_q.append(dq)
        d_k = d_k.at[..., :seen].add(dk)
        d_v = d_v.at[..., :seen].add(dv)
    d_q = _join_rows(d_q, r) * (1.0 / math.sqrt(q.shape[-1]))  # the forward's scale of q
    return d_q, jnp.swapaxes(d_k, 2, 3).astype(k.dtype), jnp.swapaxes(d_v, 2, 3).astype(v.dtype), None


def _causal_plain(q, k, v, mask, static):
    return _causal_forward(q, k, v, mask, static)[0]


_attend_causal = jax.custom_vjp(_causal_plain, nondiff_argnums=(4,))
_attend_causal.defvjp(_causal_forward, _causal_backward)


def attention(q_bshk, k_btgk, v_btgk, q_pos_bs=None, k_pos_bt=None, q_seg_bs=None, k_seg_bt=None,
              *, backend: str = XLA, dropout_rate: float = 0.0, dropout_key=None,
              inputs_only: bool = False) -> jax.Array:
    """Attention output [b, s, h, v] for queries [b, s, h, k], keys [b, t, g, k] and values
    [b, t, g, v] (v == k but under multi-latent attention); scores scaled by 1/sqrt(k).

    Positions ([b or 1, s] and [b or 1, t] ints) order the tokens causally; None for both means
    the plain order, the queries being the last s of the t keys. Segment ids (documents) restrict
    attention to equal ids. Neither backend keeps the [b, h, s, t] probabilities for the backward
    (the XLA core recomputes them from the softmax's log-normaliser, cuDNN's kernel likewise), so
    Megatron's selective recompute is what every run does. `backend` is XLA or CUDNN (see
    `choose_backend`). `inputs_only`: the XLA core keeps only its inputs for the backward and
    recomputes the rest by autodiff (`jax.checkpoint`, no custom VJP); context parallelism's
    gather and all-to-all ask for it: inside their shard_map nested in a pipeline stage, the
    custom VJP's saved output and log-normaliser leave the shard_map as residuals, which Shardy's
    verifier rejects there ("manual axes come before free axes").
    """
    s, t = q_bshk.shape[1], k_btgk.shape[1]
    if backend == CUDNN:
        if q_pos_bs is not None or q_seg_bs is not None or s != t:
            raise ConfigError("cuDNN fused attention here takes only the plain causal order "
                              "(no positions, no segment ids, as many queries as keys)")
        return _cudnn_attention(q_bshk, k_btgk, v_btgk)
    if (q_pos_bs is None) != (k_pos_bt is None):
        raise ValueError("give both query and key positions, or neither")
    blocks = 1
    if q_pos_bs is None:
        k_pos_bt = jnp.arange(t, dtype=jnp.int32)[None]  # [1, t]
        q_pos_bs = k_pos_bt[:, t - s:]  # [1, s]
        blocks = causal_blocks(s, t, dropout_key is not None and dropout_rate > 0)
    mask_bst = causal_mask(q_pos_bs, k_pos_bt, q_seg_bs, k_seg_bt)
    if inputs_only:
        return jax.checkpoint(_xla_attention, static_argnums=(4, 6))(
            q_bshk, k_btgk, v_btgk, mask_bst, dropout_rate, dropout_key, True)
    return _xla_attention(q_bshk, k_btgk, v_btgk, mask_bst, dropout_rate, dropout_key, blocks=blocks)


def _cudnn_causal(q_bshk, k_btgk, v_btgk):
    return jax.nn.dot_product_attention(q_bshk, k_btgk, v_btgk, is_causal=True, implementation="cudnn")


# cuDNN's fused attention on each device's block [batch/.., seq, heads/tensor, k]: its custom
# partitioner fails inside the partly manual programs of data parallelism and the pipeline
# (jax's _dot_product_attention_fwd_partition), so it is never asked to partition anything.
_cudnn_attention = per_device(
    _cudnn_causal,
    (("batch", "context_seq", "heads", "head_dim"), ("batch", "context_seq", "kv_heads", "head_dim"),
     ("batch", "context_seq", "kv_heads", "head_dim")),
    ("batch", "context_seq", "heads", "head_dim"))


# --------------------------------------------------------------------------- blocks
# One block of blockwise (ring) attention: queries against one block of keys, returning the
# output normalised over this block and the softmax's log-normaliser, and the block's backward
# given the *merged* output and log-normaliser of all blocks (flash attention's blockwise
# backward: P = exp(scores - lse), D = rowsum(dO * O)). Shapes per device: q [b, s, h, k],
# k/v [b, t, g, k], output [b, s, h, k] in q's dtype, lse [b, h, s] fp32 (h in the grouped
# order: head i*r + j is query head j of group i). `causal`: the plain causal mask (s == t, the
# same tokens); else no mask. XLA: the core above; CUDNN: cuDNN's fused kernels, the backward
# fed the given statistics (what Transformer Engine's ring attention does with them).


def block_forward(q_bshk, k_btgk, v_btgk, causal: bool, backend: str = XLA):
    """(output [b, s, h, k], lse [b, h, s] fp32) of q against this block only."""
    if backend == CUDNN:
        return _cudnn_block_forward(q_bshk, k_btgk, v_btgk, causal)
    q, k, v, mask = _heads_major(q_bshk, k_btgk, v_btgk, causal)
    out, residuals = _attend_forward(q, k, v, mask, None, 0, 0.0)
    return _tokens_major(out, q_bshk.shape), _lse_bhs(residuals[6], q_bshk.shape)


def block_backward(q_bshk, k_btgk, v_btgk, causal: bool, o_bshk, lse_bhs, do_bshk, backend: str = XLA):
    """(dq, dk, dv) of this block for the merged output `o` and log-normaliser `lse`."""
    if backend == CUDNN:
        return _cudnn_block_backward(q_bshk, k_btgk, v_btgk, causal, o_bshk, lse_bhs, do_bshk)
    b, s, h, kd = q_bshk.shape
    g = k_btgk.shape[2]
    q, k, v, mask = _heads_major(q_bshk, k_btgk, v_btgk, causal)
    rows = lambda x: x.reshape(b, s, g, h // g, kd).transpose(0, 2, 3, 1, 4).reshape(b, g, -1, kd)  # noqa: E731
    lse = lse_bhs.reshape(b, g, -1, 1)  # [b, g, r*s, 1]: row r_i*s + j as in `rows`
    dq, dk, dv, *_ = _attend_backward(0.0, (q, k, v, mask, None, 0, lse, rows(o_bshk)), rows(do_bshk))
    return _tokens_major(dq, q_bshk.shape), dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


def _heads_major(q_bshk, k_btgk, v_btgk, causal):
    """The XLA core's operands: q [b, g, r*s, k], k/v [b, g, t, k], mask [1, 1, r*s, t]."""
    b, s, h, kd = q_bshk.shape
    t, g = k_btgk.shape[1], k_btgk.shape[2]
    q = q_bshk.reshape(b, s, g, h // g, kd).transpose(0, 2, 3, 1, 4).reshape(b, g, -1, kd)
    keep = causal_mask(jnp.arange(s)[None], jnp.arange(t)[None]) if causal else jnp.ones((1, s, t), bool)
    mask = jnp.tile(keep, (1, h // g, 1))[:, None]
    return q, k_btgk.transpose(0, 2, 1, 3), v_btgk.transpose(0, 2, 1, 3), mask


def _tokens_major(x_bgrk, shape):
    """[b, g, r*s, k] rows back to [b, s, h, k]."""
    b, s, h, kd = shape
    g = x_bgrk.shape[1]
    return x_bgrk.reshape(b, g, h // g, s, kd).transpose(0, 3, 1, 2, 4).reshape(shape)


def _lse_bhs(lse_bgq1, shape):
    b, s, h, _ = shape
    return lse_bgq1.reshape(b, h, s)


def _cudnn_rules(q_bshk, causal):
    """jax's internal cuDNN fused-attention rules (jax._src) and the arguments this call gives
    them after q, k, v: (the forward rule's, the operands among them that the forward keeps for
    the backward, the backward rule's static ones). No bias, sequence lengths, offsets, pages or
    score modifier, no dropout, BTNH layout. The rules' signatures differ between jax versions
    (0.12 added `score_mod_args` and `score_mod`; the backward's static arguments come in the
    forward's order, the cuDNN version among them, named `is_training` in 0.10), so arguments
    are matched by name: the GPU-compile tier compiles them on the oldest and the newest jax,
    and `benchmarks/gpu.py --check-blocks` checks the kernels' numbers against
    `block_forward`'s XLA path on a real GPU."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    unused = jnp.zeros(0, q_bshk.dtype)
    version = fa.check_cudnn_version()
    values = {"bias": unused, "q_seqlen": unused, "kv_seqlen": unused, "q_offsets": unused, "kv_offsets": unused,
              "page_table_k": unused, "page_table_v": unused, "score_mod_args": (),
              "scale": 1.0 / math.sqrt(q_bshk.shape[-1]), "seed": 0, "dropout_rate": 0.0,
              "variadic_args": (False, False), "mask_type": fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK,
              "layout": fa.AttentionLayout.BTNH.value, "sliding_window_length": None, "score_mod": None,
              "cudnn_version": version, "is_training": version, "return_residual": True}
    forward = list(inspect.signature(fa._dot_product_attention_fwd_rule).parameters)[3:]
    backward = list(inspect.signature(fa._dot_product_attention_bwd_rule).parameters)[:-2]  # less res, grads
    return (fa, [values[n] for n in forward], [values[n] for n in forward[:forward.index("scale")]],
            [values[n] for n in backward])


def _cudnn_block_forward(q_bshk, k_btgk, v_btgk, causal):
    fa, forward, _, _ = _cudnn_rules(q_bshk, causal)
    (out, stats), _ = fa._dot_product_attention_fwd_rule(q_bshk, k_btgk, v_btgk, *forward)
    return out, stats.astype(jnp.float32)  # stats: [b, h, s], the log-sum-exp of the scaled scores


def _cudnn_block_backward(q_bshk, k_btgk, v_btgk, causal, o_bshk, lse_bhs, do_bshk):
    fa, _, operands, static = _cudnn_rules(q_bshk, causal)
    residuals = (q_bshk, k_btgk, v_btgk, *operands, lse_bhs, o_bshk)  # the forward rule's, in its order
    grads = fa._dot_product_attention_bwd_rule(*static, residuals, (do_bshk, None))
    return grads[0], grads[1], grads[2]


WQKV, WO = ("embed", "kv_heads", None, "head_dim"), ("heads", "head_dim", "embed")


class Attention(nnx.Module):
    """Fused QKV projection (column parallel), rotary, `attention`, output projection (row
    parallel). Inside, the sequence is whole and heads are split: [batch, seq, heads/tensor, k]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, g, k = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init of output layers
        self.cfg = cfg
        # Megatron's layout: per kv group, its r query heads then its key and value heads
        # ([d, g, r + 2, k]); one matmul, so its input gradient is one partial sum and one
        # all-reduce.
        self.wqkv = param(rngs, normal(std), (d, g, h // g + 2, k), WQKV)
        self.wo = param(rngs, normal(out_std), (h, k, d), WO)
        # delayed fp8 scaling's amax histories (models/fp8.py), else None
        self.fp8_history_qkv, self.fp8_history_out = fp8.history(cfg), fp8.history(cfg)
        if cfg.add_bias_linear:
            self.bqkv = param(None, zeros, (g, h // g + 2, k), ("kv_heads", None, "head_dim"))
            self.bo = param(None, zeros, (d,), ("embed",))
        else:
            self.bqkv = self.bo = None

    def _project(self, y_bsd, positions_bs):
        """q [b, s, h, k], k and v [b, s, g, k] (rotary applied) for the normed input y."""
        cfg, dt = self.cfg, y_bsd.dtype
        qkv_names = ("batch", "context_seq", "kv_heads", None, "head_dim")  # j: r queries, k, v
        qkv = column_parallel("bsd,dgjk->bsgjk", y_bsd, cast(self.wqkv, dt), WQKV, qkv_names, fp8.recipe(cfg),
                              value(self.fp8_history_qkv))
        qkv = constrain(add_bias(qkv, cast(self.bqkv, dt)), qkv_names)
        b, s, g, j, hd = qkv.shape
        q = qkv[:, :, :, : j - 2].reshape(b, s, g * (j - 2), hd)  # [b, s, h, k], grouped order
        k, v = qkv[:, :, :, j - 2], qkv[:, :, :, j - 1]  # [b, s, g, k]
        # Pinning each piece (and so its cotangent) keeps the backward head-parallel too.
        q = constrain(q, ("batch", "context_seq", "heads", "head_dim"))
        k = constrain(k, ("batch", "context_seq", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "context_seq", "kv_heads", "head_dim"))
        if cfg.position_embedding_type == "rope":
            scaling = rope_scaling(cfg)
            q = rotary(q, positions_bs, cfg.rotary_base, cfg.rotary_percent, scaling)
            k = rotary(k, positions_bs, cfg.rotary_base, cfg.rotary_percent, scaling)
        return q, k, v

    def __call__(self, y_bsd, positions_bs, segment_ids_bs, key) -> jax.Array:
        """y: the normed input [batch, seq, embed] (whole seq); returns [batch, seq, embed]
        before the residual add (the row-parallel all-reduce or reduce-scatter follows)."""
        cfg, dt = self.cfg, y_bsd.dtype
        q, k, v = self._project(y_bsd, positions_bs)
        dropout_on = key is not None and cfg.attention_dropout > 0
        backend = choose_backend(cfg, dt, documents=segment_ids_bs is not None, aligned=True,
                                 dropout_on=dropout_on)
        o = self._context_parallel(q, k, v, segment_ids_bs, key, backend)
        if o is not None:
            return self._project_out(o)
        o = attention(q, k, v, None, None, segment_ids_bs, segment_ids_bs, backend=backend,
                      dropout_rate=cfg.attention_dropout, dropout_key=key)  # [b, s, h, k]
        return self._project_out(o)

    def _project_out(self, o_bshk) -> jax.Array:
        """Row-parallel output projection: [batch, seq, heads, k] -> [batch, seq, embed]."""
        dt = o_bshk.dtype
        names = ("batch", "context_seq", "heads", "head_dim")
        o = row_parallel("bshk,hkd->bsd", constrain(o_bshk, names), cast(self.wo, dt), names, WO,
                         fp8.recipe(self.cfg), value(self.fp8_history_out))
        return add_bias(o, cast(self.bo, dt))

    def _context_parallel(self, q, k, v, segment_ids_bs, key, backend):
        """Attention over the context-parallel sequence split (None when it is not split).

        The stored sequence is in the load-balanced chunk order; rotary has already used the
        original positions, and the causal order is rebuilt from the chunk layout inside.
        `backend` CUDNN: a2a's whole-sequence attention runs cuDNN's kernel. The function is
        the trace's (`parallel.tracing` installs it where the mesh splits the sequence)."""
        context_attention = trace.current().context_attention
        if context_attention is None:
            return None
        return context_attention(q, k, v, segment_ids_bs, dropout_rate=self.cfg.attention_dropout,
                                 dropout_key=key, fused=CUDNN if backend == CUDNN else None)

    def cached(self, y_bsd, positions_bs, cache_k_btgk, cache_v_btgk):
        """Attention of s new tokens against a KV cache; returns (out [b, s, d], k cache, v cache).

        Cache slot = token position: the new keys/values are written at their positions
        (s > 1, the prefill: every row starts at position 0; s == 1, a decode step: each row
        at its own position) and a query sees the slots at or before its position, so the
        unwritten (or right-padding) slots past it are masked by the causal rule itself.
        """
        q, k, v = self._project(y_bsd, positions_bs)
        t = cache_k_btgk.shape[1]
        if y_bsd.shape[1] == 1:
            at = (jnp.arange(t)[None, :] == positions_bs)[:, :, None, None]  # [b, t, 1, 1]
            cache_k_btgk = jnp.where(at, k.astype(cache_k_btgk.dtype), cache_k_btgk)
            cache_v_btgk = jnp.where(at, v.astype(cache_v_btgk.dtype), cache_v_btgk)
        else:
            cache_k_btgk = jax.lax.dynamic_update_slice(cache_k_btgk, k.astype(cache_k_btgk.dtype), (0, 0, 0, 0))
            cache_v_btgk = jax.lax.dynamic_update_slice(cache_v_btgk, v.astype(cache_v_btgk.dtype), (0, 0, 0, 0))
        cache_k_btgk = constrain(cache_k_btgk, ("batch", None, "kv_heads", "head_dim"))
        cache_v_btgk = constrain(cache_v_btgk, ("batch", None, "kv_heads", "head_dim"))
        k_pos = jnp.arange(t, dtype=jnp.int32)[None]  # [1, t]
        o = attention(q, cache_k_btgk.astype(q.dtype), cache_v_btgk.astype(q.dtype), positions_bs, k_pos)
        return self._project_out(o), cache_k_btgk, cache_v_btgk
