"""The attention entry point (mlm_jax/models/attention.py) and the --attention-backend choice.

The entry point is checked against a naive numpy reference that repeats K/V per query head and
builds the mask by hand: positions that are any integers (not contiguous, not starting at 0),
fewer queries than keys, documents, grouped-query attention. fp32, 1e-5 absolute (values are
O(1); a wrong mask entry or a misgrouped head is off by O(0.1)).

The backend choice and its errors run on CPU: `auto` picks XLA here, `flash`/`fused` are refused
with one line that says why and what to use, in config validation (fp32, dropout, documents),
at parallelize time (the platform) and on the command line (exit 2, no traceback).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.config import ConfigError, ModelConfig, ParallelConfig
from mlm_jax.models.attention import CUDNN, XLA, attention, block_backward, block_forward, choose_backend
from mlm_jax.plan.targets import plugin_missing
from mlm_jax.validation import finalize
from tests.parallel_util import tiny_config

RNG = np.random.default_rng(0)
B, S, T, H, G, K = 2, 5, 9, 8, 2, 16


def naive(q, k, v, q_pos, k_pos, q_seg, k_seg):
    """softmax(q k^T / sqrt(K) masked) v with K/V repeated per head: [b, s, h, k]."""
    r = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)  # [b, t, h, k]
    scores = np.einsum("bshk,bthk->bhst", q, k) / np.sqrt(q.shape[-1])
    mask = k_pos[:, None, :] <= q_pos[:, :, None]
    if q_seg is not None:
        mask &= q_seg[:, :, None] == k_seg[:, None, :]
    scores = np.where(mask[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhst,bthk->bshk", p, v)


def qkv(s=S, t=T):
    return (RNG.standard_normal((B, s, H, K)).astype(np.float32),
            RNG.standard_normal((B, t, G, K)).astype(np.float32),
            RNG.standard_normal((B, t, G, K)).astype(np.float32))


def test_positions_may_be_any_integers_and_queries_fewer_than_keys():
    q, k, v = qkv()
    # Non-contiguous key positions (a context-parallel chunk pair), queries somewhere among them.
    k_pos = np.stack([np.array([3, 4, 5, 20, 21, 22, 40, 41, 42])] * B).astype(np.int32)
    q_pos = np.stack([np.array([4, 21, 22, 40, 42]), np.array([3, 5, 20, 41, 42])]).astype(np.int32)
    q_seg = np.array([[0, 1, 1, 1, 2], [0, 0, 1, 2, 2]], np.int32)
    k_seg = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2]] * B, np.int32)
    got = attention(q, k, v, q_pos, k_pos, q_seg, k_seg)
    np.testing.assert_allclose(got, naive(q, k, v, q_pos, k_pos, q_seg, k_seg), atol=1e-5)
    got = attention(q, k, v, q_pos, k_pos)  # no documents
    np.testing.assert_allclose(got, naive(q, k, v, q_pos, k_pos, None, None), atol=1e-5)


def test_plain_order_is_the_last_queries_of_the_keys():
    q, k, v = qkv()
    k_pos = np.arange(T, dtype=np.int32)[None].repeat(B, 0)
    q_pos = k_pos[:, T - S:]
    np.testing.assert_allclose(attention(q, k, v), naive(q, k, v, q_pos, k_pos, None, None), atol=1e-5)
    q, k, v = qkv(T, T)
    np.testing.assert_allclose(attention(q, k, v), naive(q, k, v, k_pos, k_pos, None, None), atol=1e-5)


def naive_jnp(q, k, v, q_pos, k_pos, q_seg, k_seg):
    """`naive` in jax.numpy, differentiable: autodiff keeps the probabilities."""
    r = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    scores = jnp.einsum("bshk,bthk->bhst", q, k) / np.sqrt(q.shape[-1])
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    p = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhst,bthk->bshk", p, v)


def test_gradients_match_autodiff_of_the_naive_reference():
    """The XLA core's backward (probabilities recomputed from the log-normaliser, custom VJP)
    gives autodiff's gradients of the naive softmax attention: GQA, documents, non-contiguous
    positions, fewer queries than keys. fp32, 1e-5 absolute on O(1) gradients."""
    q, k, v = qkv()
    k_pos = np.stack([np.array([3, 4, 5, 20, 21, 22, 40, 41, 42])] * B).astype(np.int32)
    q_pos = np.stack([np.array([4, 21, 22, 40, 42]), np.array([3, 5, 20, 41, 42])]).astype(np.int32)
    q_seg = np.array([[0, 1, 1, 1, 2], [0, 0, 1, 2, 2]], np.int32)
    k_seg = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2]] * B, np.int32)
    cot = RNG.standard_normal((B, S, H, K)).astype(np.float32)

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a, q_pos, k_pos, q_seg, k_seg) * cot), argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads(attention), grads(naive_jnp)):
        assert float(jnp.max(jnp.abs(want))) > 0.1
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_gradients_with_dropout_match_autodiff_of_the_forward():
    """With attention dropout the backward redraws the forward's mask from the key: its
    gradients equal autodiff's of the same forward (which keeps the dropped probabilities)."""
    from mlm_jax.models.attention import _attend, _attend_plain

    b, g, rows, t, kd = 2, 2, 12, 12, 16
    q, k, v, cot = (jnp.asarray(RNG.standard_normal(shape), jnp.float32)
                    for shape in [(b, g, rows, kd), (b, g, t, kd), (b, g, t, kd), (b, g, rows, kd)])
    mask = jnp.tril(jnp.ones((rows, t), bool))[None, None]
    key, row0 = jax.random.key(3), jnp.int32(4)  # this program's rows start at global row 4

    def grads(fn):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask, key, row0, 0.25) * cot),
                        argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads(_attend), grads(_attend_plain)):
        assert float(jnp.max(jnp.abs(want))) > 0.1
        np.testing.assert_allclose(got, want, atol=1e-5)
    # The mask is really applied: without dropout the gradients differ.
    assert not np.allclose(grads(_attend)[0], jax.grad(
        lambda q: jnp.sum(_attend(q, k, v, mask, key, row0, 0.0) * cot))(q), atol=1e-3)


def test_causal_query_blocks_equal_the_square():
    """On a CPU the plain causal order runs in query blocks, each against only the keys it can
    see (attention.causal_blocks): output and every gradient equal the one-square core's and
    the naive reference's (GQA, documents; fp32, 1e-5 absolute), and the compiled backward
    holds no [rows, t] square of scores nor a product contracting a block's rows."""
    from mlm_jax.models import attention as attention_module

    s = 128
    q, k, v = qkv(s, s)
    seg = np.sort(RNG.integers(0, 3, (B, s)), axis=1).astype(np.int32)
    pos = np.arange(s, dtype=np.int32)[None].repeat(B, 0)
    cot = RNG.standard_normal((B, s, H, K)).astype(np.float32)
    assert attention_module.causal_blocks(s, s, dropout_on=False) == 4
    assert attention_module.causal_blocks(s, s, dropout_on=True) == 1  # a block's mask is not the square's
    assert attention_module.causal_blocks(s // 2, s, dropout_on=False) == 1  # fewer queries than keys
    from mlm_jax.models import gpt
    from mlm_jax.sharding import trace

    with trace.using(platform="cuda"):  # a step traced for GPUs (a deviceless compile too): one square
        assert attention_module.causal_blocks(s, s, dropout_on=False) == 1
        assert not gpt._weight_gradient_dv()  # nor the CPU's transposed head-weight gradient
    assert gpt._weight_gradient_dv()

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, None, None, seg, seg) * cot)

    def value_and_grads():
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

    blocked = value_and_grads()
    square_shape = f"f32[{B},{G},{H // G * s},{s}]"  # [b, g, r*s, t]: the whole square's scores
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert square_shape not in compiled
    # key and value gradients as plain products of q and d_out transposed (keys_minor), none
    # contracting the rows of a block's scores
    assert "lhs_contracting_dims={2}" not in compiled
    kept, attention_module._CAUSAL_BLOCKS = attention_module._CAUSAL_BLOCKS, {}
    try:
        square = value_and_grads()
        assert square_shape in jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    finally:
        attention_module._CAUSAL_BLOCKS = kept
    np.testing.assert_allclose(blocked[0], square[0], rtol=1e-6)
    for got, want in zip(blocked[1], square[1]):
        assert float(jnp.max(jnp.abs(want))) > 0.1
        np.testing.assert_allclose(got, want, atol=1e-5)
    want = naive(q, k, v, pos, pos, seg, seg)
    np.testing.assert_allclose(attention(q, k, v, None, None, seg, seg), want, atol=1e-5)


def _f32_dots(fn, *args) -> tuple[list, int]:
    """(dot_generals of fn's gradient jaxpr with an fp32 operand (XLA computes a mixed
    fp32 x bf16 dot in fp32), how many dot_generals the walk saw in all)."""
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(*args)
    found, seen = [], 0

    # The inner jaxprs of an equation's params, open and closed (a scan's, a call's): jax.core's
    # jaxprs_in_params is gone in jax 0.12, and jax.extend.core's yields the open ones only.
    def inner(params):
        for value in params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, jax.extend.core.ClosedJaxpr):
                    yield v.jaxpr
                elif isinstance(v, jax.extend.core.Jaxpr):
                    yield v

    def visit(jx):
        nonlocal seen
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                seen += 1
                if any(x.aval.dtype == jnp.float32 for x in eqn.invars):
                    found.append(eqn)
            for sub in inner(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr)
    assert seen >= str(jaxpr).count("dot_general["), jaxpr  # the walk reached every product printed
    return found, seen


def test_bf16_score_matmuls_compute_in_bf16_forward_and_backward():
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(T, T))

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)

    found, seen = _f32_dots(loss, q, k, v)
    assert found == [] and seen >= 6  # the forward's 2 products, the backward's 4 at least
    # The same check sees fp32 x fp32 when it is there.
    found, seen = _f32_dots(loss, *(x.astype(jnp.float32) for x in (q, k, v)))
    assert len(found) == seen


# --------------------------------------------------------------------------- backend choice

BF16 = ModelConfig(bf16=True, attention_dropout=0.0, hidden_size=128, num_attention_heads=4)


@pytest.mark.parametrize("flag,gpu,cfg,want", [
    ("auto", False, BF16, XLA),  # CPU
    ("auto", True, BF16, CUDNN),
    ("auto", True, dataclasses.replace(BF16, bf16=False), XLA),
    ("auto", True, dataclasses.replace(BF16, attention_dropout=0.1), XLA),
    ("unfused", True, BF16, XLA),
    ("local", True, BF16, XLA),
    ("flash", True, BF16, CUDNN),
    ("fused", True, BF16, CUDNN),
])
def test_backend_choice(flag, gpu, cfg, want):
    cfg = dataclasses.replace(cfg, attention_backend=flag)
    dtype = jnp.bfloat16 if cfg.bf16 else jnp.float32
    dropout_on = cfg.attention_dropout > 0
    assert choose_backend(cfg, dtype, documents=False, aligned=True, dropout_on=dropout_on,
                          nvidia_gpu=gpu) == want


def test_auto_falls_back_to_xla_for_documents_and_explicit_positions():
    cfg = dataclasses.replace(BF16, attention_backend="auto")
    kw = dict(dropout_on=False, nvidia_gpu=True)
    assert choose_backend(cfg, jnp.bfloat16, documents=True, aligned=True, **kw) == XLA
    assert choose_backend(cfg, jnp.bfloat16, documents=False, aligned=False, **kw) == XLA


@pytest.mark.parametrize("change,why", [
    (dict(bf16=False), "cuDNN fused attention needs bf16 compute"),
    (dict(attention_dropout=0.1), "cuDNN fused attention has no attention dropout"),
])
def test_flash_where_cudnn_cannot_run_on_a_gpu_says_why(change, why):
    cfg = dataclasses.replace(BF16, attention_backend="flash", **change)
    with pytest.raises(ConfigError, match=why) as e:
        choose_backend(cfg, jnp.bfloat16, documents=False, aligned=True, dropout_on=False, nvidia_gpu=True)
    assert "use --attention-backend auto or unfused" in str(e.value)


@pytest.mark.parametrize("flag", ["flash", "fused"])
def test_flash_off_a_gpu_runs_xla_attention(flag):
    """A laptop smoke test of a GPU script (Megatron's Llama-3 example gives fused): XLA runs."""
    cfg = dataclasses.replace(BF16, attention_backend=flag)
    assert choose_backend(cfg, jnp.bfloat16, documents=False, aligned=True, dropout_on=False) == XLA
    assert choose_backend(cfg, jnp.bfloat16, documents=False, aligned=True, dropout_on=False,
                          nvidia_gpu=False) == XLA


@pytest.mark.skipif(plugin_missing() is not None, reason=str(plugin_missing()))
@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_block_kernels_take_the_installed_jaxs_arguments(causal):
    """Ring attention's cuDNN blocks call jax's internal fused-attention rules, whose parameters
    change between versions (jax 0.12 added two): traced (no GPU needed), each block gives the
    shapes and dtypes block_forward and block_backward promise."""
    b, s, h, g, k = 2, 128, 4, 2, 64
    q = jax.ShapeDtypeStruct((b, s, h, k), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, g, k), jnp.bfloat16)
    out, lse = jax.eval_shape(lambda q, k, v: block_forward(q, k, v, causal, CUDNN), q, kv, kv)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (b, h, s), jnp.float32)
    grads = jax.eval_shape(lambda *a: block_backward(*a[:3], causal, *a[3:], backend=CUDNN), q, kv, kv, out, lse, q)
    assert [(x.shape, x.dtype) for x in grads] == [(q.shape, q.dtype), (kv.shape, kv.dtype), (kv.shape, kv.dtype)]


def _finalize(reset_attention_mask=False, **model):
    cfg = tiny_config(ParallelConfig(), 2, **model)
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, reset_attention_mask=reset_attention_mask))
    return finalize(cfg, jax.device_count())


@pytest.mark.parametrize("kwargs,message", [
    (dict(attention_backend="flash"), r"--attention-backend flash: cuDNN fused attention needs bf16 compute \(add --bf16\)"),
    (dict(attention_backend="fused", bf16=True, attention_dropout=0.1),
     r"--attention-backend fused: cuDNN fused attention has no attention dropout \(--attention-dropout 0.1; set 0\)"),
    (dict(attention_backend="flash", bf16=True, reset_attention_mask=True),
     r"cannot mask documents \(--reset-attention-mask\)"),
    (dict(attention_backend="flash", bf16=True, kv_channels=12), "multiple of 8 and <= 128, got 12"),
    (dict(attention_backend="triton"), "--attention-backend 'triton' is unknown; choose one of auto, flash"),
])
def test_config_validation_refuses_flash_before_compiling(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _finalize(**kwargs)


def test_flash_off_gpu_is_one_note_and_xla():
    from mlm_jax.models.attention import backend_note
    from mlm_jax.build import parallelize
    from mlm_jax.sharding import make_mesh

    cfg = _finalize(attention_backend="flash", bf16=True)  # valid config, not an NVIDIA GPU
    assert backend_note(cfg.model, "cpu") == (
        "--attention-backend flash: cuDNN fused attention needs an NVIDIA GPU, this is cpu: XLA "
        "attention runs instead (the same math)")
    assert backend_note(cfg.model, "cuda") is None
    assert backend_note(dataclasses.replace(cfg.model, attention_backend="auto"), "cpu") is None
    pz = parallelize(cfg, make_mesh(cfg.parallel))
    text = pz.eval_step.lower(pz.abstract_state()["params"], pz.abstract_batch()).as_text()
    assert "cudnn" not in text.lower()


def test_cli_flash_on_cpu_trains_with_one_note(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "mlm_jax.train", "--mock-data", "--attention-backend", "flash",
                          "--bf16", "--attention-dropout", "0", "--num-layers", "1", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
                          "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1",
                          "--vocab-size", "256", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0",
                          "--run-dir", str(tmp_path / "run"), "--sample-tokens", "0", "--no-progress-bar"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "--attention-backend flash" in line]
    assert len(lines) == 1 and "NVIDIA GPU" in lines[0] and "XLA attention runs instead" in lines[0], lines


def test_per_device_blocks_equal_the_whole_attention():
    """cuDNN's attention runs on each device's block (`rules.per_device`: a fully manual shard_map
    over every axis not manual yet). The block layout is checked here with XLA attention in its
    place: output and every input gradient equal the unsplit attention's (fp32, 1e-6), at top
    level and inside a per-rank body manual over `data`, on data4 x tensor2."""
    from jax.sharding import PartitionSpec as P

    from mlm_jax.parallel import tracing
    from mlm_jax.sharding import make_mesh
    from mlm_jax.sharding.rules import activation_rules, per_device

    mesh = make_mesh(ParallelConfig(tensor_model_parallel_size=2))
    kq, kk, kv, kw = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(kq, (8, 32, 8, 16), jnp.float32)  # [b, s, h, k]
    k = jax.random.normal(kk, (8, 32, 4, 16), jnp.float32)  # [b, t, g, k]: GQA, 2 heads per group
    v = jax.random.normal(kv, (8, 32, 4, 16), jnp.float32)
    w = jax.random.normal(kw, q.shape, jnp.float32)
    q_names, kv_names = ("batch", "context_seq", "heads", "head_dim"), ("batch", "context_seq", "kv_heads", "head_dim")
    whole = lambda q, k, v: attention(q, k, v, backend=XLA)  # noqa: E731
    blocks = per_device(whole, (q_names, kv_names, kv_names), q_names)
    per_rank = jax.shard_map(blocks, in_specs=(P("data"),) * 3, out_specs=P("data"), axis_names={"data"},
                             check_vma=False)

    def grads(f):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(q, k, v)

    ref_loss, ref = grads(whole)
    with tracing(mesh, activation_rules(False)):
        for f in (blocks, per_rank):
            loss, got = grads(f)
            np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
            for a, b in zip(got, ref):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert blocks(q, k, v).shape == q.shape  # outside the rules: the function itself
