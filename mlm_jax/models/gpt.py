"""A decoder-only transformer: the GPT-2/GPT-3 family and the Llama family, chosen by config.

Parameters are Flax NNX `Param`s whose `out_sharding` metadata holds *logical* dim names; the
activations at block boundaries are constrained by logical names too (`constrain`). Nothing
here knows about a mesh: `mlm_jax/sharding/rules.py` decides where each dim lives.

Layers are stacked on a leading `layers` dim and run with one `lax.scan`, so the compiled
program holds one layer body whatever the depth.

The stage API, which the plain step, the pipeline and decoding all call (nothing else
re-implements the forward):
  embed_tokens(tokens, positions, key)                          -> x [batch, seq, embed]
  run_layers(x, positions, segment_ids, key, first, count)      -> x
  head(x, labels, loss_mask)                                    -> (loss_sum, aux)
`aux` is a dict of per-step scalars (empty for this dense model; MoE's load-balancing losses
go there), summed over microbatches into the train step's metrics.

Shape letters: b batch, s sequence, d embed, v vocab, l layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.config import ModelConfig
from mlm_jax.models.attention import Attention
from mlm_jax.models.layers import Norm, compute_dtype, dropout, normal, param
from mlm_jax.models.mlp import MLP
from mlm_jax.models.recompute import scan_layers
from mlm_jax.sharding.rules import constrain

BLOCK_BOUNDARY = ("batch", "seq", "embed")
PADDED_LOGIT = -1e30


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


def stage_keys(key):
    """(embedding key, layers key) of one microbatch's dropout key; None when there is no dropout."""
    return (None, None) if key is None else tuple(jax.random.split(key))


class Block(nnx.Module):
    """One pre-norm transformer layer: x + attention(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.norm1 = Norm(cfg)
        self.attention = Attention(cfg, rngs)
        self.norm2 = Norm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_bsd, positions_bs, segment_ids_bs, key) -> jax.Array:
        cfg = self.cfg
        keys = jax.random.split(key, 3) if key is not None else (None, None, None)
        # With sequence parallelism the norms run on [batch, seq/tensor, embed]; their output is
        # gathered to the whole sequence here, before the column-parallel matmul (Megatron's SP).
        y = constrain(self.norm1(x_bsd), ("batch", None, "embed"))
        o = self.attention(y, positions_bs, segment_ids_bs, keys[0])
        x_bsd = constrain(x_bsd + dropout(o, cfg.hidden_dropout, keys[1]), BLOCK_BOUNDARY)
        y = constrain(self.norm2(x_bsd), ("batch", None, "embed"))
        o = self.mlp(y)
        return constrain(x_bsd + dropout(o, cfg.hidden_dropout, keys[2]), BLOCK_BOUNDARY)


class GPT(nnx.Module):
    """Embedding -> scanned stack of `Block`s -> final norm -> LM head (tied or untied)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, v, std = cfg.hidden_size, cfg.vocab, cfg.init_method_std
        self.embed = param(rngs, _vocab_rows(std, cfg.vocab_size), (v, d), ("vocab", "embed"))
        self.pos_embed = (
            param(rngs, normal(std), (cfg.max_position_embeddings, d), (None, "embed"))
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
            param(rngs, lambda k, shp, dt: _vocab_rows(std, cfg.vocab_size)(k, shp[::-1], dt).T,
                  (d, v), ("embed", "vocab"))
            if cfg.untie_embeddings_and_output_weights
            else None
        )

    @property
    def dtype(self):
        return compute_dtype(self.cfg)

    # ------------------------------------------------------------------ the stage API

    def embed_tokens(self, tokens_bs, positions_bs, key) -> jax.Array:
        """Token (+ learned position) embedding with dropout: [batch, seq, embed]."""
        dt = self.dtype
        # Look up in the fp32 table, then cast: the gradient scatter-adds into an fp32 table
        # (casting the table first would accumulate the embedding gradient in bf16).
        x = self.embed[...][tokens_bs].astype(dt)  # [b, s, d], vocab-parallel lookup
        if self.pos_embed is not None:
            x = x + self.pos_embed[...][positions_bs].astype(dt)
        x = dropout(x, self.cfg.hidden_dropout, key)
        return constrain(x, BLOCK_BOUNDARY)

    def run_layers(self, x_bsd, positions_bs, segment_ids_bs, key, first=0, count=None) -> jax.Array:
        """The stacked layers this model holds, in one scan.

        `first` (int or traced) is the global index of the first of them: per-layer dropout keys
        are folded from it, so a pipeline stage holding layers [first, first + n) draws the
        unpipelined model's masks. `count` (None: all) is how many rows are real layers; rows
        past it are padding (uneven pipeline splits) and pass the activation through (lax.cond:
        no compute spent on them).
        """
        graphdef, layer_state = nnx.split(self.layers)
        n = jax.tree.leaves(layer_state)[0].shape[0]

        def body(x, xs):
            state_l, index = xs

            def layer():
                layer_key = None if key is None else jax.random.fold_in(key, first + index)
                return nnx.merge(graphdef, state_l)(x, positions_bs, segment_ids_bs, layer_key)

            return (layer() if count is None else jax.lax.cond(index < count, layer, lambda: x)), None

        # --recompute-granularity / -method / -num-layers (mlm_jax/models/recompute.py)
        return scan_layers(body, x_bsd, (layer_state, jnp.arange(n)), n, self.cfg)

    def logits(self, x_bsd) -> jax.Array:
        """Final norm and LM head: fp32 logits [batch, seq, padded vocab], padding masked."""
        x = self.final_norm(x_bsd)
        head_dv = self.lm_head[...] if self.lm_head is not None else self.embed[...].T
        logits = head_matmul(x, head_dv.astype(self.dtype))
        logits = constrain(logits, ("batch", None, "vocab"))
        # Padding columns can never be the answer; masking them keeps the softmax (and so the
        # loss and every gradient) independent of how much padding the layout needs.
        real = jnp.arange(logits.shape[-1]) < self.cfg.vocab_size
        return jnp.where(real, logits, PADDED_LOGIT)

    def head(self, x_bsd, labels_bs, loss_mask_bs) -> tuple[jax.Array, dict]:
        """(sum of masked per-token losses, aux: a dict of per-step scalars, empty here)."""
        losses = cross_entropy(self.logits(x_bsd), labels_bs)
        return jnp.sum(losses * loss_mask_bs), {}

    # ------------------------------------------------------------------ whole-model calls

    def loss(self, batch: dict, key) -> tuple[jax.Array, dict]:
        """(loss sum, aux) of one microbatch: the stage API end to end (the unpipelined step).

        `batch` holds [b, s] tokens, labels, loss_mask, position_ids and, with
        --reset-attention-mask only, segment_ids. `key` None: no dropout.
        """
        k_embed, k_layers = stage_keys(key)
        x = self.embed_tokens(batch["tokens"], batch["position_ids"], k_embed)
        x = self.run_layers(x, batch["position_ids"], batch.get("segment_ids"), k_layers)
        return self.head(x, batch["labels"], batch["loss_mask"])

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
        k_embed, k_layers = stage_keys(dropout_key)
        x = self.embed_tokens(tokens_bs, positions_bs, k_embed)
        x = self.run_layers(x, positions_bs, segment_ids_bs, k_layers)
        return self.logits(x)


def head_matmul(x_bsd: jax.Array, w_dv: jax.Array) -> jax.Array:
    """x @ w -> fp32 logits [b, s, v]; under bf16 the backward matmuls run in bf16 too."""
    if x_bsd.dtype == jnp.float32:
        return jnp.einsum("bsd,dv->bsv", x_bsd, w_dv, preferred_element_type=jnp.float32)
    return _head_low(x_bsd, w_dv)


@jax.custom_vjp
def _head_low(x_bsd, w_dv):
    return jnp.einsum("bsd,dv->bsv", x_bsd, w_dv, preferred_element_type=jnp.float32)


def _head_low_fwd(x, w):
    return _head_low(x, w), (x, w)


def _head_low_bwd(res, ct_bsv):
    # The logits' cotangent is fp32 (the loss is); left alone both backward matmuls would run
    # fp32 x fp32 (TF32 on a GPU, half rate). Cast it to the compute dtype, accumulate in fp32.
    x, w = res
    ct = ct_bsv.astype(x.dtype)
    dx = jnp.einsum("bsv,dv->bsd", ct, w, preferred_element_type=jnp.float32)
    dw = jnp.einsum("bsd,bsv->dv", x, ct, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_head_low.defvjp(_head_low_fwd, _head_low_bwd)


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
