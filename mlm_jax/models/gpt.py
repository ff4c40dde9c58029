"""A decoder-only transformer: the GPT-2/GPT-3 family and the Llama family, chosen by config.

Parameters are Flax NNX `Param`s whose `out_sharding` metadata holds *logical* dim names; the
activations at block boundaries are constrained by logical names too (`constrain`). Nothing
here knows about a mesh: `mlm_jax/sharding/rules.py` decides where each dim lives.

Layers are stacked on a leading `layers` dim and run with one `lax.scan`, so the compiled
program holds one layer body whatever the depth.

Shape letters: b batch, s/t sequence (query/key), d embed, h heads, g kv groups,
r heads per group, k head dim, f mlp, v vocab, l layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.config import ModelConfig
from mlm_jax.sharding.rules import constrain

BLOCK_BOUNDARY = ("batch", "seq", "embed")
PADDED_LOGIT = -1e30


def _normal(std: float):
    return nnx.initializers.normal(stddev=std)


def _param(rngs: nnx.Rngs | None, init, shape, names) -> nnx.Param:
    value = init(rngs.params(), shape, jnp.float32) if rngs is not None else init(shape, jnp.float32)
    return nnx.Param(value, out_sharding=tuple(names))


def _vocab_rows(std: float, vocab_size: int):
    """Init for a [padded vocab, ...] table: the true rows random, the padding rows zero.

    Drawing only `vocab_size` rows makes the initial values independent of the padding, which
    grows with the tensor-parallel size; with the padded logits masked in the loss the model
    then computes the same function on every layout.
    """

    def init(key, shape, dtype):
        rows = jax.random.normal(key, (vocab_size, *shape[1:]), dtype) * std
        return jnp.pad(rows, [(0, shape[0] - vocab_size)] + [(0, 0)] * (len(shape) - 1))

    return init


def _ones(shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


def _zeros(shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


class Norm(nnx.Module):
    """LayerNorm (with bias, as Megatron always has) or RMSNorm; computed in fp32."""

    def __init__(self, cfg: ModelConfig):
        d = cfg.hidden_size
        self.rms = cfg.normalization == "RMSNorm"
        self.eps = cfg.norm_epsilon
        self.scale = _param(None, _ones, (d,), ("embed",))
        self.bias = None if self.rms else _param(None, _zeros, (d,), ("embed",))

    def __call__(self, x_bsd: jax.Array) -> jax.Array:
        x = x_bsd.astype(jnp.float32)
        if self.rms:
            y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        else:
            mean = jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
            y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x_bsd.dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when `key` is None (evaluation) or the rate is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def rotary(x_bshk: jax.Array, positions_bs: jax.Array, base: float) -> jax.Array:
    """Rotary embedding, rotate-half layout (Megatron's and Hugging Face Llama's)."""
    half = x_bshk.shape[-1] // 2
    inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))  # [k/2]
    angles = positions_bs.astype(jnp.float32)[..., None] * inv_freq  # [b, s, k/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [b, s, 1, k/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_bshk.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bshk.dtype)


def attention_core(q_bshk, k_bsgk, v_bsgk, mask_bst, rate: float, key) -> jax.Array:
    """softmax(q k^T / sqrt(k) + mask) v, grouped-query aware; softmax in fp32."""
    b, s, h, k = q_bshk.shape
    g = k_bsgk.shape[2]
    q = q_bshk.reshape(b, s, g, h // g, k)  # [b, s, g, r, k]
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, k_bsgk, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(k)
    scores = jnp.where(mask_bst[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)  # [b, g, r, s, t]
    probs = dropout(probs, rate, key).astype(v_bsgk.dtype)
    out = jnp.einsum("bgrst,btgk->bsgrk", probs, v_bsgk)  # [b, s, g, r, k]
    return out.reshape(b, s, h, k)


class Block(nnx.Module):
    """One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, g, k, f = cfg.hidden_size, cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.ffn_size
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init of output layers
        self.cfg = cfg
        self.norm1 = Norm(cfg)
        # Column-parallel fused QKV, Megatron's layout: per kv group, its r query heads then its
        # key and value heads ([d, g, r + 2, k]); one matmul, so its input gradient is one partial
        # sum and one all-reduce. Row-parallel output projection.
        self.wqkv = _param(rngs, _normal(std), (d, g, h // g + 2, k), ("embed", "kv_heads", None, "head_dim"))
        self.wo = _param(rngs, _normal(out_std), (h, k, d), ("heads", "head_dim", "embed"))
        self.norm2 = Norm(cfg)
        # Column-parallel fc1 (SwiGLU: [d, 2, f], gate then up, fused for the same reason),
        # row-parallel fc2.
        w1_shape, w1_names = ((d, 2, f), ("embed", None, "mlp")) if cfg.swiglu else ((d, f), ("embed", "mlp"))
        self.w1 = _param(rngs, _normal(std), w1_shape, w1_names)
        self.w2 = _param(rngs, _normal(out_std), (f, d), ("mlp", "embed"))
        if cfg.add_bias_linear:
            self.bqkv = _param(None, _zeros, (g, h // g + 2, k), ("kv_heads", None, "head_dim"))
            self.bo = _param(None, _zeros, (d,), ("embed",))
            self.b1 = _param(None, _zeros, w1_shape[1:], w1_names[1:])
            self.b2 = _param(None, _zeros, (d,), ("embed",))
        else:
            self.bqkv = self.bo = self.b1 = self.b2 = None

    def __call__(self, x_bsd, positions_bs, mask_bst, key) -> jax.Array:
        cfg = self.cfg
        keys = jax.random.split(key, 3) if key is not None else (None, None, None)
        dt = x_bsd.dtype

        def w(p):
            return None if p is None else p[...].astype(dt)

        def add(y, b):
            return y if b is None else y + b

        # Attention. Inside it the sequence is whole and heads are split: [batch, seq, heads/tensor, k].
        # With sequence parallelism the norm runs on [batch, seq/tensor, embed]; its output is
        # gathered to the whole sequence here, before the column-parallel matmul (Megatron's SP).
        y = constrain(self.norm1(x_bsd), ("batch", None, "embed"))
        qkv = add(jnp.einsum("bsd,dgjk->bsgjk", y, w(self.wqkv)), w(self.bqkv))  # j: r queries, k, v
        qkv = constrain(qkv, ("batch", None, "kv_heads", None, "head_dim"))
        b, s, g, j, hd = qkv.shape
        q = qkv[:, :, :, : j - 2].reshape(b, s, g * (j - 2), hd)  # [b, s, h, k], grouped order
        kk, v = qkv[:, :, :, j - 2], qkv[:, :, :, j - 1]  # [b, s, g, k]
        # Pinning each piece (and so its cotangent) keeps the backward head-parallel too.
        q = constrain(q, ("batch", None, "heads", "head_dim"))
        kk = constrain(kk, ("batch", None, "kv_heads", "head_dim"))
        v = constrain(v, ("batch", None, "kv_heads", "head_dim"))
        if cfg.position_embedding_type == "rope":
            q = rotary(q, positions_bs, cfg.rotary_base)
            kk = rotary(kk, positions_bs, cfg.rotary_base)
        core = attention_core
        if cfg.recompute_granularity == "selective":
            # Megatron's selective recompute: keep the [b, h, s, t] scores out of memory.
            core = jax.checkpoint(attention_core, static_argnums=(4,))
        o = core(q, kk, v, mask_bst, cfg.attention_dropout, keys[0])  # [b, s, h, k]
        o = constrain(o, ("batch", None, "heads", "head_dim"))
        o = add(jnp.einsum("bshk,hkd->bsd", o, w(self.wo)), w(self.bo))  # row parallel: all-reduce
        x_bsd = x_bsd + dropout(o, cfg.hidden_dropout, keys[1])
        x_bsd = constrain(x_bsd, BLOCK_BOUNDARY)

        # MLP: [batch, seq, mlp/tensor] in the middle.
        y = constrain(self.norm2(x_bsd), ("batch", None, "embed"))
        if cfg.swiglu:
            gu = add(jnp.einsum("bsd,dnf->bsnf", y, w(self.w1)), w(self.b1))  # n: gate, up
            u = jax.nn.silu(gu[:, :, 0]) * gu[:, :, 1]
        else:
            u = jax.nn.gelu(add(jnp.einsum("bsd,df->bsf", y, w(self.w1)), w(self.b1)),
                            approximate=cfg.openai_gelu)
        u = constrain(u, ("batch", None, "mlp"))
        o = add(jnp.einsum("bsf,fd->bsd", u, w(self.w2)), w(self.b2))  # row parallel: all-reduce
        x_bsd = x_bsd + dropout(o, cfg.hidden_dropout, keys[2])
        return constrain(x_bsd, BLOCK_BOUNDARY)


class GPT(nnx.Module):
    """Embedding -> scanned stack of `Block`s -> final norm -> LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v, std = cfg.hidden_size, cfg.vocab, cfg.init_method_std
        self.embed = _param(rngs, _vocab_rows(std, cfg.vocab_size), (v, d), ("vocab", "embed"))
        self.pos_embed = (
            _param(rngs, _normal(std), (cfg.max_position_embeddings, d), (None, "embed"))
            if cfg.position_embedding_type == "learned_absolute"
            else None
        )

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = Norm(cfg)
        self.lm_head = (
            _param(rngs, lambda k, shp, dt: _vocab_rows(std, cfg.vocab_size)(k, shp[::-1], dt).T,
                   (d, v), ("embed", "vocab"))
            if cfg.untie_embeddings_and_output_weights
            else None
        )

    @property
    def dtype(self):
        return jnp.bfloat16 if self.cfg.bf16 else jnp.float32

    def embed_tokens(self, tokens_bs, positions_bs, key) -> jax.Array:
        """Token (+ learned position) embedding with dropout: [batch, seq, embed]."""
        dt = self.dtype
        x = self.embed[...].astype(dt)[tokens_bs]  # [b, s, d], vocab-parallel lookup
        if self.pos_embed is not None:
            x = x + self.pos_embed[...].astype(dt)[positions_bs]
        x = dropout(x, self.cfg.hidden_dropout, key)
        return constrain(x, BLOCK_BOUNDARY)

    def output_logits(self, x_bsd) -> jax.Array:
        """Final norm and LM head: fp32 logits [batch, seq, padded vocab], padding masked."""
        x = self.final_norm(x_bsd)
        head_dv = self.lm_head[...] if self.lm_head is not None else self.embed[...].T
        logits = jnp.einsum("bsd,dv->bsv", x, head_dv.astype(self.dtype),
                            preferred_element_type=jnp.float32)
        logits = constrain(logits, ("batch", None, "vocab"))
        # Padding columns can never be the answer; masking them keeps the softmax (and so the
        # loss and every gradient) independent of how much padding the layout needs.
        real = jnp.arange(logits.shape[-1]) < self.cfg.vocab_size
        return jnp.where(real, logits, PADDED_LOGIT)

    def __call__(
        self,
        tokens_bs: jax.Array,
        positions_bs: jax.Array | None = None,
        segment_ids_bs: jax.Array | None = None,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [batch, seq, padded vocab] in fp32; the padding columns hold a large negative.

        `dropout_key=None` means no dropout.
        """
        b, s = tokens_bs.shape
        if positions_bs is None:
            positions_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        keys = (None, None) if dropout_key is None else tuple(jax.random.split(dropout_key))
        x = self.embed_tokens(tokens_bs, positions_bs, keys[0])
        x = run_layers(self.layers, x, positions_bs, attention_mask(s, segment_ids_bs), keys[1])
        return self.output_logits(x)


def attention_mask(seq: int, segment_ids_bs: jax.Array | None) -> jax.Array:
    """Causal mask [1 or batch, seq, seq]; within documents only when segment ids are given."""
    mask_bst = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None]
    if segment_ids_bs is not None:
        # Per-document attention inside packed samples (--reset-attention-mask).
        mask_bst = mask_bst & (segment_ids_bs[:, :, None] == segment_ids_bs[:, None, :])
    return mask_bst


def run_layers(layers: Block, x_bsd, positions_bs, mask_bst, key, first_layer=0) -> jax.Array:
    """Run a stack of layers (a `Block` whose params have a leading layers dim) with one scan.

    `first_layer` offsets the per-layer dropout keys, so a pipeline stage holding layers
    [first_layer, first_layer + n) draws the same masks as the unpipelined model.
    """
    cfg = layers.cfg
    graphdef, layer_state = nnx.split(layers)
    n = jax.tree.leaves(layer_state)[0].shape[0]

    def body(x, xs):
        state_l, index = xs
        layer_key = None if key is None else jax.random.fold_in(key, index)
        return nnx.merge(graphdef, state_l)(x, positions_bs, mask_bst, layer_key), None

    if cfg.recompute_granularity == "full":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    x_bsd, _ = jax.lax.scan(body, x_bsd, (layer_state, first_layer + jnp.arange(n)))
    return x_bsd


def cross_entropy(logits_bsv: jax.Array, labels_bs: jax.Array) -> jax.Array:
    """Per-token loss [batch, seq] without gathering the vocab dim.

    The label logit is picked with a one-hot product rather than an indexed gather, so with
    the vocab split over tensor each device reduces its own slice and only [b, s] partial
    sums cross devices (Megatron's vocab-parallel cross-entropy).
    """
    logits = logits_bsv.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    onehot = jax.nn.one_hot(labels_bs, logits.shape[-1], dtype=logits.dtype)
    label_logit = jnp.sum(logits * onehot, axis=-1)
    return lse - label_logit
