"""Activation recomputation of the layer scan: which layers and which of their values are
recomputed in the backward pass instead of kept from the forward.

`--recompute-granularity` (Megatron's two plus two of mlm_jax's):
  full       each checkpointed layer keeps only its input; the rest is recomputed;
  selective  attention's [b, h, s, t] probabilities are recomputed: what every run does here
             (no attention backend keeps them for the backward, see models/attention.py);
  dots       (mlm_jax) every matmul output with no batch dims (the q/k/v, output, MLP and
             head projections) and the attention's output and log-sum-exp are kept; everything
             else (norms, GELU, rotary, dropout) is recomputed, the attention's forward not:
             most of full's saving for a fraction of its cost;
  offload    (mlm_jax) as `dots`, with the kept matmul outputs moved to host memory (pinned)
             and brought back for the backward: needs a GPU or TPU backend.
`--recompute-modules` with `selective` (Megatron's; the DeepSeek-V3 script's `mlp moe mla_up_proj
layernorm`): each module named runs under a checkpoint of its own (`module`), which keeps its
inputs, and recomputes the rest in the backward. A value that a later op's backward needs is kept
whatever its checkpoint says, so a module's region reaches as far as its values' consumers:
  mlp, moe, shared_experts
             the dense MLP, the whole MoE layer (router, dispatch, experts, combine), the shared
             expert: only the input kept;
  moe_act    the experts' activation and their second product: the activation's output is not
             kept (recomputed from the first product's, which is);
  mla_up_proj
             multi-latent attention's up projections with the attention core they feed: the
             queries, keys and values are recomputed from the latents; the attention's output and
             log-sum-exp stay kept, so its forward does not run again;
  layernorm  each norm with the block it feeds (attention, MLP or MoE), keeping that block's
             matmul outputs, attention values and the MoE's products and received rows: the
             norm's output (and the block's other elementwise values) recomputed. With `mlp` or
             `moe` too, their block keeps nothing but its input (an outer checkpoint's policy
             decides for the checkpoints inside it); with `mla_up_proj` too, the first norm's
             region ends at multi-latent attention's latents (models/gpt.py `Block`). With
             `shared_experts` or `moe_act` but not `moe`, layernorm keeps their products;
  core_attn  the attention core: what every run does (above).
`--recompute-method` with `full` (Megatron's):
  uniform    layers in groups of `--recompute-num-layers` (default 1); only each group's input
             is kept and the whole group recomputed;
  block      only the first `--recompute-num-layers` layers (of each pipeline stage) are
             checkpointed; the rest keep everything.

Inside a scan of two or more rows `prevent_cse=False`: the loop already keeps XLA from merging
the recomputation with the forward (the reason for jax.checkpoint's default), and the barrier
would only cost. A scan of one row is no such loop (XLA inlines a loop of one trip, then merges
the recomputation away: `--recompute-method block --recompute-num-layers 1` recomputed nothing on
GPUs), nor is a remainder group called outside any scan: those keep jax's barrier.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mlm_jax import platform
from mlm_jax.config import ConfigError, ModelConfig

HOST_OFFLOAD_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def check_offload_platform(cfg: ModelConfig, platform: str | None = None) -> None:
    """`--recompute-granularity offload` needs host memory spaces (GPU/TPU): refused elsewhere."""
    if cfg.recompute_granularity != "offload":
        return
    platform = platform or jax.devices()[0].platform
    if platform not in HOST_OFFLOAD_PLATFORMS:
        raise ConfigError(
            f"--recompute-granularity offload moves saved activations to pinned host memory, which "
            f"the {platform} backend does not support; use it on a GPU, or choose dots | full | selective")


# The MoE's named values (models/moe.py): its products' outputs and the rows its dispatch received.
EXPERT_VALUES = ("moe_expert_hidden", "moe_expert_out", "moe_expert_rows")

_KEEPS_MATMULS = ("layernorm",)  # the modules whose checkpoint keeps its matmuls' outputs


def _modules(cfg: ModelConfig) -> tuple[str, ...]:
    """The --recompute-modules that add a checkpoint (core_attn: what every run does already)."""
    if cfg.recompute_granularity != "selective":
        return ()
    return tuple(m for m in cfg.recompute_modules or () if m != "core_attn")


def named(cfg: ModelConfig, name: str) -> bool:
    """Whether --recompute-modules puts module `name` under a checkpoint of its own."""
    return name in _modules(cfg)


def module(cfg: ModelConfig, name: str, fn: Callable, *args, block: str | None = None):
    """fn(*args), run under a checkpoint of its own when `name` is in --recompute-modules: it
    keeps its inputs, the attention's output and log-sum-exp, and with `layernorm` its matmuls'
    outputs and the MoE's products and received rows (`_KEEPS_MATMULS`); the rest of it runs again
    in the backward. `block`: the module that the region's norm feeds (`mlp`, `moe`); when it is
    named too, the region keeps none of its products (an outer checkpoint's policy decides for
    the values of the checkpoints inside it: keeping the block's products would undo its
    recomputation), and the block is recomputed whole, its norm with it."""
    if name not in _modules(cfg):
        return fn(*args)
    keep_products = name in _KEEPS_MATMULS and not (block is not None and named(cfg, block))
    matmuls = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def policy(prim, *a, **params):
        if _is_attention_value(prim, params):
            return True
        if not keep_products:
            return False
        return matmuls(prim, *a, **params) or (prim.name == "name" and params.get("name") in EXPERT_VALUES)

    return jax.checkpoint(fn, policy=policy)(*args)


# The attention's output and its softmax's log-sum-exp: what a fused (flash) backward needs
# besides q, k and v. `dots` and `offload` keep them with the matmul outputs; otherwise the
# attention, whose products have batch dims, would run its forward again inside the backward
# just to make them (cuDNN's kernel twice per layer: seq 8192's Llama-3 8B step 4% longer).
# Named where the XLA core and the context-parallel ring make them (`keep_attention`); cuDNN's
# are the outputs of jax's fused-attention forward primitive, found by its name (both the
# oldest and the newest jax: the GPU-compile tier counts the kernels).
ATTENTION_OUT, ATTENTION_LSE = "attention_out", "attention_lse"
_FUSED_ATTENTION_FORWARD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fp8_fwd_wrapper")


def keep_attention(out, lse):
    """`out` and `lse` named as the attention values `dots` and `offload` keep."""
    return checkpoint_name(out, ATTENTION_OUT), checkpoint_name(lse, ATTENTION_LSE)


def _is_attention_value(prim, params) -> bool:
    if prim.name == "name":  # checkpoint_name's primitive
        return params.get("name") in (ATTENTION_OUT, ATTENTION_LSE)
    return prim.name in _FUSED_ATTENTION_FORWARD


def _policy(granularity: str):
    cp = jax.checkpoint_policies
    if granularity == "dots":
        matmuls = cp.dots_with_no_batch_dims_saveable
    elif granularity == "offload":  # the attention's values stay on the device (small beside the matmuls')
        matmuls = cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    else:
        return cp.nothing_saveable

    def policy(prim, *args, **params):
        return True if _is_attention_value(prim, params) else matmuls(prim, *args, **params)

    return policy


def _remat(fn: Callable, granularity: str, scanned_rows: int = 0, keep: Callable | None = None) -> Callable:
    """`fn` recomputed per `granularity`, to run as the body of a scan of `scanned_rows` rows (0:
    called outside any scan); `keep` ((prim, params) -> bool): values kept whatever the policy."""
    policy = _policy(granularity)
    if keep is not None:
        base = policy

        def policy(prim, *args, **params):
            return keep(prim, params) or base(prim, *args, **params)

    return jax.checkpoint(fn, policy=policy, prevent_cse=scanned_rows < 2)


def _rows(xs, start: int, stop: int):
    return jax.tree.map(lambda a: a[start:stop], xs)


def scan_layers(body: Callable, x, xs, n: int, cfg: ModelConfig, hook=None):
    """Run `body` ((x, xs_l) -> (x, stats_l)) over the `n` stacked rows of `xs` with the
    recompute policy of `cfg`; returns (the final x, the per-layer stats summed over layers).
    `hook` (the trace's `layer_grad_hook`, or None): `hook.wrap(body)` is what a body that no
    recompute policy covers runs as, and `hook.keeps(prim, params)` what every policy keeps
    besides its own (FSDP's gathered weights: gathered again in the backward under
    optim_grads_params, kept from the forward under optim_grads; `parallel.fsdp`)."""
    g = cfg.recompute_granularity
    plain = body if hook is None else hook.wrap(body)
    keep = None if hook is None else hook.keeps
    if g in (None, "selective"):
        if _modules(cfg) and plain is not body:
            # The hook rematerializes the layer (FSDP's optim_grads_params: its weights gathered
            # again in the backward) under one policy, and jax applies the outermost checkpoint's
            # policy to every value inside it, the modules' checkpoints' too: it would keep all
            # that they recompute. Each layer is recomputed whole instead (`parallel.fsdp`
            # `recompute_modules_note` says so in the run's log).
            return _scan_sum(_remat(body, "full", n, keep), x, xs)
        # --recompute-modules' checkpoints: never unrolled (XLA merged their recomputation with the
        # forward: the unrolled step kept as much as without them)
        return _scan_sum(plain, x, xs, unroll=unrolled(n, g) and not _modules(cfg))
    if g in ("dots", "offload"):
        return _scan_sum(_remat(body, g, n, keep), x, xs)
    k = cfg.recompute_num_layers or 1
    if cfg.recompute_method == "block":
        k = min(k, n)
        x, stats = _scan_sum(_remat(body, "full", k, keep), x, _rows(xs, 0, k))
        if k < n:
            x, rest = _scan_sum(plain, x, _rows(xs, k, n))
            stats = jax.tree.map(jnp.add, stats, rest)
        return x, stats
    if k == 1:
        return _scan_sum(_remat(body, "full", n, keep), x, xs)
    groups = n // k

    def group(x, xs_group):  # k layers; only the group's input is kept
        return _scan_sum(body, x, xs_group)

    stats = None
    if groups:
        grouped = jax.tree.map(lambda a: a[: groups * k].reshape(groups, k, *a.shape[1:]), xs)  # [G, k, ...]
        x, stats = _scan_sum(_remat(group, "full", groups, keep), x, grouped)
    if groups * k < n:  # an uneven pipeline stage: the remainder as one more group
        x, rest = _remat(group, "full", 0, keep)(x, _rows(xs, groups * k, n))
        stats = rest if stats is None else jax.tree.map(jnp.add, stats, rest)
    return x, stats


# Without recomputation, on a CPU, a scan of up to this many layers runs unrolled: one
# straight-line program, with no per-layer stacking of the saved activations and weight
# gradients (zero-filled [layers, ...] buffers written slice by slice) and fusions across the
# layer boundaries. Workload W (4 layers): the plain step 566 -> 524 ms, compile time unchanged
# (benchmarks/RESULTS.md). Not with recomputation (unrolled, XLA could merge the recomputation
# with the forward it repeats), nor on accelerators or deeper models, whose compile time would
# grow with the layers.
_UNROLLED_LAYERS = {platform.CPU: 8}


def unrolled(n: int, granularity: str | None) -> bool:
    """Whether a scan of `n` layers with this recompute granularity runs unrolled here."""
    return granularity in (None, "selective") and n <= _UNROLLED_LAYERS.get(platform.current(), 0)


def _scan_sum(body: Callable, x, xs, unroll: bool = False):
    """lax.scan of `body`, its per-row outputs summed over the rows: (x, summed stats)."""
    x, ys = jax.lax.scan(body, x, xs, unroll=unroll or 1)
    return x, jax.tree.map(lambda a: jnp.sum(a, axis=0), ys)
