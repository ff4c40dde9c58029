"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's `MLASelfAttention`).

Each token's keys and values come from one small latent: the hidden state is projected down to
`kv_lora_rank` channels (plus `qk_pos_emb_head_dim` channels of a key part that carries the
position), the latent is normed (--qk-layernorm) and projected up to every head's key part
without position (`qk_head_dim`) and value (`v_head_dim`). Queries likewise, through a
`q_lora_rank` latent when one is given, else directly. Rope turns only the position parts: the
query's last `qk_pos_emb_head_dim` channels per head and the key's shared one, in MLA's
interleaved channel order; a head's query and key are [no-position part; rope part].

Tensor parallelism splits the heads, as Megatron does: the up projections are column parallel
and the output projection row parallel. The down projections are whole on every rank; under
sequence parallelism they run on each rank's tokens of the split sequence and the latents
(576 channels in DeepSeek-V3, against a 7168-wide hidden state) are what is gathered.

Rope is YaRN (Megatron's default for MLA, `rope_type` None or "yarn"): frequencies blended
between the original and the slowed by --rotary-scaling-factor over the channels whose
wavelength falls between the original context's beta_fast and beta_slow rotations, cos and sin
times the concentration factor mscale(factor, --mscale) / mscale(factor, --mscale-all-dim),
and the scores' scale 1/sqrt(query head dim) times mscale(factor, --mscale-all-dim)^2. With
--rope-type rope (or a factor of 1) it is plain rope.

cuDNN's fused attention (bf16 on NVIDIA GPUs) runs with the values padded by zeros to the
query/key width (192 in DeepSeek-V3; Hopper's kernels take up to 256), as Megatron-Core pads them
for Transformer Engine, the output cut back; elsewhere XLA's attention takes the widths as they are.

Decoding caches the normed latent and the turned key rope part per position, as DeepSeek's
inference does (576 values per token and layer where the keys and values take heads x 320),
and projects the cache up at each step.

Shape letters: b batch, s query seq, t key seq, d embed, h heads, k query/key head dim,
v value head dim, r a latent's rank, e the rope part.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.config import ModelConfig
from mlm_jax.models import fp8, recompute
from mlm_jax.models.attention import CUDNN, attention, choose_backend
from mlm_jax.models.layers import (SEQ_SPLIT, Norm, add_bias, cast, column_parallel, normal, param, rotate, row_parallel,
                                   value, zeros)
from mlm_jax.sharding import trace
from mlm_jax.sharding.rules import constrain

HEADS = ("batch", "context_seq", "heads", "head_dim")
LATENT = ("batch", "context_seq", None)  # a latent (or the key's rope part) over the whole sequence
W_DOWN, W_UP, WO = ("embed", None), (None, "heads", "head_dim"), ("heads", "head_dim", "embed")
CACHE = ("layers", "batch", None, None)  # [l, b, max_len, r or e]


def _mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction for a context `factor` times longer (1 below factor 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(cfg: ModelConfig) -> bool:
    return cfg.rope_type != "rope"


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [e/2], the cos/sin magnitude) of the rope part, as Megatron-Core's
    `YarnRotaryEmbedding` (rope_type yarn) or `RotaryEmbedding` (rope) and transformers'
    DeepSeek-V3 (`_compute_yarn_parameters`)."""
    dim, base = cfg.qk_pos_emb_head_dim, cfg.rotary_base
    extra = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not _yarn(cfg):
        return extra.astype(np.float32), 1.0
    factor, original = cfg.rotary_scaling_factor, cfg.yarn_original_max_position_embeddings

    def channel(rotations):  # the channel whose wavelength fits `rotations` times in the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(channel(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(channel(cfg.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    kept = 1.0 - ramp  # 1: the original frequency (short wavelengths), 0: slowed by the factor
    inv_freq = extra / factor * (1 - kept) + extra * kept
    return inv_freq.astype(np.float32), _mscale(factor, cfg.mscale) / _mscale(factor, cfg.mscale_all_dim)


def softmax_scale(cfg: ModelConfig) -> float:
    """The scores' scale: 1/sqrt(query head dim) x mscale(factor, --mscale-all-dim)^2 (Megatron's,
    whatever the rope type)."""
    m = _mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim)
    return m * m / math.sqrt(cfg.head_dim)


def _turn(x_bshe, positions_bs, cfg: ModelConfig):
    """Rope on the position part, MLA's channel order: even channels then odd ones, rotated as
    halves (Megatron's `mla_rotary_interleaved`, transformers' `apply_rotary_pos_emb_interleave`)."""
    inv_freq, magnitude = rope_frequencies(cfg)
    x = jnp.concatenate([x_bshe[..., 0::2], x_bshe[..., 1::2]], axis=-1)
    return rotate(x, positions_bs, jnp.asarray(inv_freq), magnitude)


class MLAttention(nnx.Module):
    """Multi-latent attention; the call signatures of `attention.Attention` (the layer's
    `attention`), its KV cache the latents (`init_cache`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h, std = cfg.hidden_size, cfg.num_attention_heads, cfg.init_method_std
        k, e, r = cfg.head_dim, cfg.qk_pos_emb_head_dim, cfg.kv_lora_rank
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init of output layers
        self.cfg = cfg
        rq = cfg.q_lora_rank
        if rq:
            self.wq_down = param(rngs, normal(std), (d, rq), W_DOWN)
            self.wq_up = param(rngs, normal(std), (rq, h, k), W_UP)
            self.wq = None
        else:
            self.wq_down = self.wq_up = None
            self.wq = param(rngs, normal(std), (d, h, k), ("embed", "heads", "head_dim"))
        self.wkv_down = param(rngs, normal(std), (d, r + e), W_DOWN)  # [latent; key rope part]
        self.wkv_up = param(rngs, normal(std), (r, h, cfg.qk_head_dim + cfg.v_head_dim), W_UP)  # [key; value]
        self.wo = param(rngs, normal(out_std), (h, cfg.v_head_dim, d), WO)
        self.q_norm = Norm(cfg, rq) if cfg.qk_layernorm and rq else None
        self.kv_norm = Norm(cfg, r) if cfg.qk_layernorm else None
        self.bo = param(None, zeros, (d,), ("embed",)) if cfg.add_bias_linear else None
        # delayed fp8 scaling's amax histories (models/fp8.py), one per projection, else None
        self.fp8_history_q_down = fp8.history(cfg) if rq else None
        self.fp8_history_q = fp8.history(cfg)  # wq_up, or wq without a query latent
        self.fp8_history_kv_down, self.fp8_history_kv_up = fp8.history(cfg), fp8.history(cfg)
        self.fp8_history_out = fp8.history(cfg)

    def _down(self, y_bsd, w, history) -> jax.Array:
        """A down projection [b, s, d] -> [b, s, r] on this rank's tokens (fp8 under --fp8-format)."""
        y, w = constrain(y_bsd, SEQ_SPLIT), cast(w, y_bsd.dtype)
        rec = fp8.recipe(self.cfg)
        return jnp.einsum("bsd,dr->bsr", y, w) if rec is None else fp8.einsum("bsd,dr->bsr", y, w, rec, value(history))

    def _queries(self, y_bsd, positions_bs):
        """q [b, s, h, k]: the no-position part, then the rope part turned; times the softmax
        scale's YaRN factor (`softmax_scale` over attention's own 1/sqrt(k))."""
        return self._queries_from(self._query_input(y_bsd), positions_bs)

    def _query_input(self, y_bsd):
        """What the query's up (or only) projection takes: the normed query latent, or y."""
        if self.wq is not None:
            return y_bsd
        q_lat = self._down(y_bsd, self.wq_down, self.fp8_history_q_down)
        return q_lat if self.q_norm is None else self.q_norm(q_lat)

    def _queries_from(self, q_in, positions_bs):
        cfg, dt = self.cfg, q_in.dtype
        rec, history = fp8.recipe(cfg), value(self.fp8_history_q)
        if self.wq is None:
            q = column_parallel("bsr,rhk->bshk", q_in, cast(self.wq_up, dt), W_UP, HEADS, rec, history)
        else:
            q = column_parallel("bsd,dhk->bshk", q_in, cast(self.wq, dt), ("embed", "heads", "head_dim"), HEADS, rec,
                                history)
        q = constrain(q, HEADS)
        nope = cfg.qk_head_dim
        q = jnp.concatenate([q[..., :nope], _turn(q[..., nope:], positions_bs, cfg)], axis=-1)
        factor = softmax_scale(cfg) * math.sqrt(cfg.head_dim)
        return q if factor == 1.0 else (q * factor).astype(q.dtype)

    def _latents(self, y_bsd, positions_bs):
        """(the normed latent [b, s, r] on this rank's tokens, the key rope part [b, s, e] turned,
        over the whole sequence)."""
        cfg = self.cfg
        kv = self._down(y_bsd, self.wkv_down, self.fp8_history_kv_down)
        r = cfg.kv_lora_rank
        latent, k_pe = kv[..., :r], constrain(kv[..., r:], LATENT)
        latent = latent if self.kv_norm is None else self.kv_norm(latent)
        return latent, _turn(k_pe[:, :, None, :], positions_bs, cfg)[:, :, 0, :]

    def _keys_values(self, latent_bsr, k_pe_bse):
        """(k [b, t, h, k], v [b, t, h, v]) of latents and key rope parts."""
        cfg = self.cfg
        kv = column_parallel("bsr,rhj->bshj", latent_bsr, cast(self.wkv_up, latent_bsr.dtype), W_UP, HEADS,
                             fp8.recipe(cfg), value(self.fp8_history_kv_up))
        kv = constrain(kv, HEADS)
        nope, h = cfg.qk_head_dim, kv.shape[2]
        pe = jnp.broadcast_to(k_pe_bse[:, :, None, :], (*k_pe_bse.shape[:2], h, k_pe_bse.shape[-1]))
        k = constrain(jnp.concatenate([kv[..., :nope], pe.astype(kv.dtype)], axis=-1), HEADS)
        return k, constrain(kv[..., nope:], HEADS)

    def __call__(self, y_bsd, positions_bs, segment_ids_bs, key) -> jax.Array:
        """y: the normed input [batch, seq, embed] (a block boundary); returns [batch, seq, embed]
        before the residual add."""
        return self.from_latents(self.latents(y_bsd, positions_bs), positions_bs, segment_ids_bs, key)

    def latents(self, y_bsd, positions_bs) -> tuple:
        """The down projections' side: (what the query's up projection takes, the normed latent,
        the key rope part turned)."""
        return (self._query_input(y_bsd), *self._latents(y_bsd, positions_bs))

    def from_latents(self, latents: tuple, positions_bs, segment_ids_bs, key) -> jax.Array:
        """The up projections, the attention core and the output projection, from `latents`."""
        cfg, dt = self.cfg, latents[1].dtype
        backend = choose_backend(cfg, dt, documents=segment_ids_bs is not None, aligned=True,
                                 dropout_on=key is not None and cfg.attention_dropout > 0)
        context_attention = trace.current().context_attention  # the sequence split over context

        def up_and_core(q_in, latent, k_pe):  # --recompute-modules mla_up_proj recomputes this (but the core)
            q = self._queries_from(q_in, positions_bs)
            k, v = self._keys_values(latent, k_pe)
            width = v.shape[-1]
            # jax's cuDNN entry takes values as wide as the keys, and so does context parallelism's
            # attention (its accumulators are the queries' shape): the values padded with zeros
            if (backend == CUDNN or context_attention is not None) and width < q.shape[-1]:
                v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - width)))
            if context_attention is not None:
                o = context_attention(q, k, v, segment_ids_bs, dropout_rate=cfg.attention_dropout, dropout_key=key,
                                      fused=CUDNN if backend == CUDNN else None)
            else:
                o = attention(q, k, v, None, None, segment_ids_bs, segment_ids_bs, backend=backend,
                              dropout_rate=cfg.attention_dropout, dropout_key=key)  # [b, s, h, v]
            return o[..., :width]

        return self._project_out(recompute.module(cfg, "mla_up_proj", up_and_core, *latents))

    def _project_out(self, o_bshv) -> jax.Array:
        dt = o_bshv.dtype
        o = row_parallel("bshv,hvd->bsd", constrain(o_bshv, HEADS), cast(self.wo, dt), HEADS, WO,
                         fp8.recipe(self.cfg), value(self.fp8_history_out))
        return add_bias(o, cast(self.bo, dt))

    def cached(self, y_bsd, positions_bs, cache: dict):
        """Attention of s new tokens against the latent cache {"latent": [b, t, r], "rope": [b, t, e]};
        returns (out [b, s, d], the cache with the new tokens written at their positions), as
        `Attention.cached` does for keys and values."""
        q = self._queries(y_bsd, positions_bs)
        latent, k_pe = self._latents(y_bsd, positions_bs)
        t = cache["latent"].shape[1]
        new = {"latent": latent, "rope": k_pe}
        if y_bsd.shape[1] == 1:
            at = (jnp.arange(t)[None, :] == positions_bs)[:, :, None]  # [b, t, 1]
            cache = {n: jnp.where(at, new[n].astype(c.dtype), c) for n, c in cache.items()}
        else:
            cache = {n: jax.lax.dynamic_update_slice(c, new[n].astype(c.dtype), (0, 0, 0)) for n, c in cache.items()}
        cache = {n: constrain(c, ("batch", None, None)) for n, c in cache.items()}
        k, v = self._keys_values(cache["latent"].astype(q.dtype), cache["rope"])
        k_pos = jnp.arange(t, dtype=jnp.int32)[None]
        o = attention(q, k, v, positions_bs, k_pos)
        return self._project_out(o), cache

    @staticmethod
    def cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> dict:
        """The per-layer cache's shapes: the normed latent and the turned key rope part."""
        return {"latent": (batch, max_len, cfg.kv_lora_rank), "rope": (batch, max_len, cfg.qk_pos_emb_head_dim)}
