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
  run_layers_aux(...the same...)                                -> (x, MoE layer statistics)
  head(x, labels, loss_mask)                                    -> (loss_sum, aux)
Decoding uses the same embedding, layer bodies and head, with a KV cache threaded through the
layer scan (`forward_cached`, `run_layers_cached`, `init_cache`).
`aux` is a dict of per-step scalars, summed over microbatches into the train step's metrics.
Mixture-of-experts layers (mlm_jax/models/moe.py, per --moe-layer-freq) report statistics that
`moe.aux_terms` turns into the MoE losses' gradient (a zero-valued loss term) and the metrics
`moe_*` that join `aux` (in `loss` here and in the pipeline's stage forward).

Shape letters: b batch, s sequence, d embed, v vocab, l layers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax import platform
from mlm_jax.config import ConfigError, ModelConfig
from mlm_jax.models import fp8, recompute
from mlm_jax.models.attention import Attention
from mlm_jax.models.layers import SEQ_SPLIT, SEQ_WHOLE, Norm, compute_dtype, dropout, fp32_einsum, lookup, normal, param
from mlm_jax.models.mla import CACHE as LATENT_CACHE, MLAttention
from mlm_jax.models.mlp import MLP
from mlm_jax.models.mtp import loss_term as mtp_loss_term, roll_left
from mlm_jax.models.moe import MoE, aux_terms, zero_stats
from mlm_jax.models.recompute import scan_layers
from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import varying, zeros_like_typed
from mlm_jax.sharding.rules import constrain

BLOCK_BOUNDARY = SEQ_SPLIT
KV_CACHE = ("layers", "batch", None, "kv_heads", "head_dim")  # [l, b, max_len, g, k]
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
    """One pre-norm transformer layer: x + attention(norm1(x)), then x + mlp(norm2(x)); the MLP
    is a mixture of experts (mlm_jax/models/moe.py) when `moe`. Returns (x, MoE statistics:
    {} for a dense block)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool = False):
        self.cfg = cfg
        self.norm1 = Norm(cfg)
        self.attention = MLAttention(cfg, rngs) if cfg.multi_latent_attention else Attention(cfg, rngs)
        self.norm2 = Norm(cfg)
        self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, rngs)
        self.moe = moe

    def __call__(self, x_bsd, positions_bs, segment_ids_bs, key) -> tuple[jax.Array, dict]:
        cfg = self.cfg
        keys = jax.random.split(key, 3) if key is not None else (None, None, None)
        # With sequence parallelism the norms run on [batch, seq/tensor, embed]; the column-parallel
        # projections gather their output to the whole sequence (`layers.column_parallel`,
        # Megatron's SP); the MoE's router and dispatch take it gathered here.
        # --recompute-modules (models/recompute.py): `layernorm` recomputes each norm with the
        # block it feeds; `moe`, `mlp` the whole MoE or MLP. With `mla_up_proj` too, the first
        # norm's region ends at multi-latent attention's latents (it would keep the up
        # projections' outputs, which mla_up_proj recomputes).
        if cfg.multi_latent_attention and recompute.named(cfg, "mla_up_proj"):
            latents = recompute.module(cfg, "layernorm", lambda x: self.attention.latents(self.norm1(x), positions_bs),
                                       x_bsd)
            o = self.attention.from_latents(latents, positions_bs, segment_ids_bs, keys[0])
        else:
            o = recompute.module(cfg, "layernorm", lambda x: self.attention(self.norm1(x), positions_bs,
                                                                            segment_ids_bs, keys[0]), x_bsd)
        x_bsd = constrain(x_bsd + dropout(o, cfg.hidden_dropout, keys[1]), BLOCK_BOUNDARY)

        def mlp(x):
            y = self.norm2(x)
            if self.moe:
                return recompute.module(cfg, "moe", lambda y: self.mlp(y), constrain(y, SEQ_WHOLE))
            return recompute.module(cfg, "mlp", lambda y: self.mlp(y), y), {}

        o, stats = recompute.module(cfg, "layernorm", mlp, x_bsd, block="moe" if self.moe else "mlp")
        return constrain(x_bsd + dropout(o, cfg.hidden_dropout, keys[2]), BLOCK_BOUNDARY), stats

    def cached(self, x_bsd, positions_bs, cache: dict):
        """The layer on new tokens against its cache (no dropout): (x, the cache updated)."""
        y = constrain(self.norm1(x_bsd), ("batch", None, "embed"))
        if self.cfg.multi_latent_attention:
            o, cache = self.attention.cached(y, positions_bs, cache)
        else:
            o, k, v = self.attention.cached(y, positions_bs, cache["k"], cache["v"])
            cache = {"k": k, "v": v}
        x_bsd = constrain(x_bsd + o, BLOCK_BOUNDARY)
        y = constrain(self.norm2(x_bsd), ("batch", None, "embed"))
        o = self.mlp(y)[0] if self.moe else self.mlp(y)
        return constrain(x_bsd + o, BLOCK_BOUNDARY), cache


class MTPLayer(nnx.Module):
    """One multi-token prediction depth (mlm_jax/models/mtp.py): eh_proj of the normed embedding of
    the rolled tokens and the normed previous hidden state, a layer of the model's last layer's kind,
    a final norm. Returns (h, the layer's MoE statistics)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.enorm, self.hnorm = Norm(cfg), Norm(cfg)
        self.eh_proj = param(rngs, normal(cfg.init_method_std), (2, d, d), (None, "embed", None))  # [embedding; h]
        self.layer = Block(cfg, rngs, cfg.is_moe_layer(cfg.num_layers - 1))
        self.final_norm = Norm(cfg)

    def __call__(self, h_bsd, emb_bsd, positions_bs, segment_ids_bs, key) -> tuple[jax.Array, dict]:
        w = self.eh_proj[...].astype(h_bsd.dtype)
        x = (jnp.einsum("bsd,de->bse", self.enorm(emb_bsd), w[0])
             + jnp.einsum("bsd,de->bse", self.hnorm(h_bsd), w[1]))
        x, stats = self.layer(constrain(x, BLOCK_BOUNDARY), positions_bs, segment_ids_bs, key)
        return self.final_norm(x), stats


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

        # One stack per block kind (--moe-layer-freq): `layers` holds the first layer's kind,
        # `moe_layers` the MoE blocks when the pattern mixes kinds; each compiles one body.
        kinds = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
        self.layer_kinds = tuple(kinds)
        self.mixed = len(set(kinds)) > 1
        if self.mixed:
            self.layers = _stack(cfg, rngs, kinds.count(False), False)
            self.moe_layers = _stack(cfg, rngs, kinds.count(True), True)
        else:
            self.layers = _stack(cfg, rngs, cfg.num_layers, kinds[0])
            self.moe_layers = None
        self.final_norm = Norm(cfg)
        self.mtp = _stack(cfg, rngs, cfg.mtp_num_layers, None) if cfg.mtp_num_layers else None
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
        x = lookup(self.embed[...], tokens_bs, ("vocab", "embed")).astype(dt)  # [b, s, d], vocab-parallel
        if self.pos_embed is not None:
            x = x + lookup(self.pos_embed[...], positions_bs, (None, "embed")).astype(dt)
        x = dropout(x, self.cfg.hidden_dropout, key)
        return constrain(x, BLOCK_BOUNDARY)

    def run_layers(self, x_bsd, positions_bs, segment_ids_bs, key, first=0, count=None) -> jax.Array:
        """The stacked layers this model holds, in one scan (see `run_layers_aux`)."""
        return self.run_layers_aux(x_bsd, positions_bs, segment_ids_bs, key, first, count)[0]

    def run_layers_aux(self, x_bsd, positions_bs, segment_ids_bs, key, first=0, count=None):
        """(x, MoE statistics summed over the layers: {} for a dense model).

        `first` (int or traced) is the global index of the first of them: per-layer dropout keys
        are folded from it, so a pipeline stage holding layers [first, first + n) draws the
        unpipelined model's masks. `count` (None: all) is how many rows are real layers; rows
        past it are padding (uneven pipeline splits) and pass the activation through: they run
        and their output is dropped (a select, no conditional per layer; in the pipeline's
        lockstep ticks a stage with fewer layers would only wait for the one with the most).
        """
        if self.mixed:
            return self._run_mixed(x_bsd, positions_bs, segment_ids_bs, key)
        graphdef, layer_state = nnx.split(self.layers)
        n = jax.tree.leaves(layer_state)[0].shape[0]

        stats0 = zero_stats() if self.layer_kinds[0] else {}
        # --overlap-grad-reduce: each layer's weights pass through the installed hook, which
        # reduces their gradient over the data-parallel ranks as the backward leaves the layer.
        hook = trace.current().layer_grad_hook
        hook_xs = () if hook is None else (hook.layer_inputs(layer_state),)

        def body(x, xs):
            state_l, index, *hook_l = xs
            if hook_l:
                state_l = hook.at_layer(state_l, hook_l[0])

            def layer():
                layer_key = None if key is None else jax.random.fold_in(key, first + index)
                return nnx.merge(graphdef, state_l)(x, positions_bs, segment_ids_bs, layer_key)

            y, stats = fp8.per_layer(self.cfg, first + index, layer)
            if count is not None:  # a padding row: the input through, no statistics
                y, stats = jax.tree.map(lambda out, skip: jnp.where(index < count, out, skip), (y, stats), (x, stats0))
            return y, stats  # per-layer statistics as scan outputs: any manual-axis type

        # --recompute-granularity / -method / -num-layers (mlm_jax/models/recompute.py)
        return scan_layers(body, x_bsd, (layer_state, jnp.arange(n), *hook_xs), n, self.cfg, hook)

    def _run_mixed(self, x_bsd, positions_bs, segment_ids_bs, key):
        """Dense and MoE layers in the pattern's order: each run of consecutive layers of one kind
        is one scan over its rows of that kind's stack (DeepSeek-V3's [0]*3+[1]*58: two scans),
        with the recompute policy of the uniform stacks (`scan_layers`).

        One scan over every layer, picking the kind by a conditional, took each stack whole into
        every iteration: the backward then built a stack-sized gradient per layer (DeepSeek-V3
        on 256 H100s, deviceless: 2,939 GiB of temporaries per device)."""
        hook = trace.current().layer_grad_hook
        if hook is not None and not hook.per_stack:
            raise ConfigError("a per-layer gradient hook needs one stack of layers (not mixed dense/MoE)")
        rows = _rows_within_kind(self.layer_kinds)
        stats, done = zero_stats(), 0
        for moe, first, last in _runs(self.layer_kinds):
            name = "moe_layers" if moe else "layers"
            graphdef, state = nnx.split(getattr(self, name))
            state = jax.tree.map(lambda a, r=rows[first], n=last - first: a[r:r + n], state)

            def body(x, xs, graphdef=graphdef, name=name):
                state_l, index = xs
                if hook is not None:  # FSDP's gather of this layer's weights
                    state_l = hook.at_layer(state_l, (), name)

                def layer():
                    layer_key = None if key is None else jax.random.fold_in(key, index)
                    return nnx.merge(graphdef, state_l)(x, positions_bs, segment_ids_bs, layer_key)

                return fp8.per_layer(self.cfg, index, layer)

            n = last - first
            x_bsd, run_stats = scan_layers(body, x_bsd, (state, jnp.arange(first, last)), n,
                                           _recompute_from(self.cfg, done), hook)
            if run_stats:
                stats = jax.tree.map(jnp.add, stats, run_stats)
            done += n
        return x_bsd, stats

    def run_layers_cached(self, x_bsd, positions_bs, cache: dict) -> tuple[jax.Array, dict]:
        """All layers on new tokens against the KV cache, in one scan (decoding; no dropout).

        `cache` holds "k" and "v", each [layers, batch, max_len, kv_heads, head_dim] (`KV_CACHE`
        names its dims), or under multi-latent attention "latent" and "rope" [layers, batch,
        max_len, rank] (`LATENT_CACHE`); returns (x, the updated cache).
        """
        if self.mixed:
            raise ConfigError("decoding a model that mixes dense and MoE layers (--moe-layer-freq) is "
                              "not supported yet; a model of one layer kind decodes")
        graphdef, layer_state = nnx.split(self.layers)

        def body(x, xs):
            state_l, cache_l = xs
            return nnx.merge(graphdef, state_l).cached(x, positions_bs, cache_l)

        x_bsd, cache = jax.lax.scan(body, x_bsd, (layer_state, cache))
        return x_bsd, {n: constrain(c, self._cache_names) for n, c in cache.items()}

    @property
    def _cache_names(self):
        return LATENT_CACHE if self.cfg.multi_latent_attention else KV_CACHE

    def init_cache(self, batch: int, max_len: int) -> dict:
        """An empty cache for `batch` rows of up to `max_len` positions, in the compute dtype: keys
        and values, or multi-latent attention's latents."""
        cfg = self.cfg
        if cfg.multi_latent_attention:
            shapes = MLAttention.cache_shapes(cfg, batch, max_len)
        else:
            shapes = dict.fromkeys(("k", "v"), (batch, max_len, cfg.query_groups, cfg.head_dim))
        return {n: constrain(jnp.zeros((cfg.num_layers, *shape), self.dtype), self._cache_names)
                for n, shape in shapes.items()}

    def forward_cached(self, tokens_bs, positions_bs, cache: dict) -> tuple[jax.Array, dict]:
        """(fp32 logits [b, s, padded vocab], cache) of new tokens at `positions` (see
        `Attention.cached`: s > 1 is a prefill from position 0, s == 1 one decode step)."""
        x = self.embed_tokens(tokens_bs, positions_bs, None)
        x, cache = self.run_layers_cached(x, positions_bs, cache)
        return self.logits(x), cache

    def head_weight(self, vocab_split: VocabSplit | None = None) -> jax.Array:
        """The LM head [padded vocab, embed] in the compute dtype: the embedding when tied.
        With `vocab_split` (a manual mesh axis of size n), this device's rows only
        (`vocab_columns`): strided, every n-th from its axis index on, zero rows padding to a
        multiple of n; blocked, the untied head as given (the caller passed this device's
        block of it)."""
        w_vd = self.lm_head[...].T if self.lm_head is not None else self.embed[...]
        if vocab_split is not None and vocab_split.blocked:
            if self.lm_head is None:
                raise ValueError("a blocked vocab split needs an untied LM head (the embedding is whole)")
        elif vocab_split is not None:
            n = jax.lax.axis_size(vocab_split.axis)
            if w_vd.shape[0] % n:
                w_vd = jnp.pad(w_vd, ((0, -w_vd.shape[0] % n), (0, 0)))
            # Strided, so that the [v / n] rows keep the vocab's split over tensor.
            w_vd = jax.lax.dynamic_index_in_dim(w_vd.reshape(-1, n, w_vd.shape[1]),
                                                jax.lax.axis_index(vocab_split.axis), axis=1, keepdims=False)
        return w_vd.astype(self.dtype)

    def logits(self, x_bsd) -> jax.Array:
        """Final norm and LM head: fp32 logits [batch, seq, padded vocab], padding masked."""
        return _masked_logits(head_matmul(self.final_norm(x_bsd), self.head_weight()),
                              self.cfg.vocab_size)

    def head(self, x_bsd, labels_bs, loss_mask_bs, vocab_split: VocabSplit | None = None) -> tuple[jax.Array, dict]:
        """(sum of masked per-token losses, aux: a dict of per-step scalars, empty here).
        `vocab_split`: the vocab split over a manual mesh axis (the pipeline's head):
        each device computes the logits of its 1/n of it, and the loss combines them with
        collectives of [batch, seq] over the axis; `x_bsd` must be the same on every device."""
        x = self.final_norm(x_bsd)
        return linear_cross_entropy(x, self.head_weight(vocab_split), labels_bs, loss_mask_bs,
                                    self.cfg.vocab_size, vocab_split), {}

    # ------------------------------------------------------------------ whole-model calls

    def loss(self, batch: dict, key) -> tuple[jax.Array, dict]:
        """(loss sum, aux) of one microbatch: the stage API end to end (the unpipelined step).

        `batch` holds [b, s] tokens, labels, loss_mask, position_ids and, with
        --reset-attention-mask only, segment_ids. `key` None: no dropout.
        """
        k_embed, k_layers = stage_keys(key)
        x = self.embed_tokens(batch["tokens"], batch["position_ids"], k_embed)
        x, stats = self.run_layers_aux(x, batch["position_ids"], batch.get("segment_ids"), k_layers)
        loss_sum, aux, mtp_stats = self.head_and_mtp(x, batch, key)
        if mtp_stats:
            stats = jax.tree.map(jnp.add, stats, mtp_stats) if stats else mtp_stats
        moe_term, moe_metrics = aux_terms(stats, batch["loss_mask"])  # MoE losses' gradient
        return loss_sum + moe_term, {**aux, **moe_metrics}

    def head_and_mtp(self, x_bsd, batch: dict, key, vocab_split: VocabSplit | None = None) -> tuple[jax.Array, dict, dict]:
        """(the head's loss sum plus the MTP depths' term, aux with the depths' metrics, the MTP
        layers' MoE statistics) on the last layer's output `x_bsd`: `head` without
        --mtp-num-layers. `key` is the microbatch's dropout key (None: no dropout); `vocab_split`
        as `head`'s (the pipeline's), for the depths' logits too."""
        loss_sum, aux = self.head(x_bsd, batch["labels"], batch["loss_mask"], vocab_split)
        if self.mtp is None:
            return loss_sum, aux, {}
        term, metrics, stats = self._multi_token_prediction(
            x_bsd, batch, None if key is None else jax.random.fold_in(key, 1), vocab_split)
        return loss_sum + term, {**aux, **metrics}, stats

    def _multi_token_prediction(self, x_bsd, batch: dict, key,
                                vocab_split: VocabSplit | None = None) -> tuple[jax.Array, dict, dict]:
        """(loss term, metrics, MoE statistics) of the MTP depths (mlm_jax/models/mtp.py) on the
        model's last hidden state `x_bsd` (before the final norm)."""
        order = trace.current().seq_order
        order = None if order is None else order(x_bsd.shape[1])  # context parallelism's chunk order

        def roll(x_bs, k):
            return roll_left(x_bs, k, order)

        sums, counts, stats = [], [], {}
        for k, h, layer_stats in self._mtp_depths(x_bsd, batch["tokens"], batch["position_ids"],
                                                  batch.get("segment_ids"), key, roll):
            stats = jax.tree.map(jnp.add, stats, layer_stats) if stats else layer_stats
            mask = roll(batch["loss_mask"], k)
            sums.append(linear_cross_entropy(h, self.head_weight(vocab_split), roll(batch["labels"], k), mask,
                                             self.cfg.vocab_size, vocab_split))
            counts.append(jnp.sum(mask))
        term, metrics = mtp_loss_term(sums, counts, batch["loss_mask"], self.cfg.mtp_loss_scaling_factor)
        return term, metrics, stats

    def _mtp_depths(self, x_bsd, tokens_bs, positions_bs, segment_ids_bs, key, roll):
        """(k, depth k's output h (final-normed), its MoE statistics) for k = 1..D, on the model's
        last hidden state `x_bsd` (before the final norm); `roll(x_bs, k)` shifts k places left."""
        graphdef, state = nnx.split(self.mtp)
        h = self.final_norm(x_bsd)
        for k in range(1, self.cfg.mtp_num_layers + 1):
            k_embed, k_layer = stage_keys(None if key is None else jax.random.fold_in(key, k))
            emb = self.embed_tokens(roll(tokens_bs, k), roll(positions_bs, k), k_embed)
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[k - 1], state))
            h, layer_stats = layer(h, emb, positions_bs, segment_ids_bs, k_layer)
            yield k, h, layer_stats

    def mtp_logits(self, tokens_bs: jax.Array, positions_bs: jax.Array | None = None) -> list[jax.Array]:
        """Each multi-token prediction depth's logits [batch, seq, padded vocab] (fp32, padding
        masked, no dropout): depth k's at position i score token i + k + 1. [] without MTP."""
        if self.mtp is None:
            return []
        b, s = tokens_bs.shape
        if positions_bs is None:
            positions_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x = self.run_layers(self.embed_tokens(tokens_bs, positions_bs, None), positions_bs, None, None)
        return [_masked_logits(head_matmul(h, self.head_weight()), self.cfg.vocab_size)
                for _, h, _ in self._mtp_depths(x, tokens_bs, positions_bs, None, None, roll_left)]

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


def _stack(cfg: ModelConfig, rngs: nnx.Rngs, n: int, moe: bool | None):
    """`n` blocks of one kind stacked on a leading `layers` dim (`moe` None: MTP depths)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(rngs: nnx.Rngs) -> Block | MTPLayer:
        return MTPLayer(cfg, rngs) if moe is None else Block(cfg, rngs, moe)

    return make_layers(rngs)


def _runs(kinds) -> list[tuple[bool, int, int]]:
    """(kind, first, last + 1) of each run of consecutive layers of one kind: [0, 1, 1, 0] ->
    [(False, 0, 1), (True, 1, 3), (False, 3, 4)]."""
    runs = []
    for i, k in enumerate(kinds):
        if runs and runs[-1][0] == k:
            runs[-1] = (k, runs[-1][1], i + 1)
        else:
            runs.append((k, i, i + 1))
    return runs


def _recompute_from(cfg: ModelConfig, done: int) -> ModelConfig:
    """`cfg` for a run of layers after `done` others: --recompute-method block counts its
    --recompute-num-layers from the model's first layer, not each run's."""
    if cfg.recompute_granularity != "full" or cfg.recompute_method != "block":
        return cfg
    left = (cfg.recompute_num_layers or 1) - done
    if left > 0:
        return dataclasses.replace(cfg, recompute_num_layers=left)
    return dataclasses.replace(cfg, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)


def _rows_within_kind(kinds) -> list[int]:
    """Each layer's row in its kind's stack: [0, 1, 1, 1] -> [0, 0, 1, 2]."""
    seen = {False: 0, True: 0}
    rows = []
    for k in kinds:
        rows.append(seen[k])
        seen[k] += 1
    return rows


def head_matmul(x_bsd: jax.Array, w_vd: jax.Array) -> jax.Array:
    """x @ w.T -> fp32 logits [b, s, v]; under bf16 the backward matmuls run in bf16 too."""
    if x_bsd.dtype == jnp.float32:
        return jnp.einsum("bsd,vd->bsv", x_bsd, w_vd, preferred_element_type=jnp.float32)
    return _head_low(x_bsd, w_vd)


# [b, s, d] x [v, d] -> fp32 logits, the backward in the compute dtype (the loss's cotangent is fp32).
_head_low = fp32_einsum("bsd,vd->bsv", "bsv,vd->bsd", "bsv,bsd->vd")


class VocabSplit(NamedTuple):
    """The LM head's vocab split over the manual mesh axis `axis` (size n, the pipeline's head):
    each device computes the logits of its 1/n of the vocab. Strided: the every n-th rows from
    its axis index on, taken from a head the device holds whole (this keeps the vocab's split
    over tensor in each share). Blocked: the device's contiguous block, an untied head passed
    in already split over `axis` (no copy of the whole head, and its gradient stays a block)."""

    axis: str
    blocked: bool = False


def vocab_columns(num_columns: int, split: VocabSplit | None = None) -> jax.Array:
    """The vocab id of each logit column: all of them in order, or, with the vocab split over a
    manual axis, this device's share (`VocabSplit`)."""
    if split is None:
        return jnp.arange(num_columns)
    index = jax.lax.axis_index(split.axis)
    if split.blocked:
        return index * num_columns + jnp.arange(num_columns)
    return jnp.arange(num_columns) * jax.lax.axis_size(split.axis) + index


def _over(split: VocabSplit | None, reduce, x: jax.Array) -> jax.Array:
    """`reduce` (psum, pmax) of a per-device partial over the vocab's split axis, if any."""
    return x if split is None else reduce(x, split.axis)


def _masked_logits(logits_bsv: jax.Array, vocab_size: int, split: VocabSplit | None = None) -> jax.Array:
    """Padding columns can never be the answer; masking them keeps the softmax (and so the
    loss and every gradient) independent of how much padding the layout needs."""
    logits = constrain(logits_bsv, ("batch", "context_seq", "vocab"))
    if split is None and logits.shape[-1] == vocab_size:
        return logits  # no padding: no select over every logit (forward and backward)
    real = vocab_columns(logits.shape[-1], split) < vocab_size
    return jnp.where(real, logits, PADDED_LOGIT)


def _onehot(labels_bs: jax.Array, num_columns: int, split: VocabSplit | None) -> jax.Array:
    """[b, s, columns] fp32: 1 at the label's column (none on devices not holding it)."""
    if split is None:
        return jax.nn.one_hot(labels_bs, num_columns, dtype=jnp.float32)
    return (labels_bs[..., None] == vocab_columns(num_columns, split)).astype(jnp.float32)


def linear_cross_entropy(x_bsd, w_vd, labels_bs, weights_bs, vocab_size: int,
                         split: VocabSplit | None = None) -> jax.Array:
    """sum(weights * cross_entropy(x @ w.T)): the LM head and its loss as one differentiable
    op, whose gradient is computed in the forward pass (a fused linear cross-entropy).

    Autodiff of head + loss keeps the fp32 logits [b, s, v] alive until the backward, then
    walks them again (softmax, one-hot, the padding select) and materialises the logit
    gradient's transpose for the weight's gradient. Here the forward computes the logits once,
    their softmax, and at once the gradients of x and w for a unit cotangent; the backward only
    scales them by the loss's (scalar) cotangent. Without differentiation (evaluation) the plain
    forward runs. On a CPU the rows go through in cache-sized chunks (`_row_chunks`). The same
    quantities as autodiff's, rounding aside; matmuls in the compute dtype with fp32
    accumulation (as `fp32_einsum`); vocab-parallel as `cross_entropy`.

    `split`: `w_vd` holds this device's rows of a vocab split over that manual axis
    (`GPT.head_weight`); the softmax's max, sum and label logit are reduced over it, and the
    gradient of x is this device's share (the caller's autodiff sums the shares).
    """
    if split is not None:  # this device's share of x's gradient (summed by autodiff)
        x_bsd = varying(x_bsd, split.axis)
    return _linear_ce(x_bsd, w_vd, labels_bs, weights_bs, (vocab_size, x_bsd.dtype, w_vd.dtype, split))


# static: (vocab_size, dtype of x, dtype of w (the gradients' dtypes), vocab split axis or None)
def _ce_plain(x_bsd, w_vd, labels_bs, weights_bs, static):
    vocab_size, split = static[0], static[3]
    logits = jnp.einsum("bsd,vd->bsv", x_bsd, w_vd, preferred_element_type=jnp.float32)
    return jnp.sum(cross_entropy(_masked_logits(logits, vocab_size, split), labels_bs, split) * weights_bs)


def _ce_forward(x_bsd, w_vd, labels_bs, weights_bs, static):
    b, s, d = x_bsd.shape
    chunks = _row_chunks(b, s, w_vd.shape[0])
    if chunks == 1:
        loss, g_x, g_w, losses = _ce_chunk(x_bsd, w_vd, labels_bs, weights_bs, static)
        return loss, (g_x, _vd(g_w), losses)

    # Chunk c holds the rows c, c + chunks, ...: the chunk index is the minor part of the
    # sequence, so each chunk keeps the sequence's sharding (context parallel) whole.
    def split(a):  # [b, s, ...] -> [chunks, b, s / chunks, ...]
        return jnp.moveaxis(a.reshape(b, s // chunks, chunks, *a.shape[2:]), 2, 0)

    def unsplit(a):
        return jnp.moveaxis(a, 0, 2).reshape(b, s, *a.shape[3:])

    def body(carry, xs):
        loss, g_w = carry
        x_c, labels_c, weights_c = xs
        loss_c, g_x_c, g_w_c, losses_c = _ce_chunk(x_c, w_vd, labels_c, weights_c, static)
        return (loss + loss_c, g_w + g_w_c), (g_x_c, losses_c)

    xs = (split(x_bsd), split(labels_bs), split(weights_bs))
    # The sums start at zeros varying over the manual axes a chunk's sums vary over (inside a
    # per-rank or pipeline shard_map; a scan's carry keeps its type).
    chunk = jax.eval_shape(lambda x, lb, wt: _ce_chunk(x[0], w_vd, lb[0], wt[0], static), *xs)
    zeros = (zeros_like_typed(chunk[0]), zeros_like_typed(chunk[2]))
    (loss, g_w), (g_x, losses) = jax.lax.scan(body, zeros, xs)
    return loss, (unsplit(g_x), _vd(g_w), unsplit(losses))


def _ce_chunk(x_bsd, w_vd, labels_bs, weights_bs, static):
    """(loss sum, d/dx, d/dw, per-token losses) of rows x for a unit cotangent; d/dw
    transposed ([d, v]) on a CPU (`_WEIGHT_GRADIENT_DV`; `_vd` turns it back)."""
    vocab_size, split = static[0], static[3]
    logits = jnp.einsum("bsd,vd->bsv", x_bsd, w_vd, preferred_element_type=jnp.float32)
    logits = _masked_logits(logits, vocab_size, split)
    top = _over(split, jax.lax.pmax, jnp.max(logits, axis=-1, keepdims=True))
    exp = jnp.exp(logits - top)
    total = _over(split, jax.lax.psum, jnp.sum(exp, axis=-1, keepdims=True))
    onehot = _onehot(labels_bs, logits.shape[-1], split)
    label_logit = _over(split, jax.lax.psum, jnp.sum(logits * onehot, axis=-1))
    losses = (jnp.log(total) + top)[..., 0] - label_logit  # [b, s]
    # d loss / d logits for a unit cotangent; padding columns get exp(-1e30 - top) = 0 exactly.
    g_bsv = ((exp / total - onehot) * weights_bs[..., None]).astype(x_bsd.dtype)
    g_x = jnp.einsum("bsv,vd->bsd", g_bsv, w_vd, preferred_element_type=jnp.float32)
    b, s, d = x_bsd.shape  # one contracting dim: XLA:CPU's dot is slower with two
    rows_x, rows_g = x_bsd.reshape(b * s, d), g_bsv.reshape(b * s, -1)
    if _weight_gradient_dv():  # x transposed first, kept so (see layers._TRANSPOSED_INPUT)
        g_w = jnp.einsum("dn,nv->dv", jax.lax.optimization_barrier(rows_x.T), rows_g,
                         preferred_element_type=jnp.float32)
    else:
        g_w = jnp.einsum("nv,nd->vd", rows_g, rows_x, preferred_element_type=jnp.float32)
    return jnp.sum(losses * weights_bs), g_x, g_w, losses


# The head weight's gradient x^T g on a CPU as [d, v] (wide rows) from x transposed first,
# summed over the chunks and transposed once: XLA:CPU's row-contracting product as [v, d] ran at
# ~130 GFLOP/s, as [d, v] at ~155, as a plain product of the transposed x at ~195 (workload W,
# one [512, 256] x [512, 8192] chunk: 16.5 -> 13.8 -> 11.0 ms).
_WEIGHT_GRADIENT_DV = (platform.CPU,)


def _weight_gradient_dv() -> bool:
    return platform.current() in _WEIGHT_GRADIENT_DV


def _vd(g_w):
    """The head weight's summed gradient as [v, d]."""
    return g_w.T if _weight_gradient_dv() else g_w


# Rows per chunk of the fused loss: a chunk's fp32 logits at most this many elements. On a CPU
# chunks that fit the caches run the head's products up to 2x faster (workload W, 8 chunks of
# [256, 8192]: the input-gradient product 52 -> 25 ms, the logits 31 -> 20 ms per step); on an
# accelerator only memory asks for chunks, so they are large.
_CHUNK_LOGITS = {"cpu": 1 << 21}
_CHUNK_LOGITS_ELSEWHERE = 1 << 27
_MIN_CHUNK_ROWS = 64  # of the sequence, per chunk


def _row_chunks(b: int, s: int, v: int) -> int:
    """How many chunks the fused loss splits the sequence into: a power of two dividing s
    that leaves at least _MIN_CHUNK_ROWS of it per chunk, the fewest with chunks within the budget."""
    # The traced step's platform (the mesh's devices), not the process's: a deviceless GPU
    # compile (mlm_jax.plan) runs in a CPU process and must chunk as the GPU run does.
    budget = _CHUNK_LOGITS.get(platform.current(), _CHUNK_LOGITS_ELSEWHERE)
    chunks = 1
    while b * s * v // chunks > budget and s % (2 * chunks) == 0 and s // (2 * chunks) >= _MIN_CHUNK_ROWS:
        chunks *= 2
    return chunks


def _ce_backward(static, residuals, ct):
    _, x_dtype, w_dtype, _ = static
    g_x, g_w, losses = residuals
    return (ct * g_x).astype(x_dtype), (ct * g_w).astype(w_dtype), None, ct * losses


_linear_ce = jax.custom_vjp(_ce_plain, nondiff_argnums=(4,))
_linear_ce.defvjp(_ce_forward, _ce_backward)


def cross_entropy(logits_bsv: jax.Array, labels_bs: jax.Array, split: VocabSplit | None = None) -> jax.Array:
    """Per-token loss [batch, seq] without gathering the vocab dim.

    The label logit is picked with a one-hot product rather than an indexed gather, so with
    the vocab split over tensor each device reduces its own slice and only [b, s] partial
    sums cross devices (Megatron's vocab-parallel cross-entropy). With `split` the columns are
    this device's share of a vocab split over that manual axis (`vocab_columns`).
    """
    logits = logits_bsv.astype(jnp.float32)
    if split is None:
        lse = jax.nn.logsumexp(logits, axis=-1)
    else:
        top = jax.lax.stop_gradient(_over(split, jax.lax.pmax, jnp.max(logits, axis=-1)))
        lse = jnp.log(_over(split, jax.lax.psum, jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))) + top
    onehot = _onehot(labels_bs, logits.shape[-1], split)
    label_logit = _over(split, jax.lax.psum, jnp.sum(logits * onehot, axis=-1))
    return lse - label_logit

