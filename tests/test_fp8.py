"""fp8 projections (`--fp8-format`, `--fp8-recipe tensorwise`; mlm_jax/models/fp8.py).

The scaled product: its value and both gradients against the exact product within the format's
rounding, a scale from the whole tensor, no NaN from zero, huge or infinite values.

Every layout against one device running the same rows per microbatch (a scale is the amax of
the microbatch's tensor, so the reference groups rows as the layout does), fp32 compute:
  - where each element is computed as on one device (data parallel, ZeRO, expert parallel), the
    quantized values are the same: loss within 2e-6, each gradient leaf within 1e-5 of its largest
    magnitude (measured worst 3.3e-6);
  - where tensor, context or pipeline parallelism reorder a sum, an fp32 rounding can put a value
    on the other side of an fp8 rounding boundary: that element moves by one fp8 step (e5m2: 25 %)
    and, in the backward, moves the gradients of the layers before it. Loss within 2e-6 (measured
    0), each gradient leaf within 4e-2 of its largest magnitude (measured worst 2.5e-2, pipeline
    x tensor x data; 5e-4 tensor + SP, 6e-5 context).
  A missing amax reduction is caught by both: per-rank scales under dp8 put the loss 1e-4 off and
  a gradient leaf 13 % (the fp8 step itself is 10 % from fp32's, per leaf).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.config import ModelConfig, ParallelConfig
from mlm_jax.models import fp8
from mlm_jax.models.build import init_params
from mlm_jax.validation import finalize
from tests.parallel_util import grads_for, tiny_config, unpad

HYBRID = (("fp8_format", "hybrid"), ("fp8_recipe", "tensorwise"))
LOSS_ATOL = 2e-6
SAME_ORDER_RTOL = 1e-5
REORDERED_RTOL = 4e-2

# name -> (layout, micro batch), the one-device micro batch with the same rows, reordered sums?
LAYOUTS = {
    "dp8": ((ParallelConfig(), 1), 8, False),
    "zero1_dp4_tp2": ((ParallelConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True), 2), 8, False),
    "dp2_tp4_sp": ((ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True), 2), 4, True),
    "cp2_tp2_dp2": ((ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2), 2), 4, True),
    "pp2_tp2_dp2": ((ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2), 2), 4, True),
}
# A MoE model (its attention projections fp8, the experts' products too) under expert parallelism.
MOE = (("num_experts", 4), ("moe_router_topk", 2), ("moe_aux_loss_coeff", 0.01), ("moe_z_loss_coeff", 0.001))
# The experts in the compute dtype (XLA's ragged_dot, which has no fp8 GEMM on GPUs): the control
# that shows the experts' products are fp8 otherwise.
EXPERTS_EXACT = (("moe_grouped_gemm", False),)


def assert_experts_far_off(ref: dict, exact: dict):
    """Every expert leaf more than 5 % off between two one-device steps."""
    experts = {k: e for k, e in relative_errors(exact, ref).items() if k.endswith(("['mlp']['w1']", "['mlp']['w2']"))}
    assert len(experts) == 2 and min(experts.values()) > 0.05, experts


def relative_errors(ref: dict, got: dict) -> dict:
    """Each gradient leaf's max-abs error over its largest magnitude (amax histories left out)."""
    return {jax.tree_util.keystr(p): float(np.max(np.abs(r - g)) / np.max(np.abs(r)))
            for (p, r), g in zip(jax.tree_util.tree_leaves_with_path(unpad(ref)), jax.tree.leaves(unpad(got)))
            if not fp8.is_history(p)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_fp8_step_matches_one_device(name):
    layout, ref_micro, reordered = LAYOUTS[name]
    ref_loss, ref_grads = grads_for(ParallelConfig(), ref_micro, single_device=True, model=HYBRID)
    loss, grads = grads_for(*layout, model=HYBRID)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    errors = relative_errors(ref_grads, grads)
    assert max(errors.values()) <= (REORDERED_RTOL if reordered else SAME_ORDER_RTOL), errors
    # fp8 is on: the same step without it is ~10 % away in some leaf.
    _, plain = grads_for(ParallelConfig(), ref_micro, single_device=True)
    assert max(relative_errors(plain, ref_grads).values()) > 0.05


def test_an_fp8_mla_step_matches_one_device():
    """Multi-latent attention's projections (the query and key/value latents' down and up
    projections, the output) multiply fp8 as the other projections do: dp2 x tp4 (the heads
    split) against one device, each element as one device computes it (measured 7.7e-7 on both
    jax versions); every one of them is fp8 (each weight's gradient > 5 % from the bf16 step's)
    and under delayed scaling each keeps a history. (With --sequence-parallel the down
    projections run on each rank's tokens: on jax 0.12 the bf16 step's values come out an fp32
    rounding from one device's there (9.6e-7), which fp8 rounding turns into differences of up
    to 8.8 % in the 16-value kv_norm scale's gradient; 6.6e-7 on jax 0.10.)"""
    from tests.test_mla import MLA

    ref_loss, ref = grads_for(ParallelConfig(), 4, single_device=True, model=MLA + HYBRID)
    loss, got = grads_for(ParallelConfig(tensor_model_parallel_size=4), 2, model=MLA + HYBRID)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    errors = relative_errors(ref, got)
    assert max(errors.values()) <= SAME_ORDER_RTOL, errors
    _, plain = grads_for(ParallelConfig(), 4, single_device=True, model=MLA)
    projections = ("wq_down", "wq_up", "wkv_down", "wkv_up", "wo")
    off = {k: e for k, e in relative_errors(plain, ref).items() if k.startswith("['layers']['attention']")}
    assert all(off[f"['layers']['attention']['{w}']"] > 0.05 for w in projections), off
    histories = init_params(finalize(tiny_config(ParallelConfig(), 2, **dict(MLA), fp8_format="hybrid"), 1), 0)
    names = {k for k in histories["layers"]["attention"] if fp8.is_history([k])}
    assert names == {f"{fp8.HISTORY}_{n}" for n in ("q_down", "q", "kv_down", "kv_up", "out")}, names


def test_an_fp8_moe_step_under_expert_parallelism_matches_one_device():
    """ep2 x dp4 (alltoall), dropless: each rank's rows and the experts' dispatch; the attention
    projections' amaxes a max over the data and expert ranks, the experts' grouped products'
    over the data and expert ranks too (their rows), of the rows the groups hold (a receive
    buffer's unused rows left out). The dispatch's sums come out an fp32 rounding apart from one
    device's (3e-6 per leaf with the experts exact), which the experts' fp8 quantization turns
    into the reordered layouts' differences (measured worst 2.5e-2; layer 2's w2 gradient 0.7 %
    of its elements off). Per-rank expert amaxes put the loss 2.5e-4 off."""
    ref_loss, ref = grads_for(ParallelConfig(), 8, single_device=True, model=MOE + HYBRID)
    loss, got = grads_for(ParallelConfig(expert_model_parallel_size=2), 1, model=MOE + HYBRID)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    errors = relative_errors(ref, got)
    assert max(errors.values()) <= REORDERED_RTOL, errors
    _, exact = grads_for(ParallelConfig(), 8, single_device=True, model=MOE + HYBRID + EXPERTS_EXACT)
    assert_experts_far_off(ref, exact)


# The experts' products are fp8 where they are batched matmuls over [experts, capacity] slots.
PADDED = (("moe_expert_capacity_factor", 1.0), ("moe_token_drop_policy", "position"),
          ("moe_pad_expert_input_to_capacity", True))
# (Dropping tokens, the reference gates its 8 routing groups' rows in another order than the
# ranks do: fp32 roundings 7.5e-7 apart without fp8, which fp8 rounding turns into the reordered
# layouts' differences, also with the experts in the compute dtype. A missing amax reduction
# moves the loss: per-rank expert scales put it 1e-4 off.)
EXPERT_LAYOUTS = {  # name -> layout, micro batch, routing groups of the one-device reference
    "ep4_dp2_alltoall": (ParallelConfig(expert_model_parallel_size=4), 1, 8),
    "ep2_tp2_dp2": (ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2), 2, 4),
}


@pytest.mark.parametrize("name", list(EXPERT_LAYOUTS))
def test_fp8_experts_under_expert_parallelism_match_one_device(name):
    """The experts' amaxes are the whole tensors' (a max over the data, expert and tensor ranks
    holding rows or weight pieces), so each rank quantizes as one device does."""
    parallel, micro, groups = EXPERT_LAYOUTS[name]
    model = MOE + HYBRID + PADDED
    ref_loss, ref = grads_for(ParallelConfig(), 8, single_device=True, model=model, route_groups=groups)
    loss, got = grads_for(parallel, micro, model=model)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    errors = relative_errors(ref, got)
    assert max(errors.values()) <= REORDERED_RTOL, errors
    # The experts are fp8: the same step with them in the compute dtype (the same drops, not
    # padded: XLA's ragged_dot) is far off in their leaves.
    unpadded = MOE + HYBRID + tuple(kv for kv in PADDED if kv[0] != "moe_pad_expert_input_to_capacity")
    _, exact = grads_for(ParallelConfig(), 8, single_device=True, model=unpadded + EXPERTS_EXACT, route_groups=groups)
    assert_experts_far_off(ref, exact)


def product(rec, x, w, g):
    """(value, dx, dw) of sum(einsum(x, w) * g) with fp8 operands under `rec` (None: exact)."""
    def f(x, w):
        y = jnp.einsum("bsd,df->bsf", x, w) if rec is None else fp8.einsum("bsd,df->bsf", x, w, rec)
        return jnp.sum(y * g)
    return (f(x, w), *jax.grad(f, (0, 1))(x, w))


def operands(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k[0], (2, 16, 32)), 0.05 * jax.random.normal(k[1], (32, 48)),
            jax.random.normal(k[2], (2, 16, 48)))


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("fmt,grad_bound", [("e4m3", 0.04), ("hybrid", 0.08)])
def test_the_scaled_product_is_the_product_within_the_formats_rounding(fmt, grad_bound):
    """e4m3 keeps 3 mantissa bits (a relative rounding of at most 2^-4 per operand), e5m2 2
    (2^-3): the forward's two e4m3 operands put the product within a few percent; the gradients,
    whose incoming gradient is e5m2 under hybrid, twice that. The measured errors are about half
    the bounds; a scale off by any factor other than a power of two, a missing descale, or a
    transposed gradient is far outside them."""
    x, w, g = operands()
    rec = fp8.recipe(ModelConfig(fp8_format=fmt, fp8_recipe="tensorwise"))
    assert rec.backward == (jnp.float8_e5m2 if fmt == "hybrid" else jnp.float8_e4m3fn)
    y, dx, dw = product(rec, x, w, g)
    ry, rdx, rdw = product(None, x, w, g)
    y_rel = rel(fp8.einsum("bsd,df->bsf", x, w, rec), jnp.einsum("bsd,df->bsf", x, w))
    assert 0.005 < y_rel < 0.04, y_rel
    assert 0.005 < rel(dx, rdx) < grad_bound and 0.005 < rel(dw, rdw) < grad_bound, (rel(dx, rdx), rel(dw, rdw))
    # Scale-free: an operand times 2^k quantizes to the same fp8 values, its scale times 2^k.
    y2 = fp8.einsum("bsd,df->bsf", 4.0 * x, w, rec)
    np.testing.assert_allclose(y2, 4.0 * fp8.einsum("bsd,df->bsf", x, w, rec), rtol=1e-6, atol=1e-7)


def test_the_experts_grouped_product_quantizes_as_the_projections_do():
    """The dropless experts' grouped matmul (`fp8.grouped`, XLA's ragged_dot of the fp8 values on
    this CPU; on an H100 the Pallas kernels' fp8 wgmma): one group is the projections' scaled
    product exactly (the same scales and fp8 values, the same three products); several groups
    stay within the formats' rounding of the exact product; the rows past the groups' sum (a
    dispatch buffer's unused rows, as many as the layout makes) move no scale."""
    rec = fp8.recipe(ModelConfig(fp8_format="hybrid", fp8_recipe="tensorwise"))
    x, w, g = (a.reshape(-1, a.shape[-1]) if a.ndim == 3 else a for a in operands(2))  # [32, 32], [32, 48], [32, 48]

    def grouped(x, w, sizes):
        return jnp.sum(fp8.grouped(x, w, sizes, rec) * g)

    one = jnp.array([32], jnp.int32)
    got = jax.value_and_grad(grouped, (0, 1))(x, w[None], one)
    want = jax.value_and_grad(lambda x, w: jnp.sum(fp8.einsum("rd,df->rf", x, w, rec) * g), (0, 1))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1][0], want[1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1][1][0], want[1][1], rtol=1e-5, atol=1e-6)

    sizes = jnp.array([7, 0, 19], jnp.int32)  # 6 rows past the sum
    ws = jnp.stack([w, -w, 0.5 * w])
    y, (dx, dw) = jax.value_and_grad(grouped, (0, 1))(x, ws, sizes)
    _, (rdx, rdw) = jax.value_and_grad(lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, sizes) * g), (0, 1))(x, ws)
    out, exact = fp8.grouped(x, ws, sizes, rec), jax.lax.ragged_dot(x, ws, sizes)
    assert 0.005 < rel(out, exact) < 0.04 and 0.005 < rel(dx, rdx) < 0.08 and 0.005 < rel(dw, rdw) < 0.08, \
        (rel(out, exact), rel(dx, rdx), rel(dw, rdw))
    assert not np.asarray(dx[26:]).any()
    loud = x.at[26:].set(1e4)  # rows no group holds
    y2, (dx2, dw2) = jax.value_and_grad(grouped, (0, 1))(loud, ws, sizes)
    assert float(y2) == float(y) and np.array_equal(dw2, dw) and np.array_equal(dx2, dx)


def test_no_fp8_wgrad_keeps_the_weight_gradient_exact():
    x, w, g = operands(1)
    rec = fp8.recipe(ModelConfig(fp8_format="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False))
    assert rec.wgrad is False
    _, dx, dw = product(rec, x, w, g)
    _, rdx, rdw = product(None, x, w, g)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-6)
    assert rel(dx, rdx) > 0.005  # the input gradient is still an fp8 product


def test_scales_never_make_nan():
    """A zero tensor has scale 1 (no division by zero); an infinite value saturates at the
    format's largest instead of turning the tensor's scale infinite (then every value 0 or NaN)."""
    rec = fp8.Recipe()
    zeros = jnp.zeros((2, 4, 8))
    w = jnp.ones((8, 3))
    assert np.all(np.asarray(fp8.einsum("bsd,df->bsf", zeros, w, rec)) == 0)
    x = jnp.array([1.0, -2.0, jnp.inf])
    s = fp8.scale_of(fp8.amax(x), jnp.float8_e4m3fn, 0)
    q = fp8.cast(x, s, jnp.float8_e4m3fn)
    assert float(s) == 1.0 and np.asarray(q.astype(jnp.float32)).tolist() == [1.0, -2.0, 448.0]
    big = jnp.full((2, 4, 8), 3e38)
    assert not np.any(np.isnan(np.asarray(fp8.einsum("bsd,df->bsf", big, w, rec))))
    # The margin: 2^margin of headroom below the largest value.
    assert float(fp8.scale_of(jnp.float32(448.0), jnp.float8_e4m3fn, 0)) == 1.0
    assert float(fp8.scale_of(jnp.float32(448.0), jnp.float8_e4m3fn, 2)) == 4.0


def test_first_and_last_layers_stay_bf16():
    """--first-last-layers-bf16: with both layers of the tiny model kept out of fp8 the step is
    the plain one; with none kept, the full fp8 step; with the first kept, neither."""
    plain_loss, plain = grads_for(ParallelConfig(), 4, single_device=True)
    fp8_loss, full = grads_for(ParallelConfig(), 4, single_device=True, model=HYBRID)
    kept = HYBRID + (("first_last_layers_bf16", True),)
    both_loss, both = grads_for(ParallelConfig(), 4, single_device=True, model=kept)
    none_loss, none = grads_for(ParallelConfig(), 4, single_device=True,
                                model=kept + (("num_layers_at_end_in_bf16", 0), ("num_layers_at_start_in_bf16", 0)))
    first_loss, first = grads_for(ParallelConfig(), 4, single_device=True,
                                  model=kept + (("num_layers_at_end_in_bf16", 0),))
    assert abs(both_loss - plain_loss) <= LOSS_ATOL and max(relative_errors(plain, both).values()) <= 1e-5
    assert abs(none_loss - fp8_loss) <= LOSS_ATOL and max(relative_errors(full, none).values()) <= 1e-5
    # Layer 0 kept, layer 1 in fp8: neither step (the gradients show it; the loss barely moves:
    # at init the last layer's fp8 rounding changes it by ~5e-7).
    assert abs(first_loss - fp8_loss) > 1e-5
    assert min(max(relative_errors(ref, first).values()) for ref in (plain, full)) > 0.01


# --------------------------------------------------------------------------- delayed scaling

DELAYED = (("fp8_format", "hybrid"), ("fp8_recipe", "delayed"), ("fp8_amax_history_len", 3),
           ("fp8_amax_compute_algo", "max"))
# Histories recorded by earlier steps (x, w and the gradient: above each tensor's amax here, so
# the delayed scales differ from the current ones and nothing saturates).
RECORDED = np.array([[8.0, 6.0, 0.0], [0.2, 0.1, 0.0], [2e-3, 1e-3, 0.0]], np.float32)


def delayed_grads(parallel, micro, single_device=False, history=RECORDED):
    """(loss, plain-order grads as numpy) at the seed-0 init with every amax history set to
    `history`."""
    from tests.parallel_util import build, fixed_batch, place

    pz = build(parallel, micro, jax.devices()[:1] if single_device else None, **dict(DELAYED))
    params = jax.tree_util.tree_map_with_path(
        lambda p, a: a * 0 + jnp.asarray(history) if fp8.is_history(p) else a, pz.init(0)["params"])
    loss, grads = pz.loss_and_grads(params, place(pz, fixed_batch()), jax.random.key(0))
    return float(loss), jax.tree.map(np.asarray, pz.plain(grads))


def split_records(grads):
    records = {jax.tree_util.keystr(p): g for p, g in jax.tree_util.tree_leaves_with_path(grads) if fp8.is_history(p)}
    return records, fp8.without_records(grads)


@pytest.mark.parametrize("name", ["dp2_tp4_sp", "pp2_tp2_dp2"])  # per-rank bodies: the reduce-once step's, the pipeline's
def test_a_delayed_step_matches_one_device(name):
    """The same histories give every layout the one device's scales: the loss and gradients as
    for tensorwise (same tolerances), and this step's amax records, a max over the ranks and
    microbatches (a sum would be off by the ranks x microbatches, 2x at least), within the same
    relative tolerance (a gradient's amax moves with the values before it)."""
    layout, ref_micro, reordered = LAYOUTS[name]
    ref_loss, ref = delayed_grads(ParallelConfig(), ref_micro, single_device=True)
    loss, got = delayed_grads(*layout)
    ref_records, ref_grads = split_records(ref)
    records, grads = split_records(got)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    errors = relative_errors(ref_grads, grads)
    assert max(errors.values()) <= (REORDERED_RTOL if reordered else SAME_ORDER_RTOL), errors
    for key, r in ref_records.items():
        assert np.all(r[..., 1:] == 0) and np.all(r[..., 0] > 0), key  # entry 0: this step's amaxes
        np.testing.assert_allclose(records[key], r, rtol=REORDERED_RTOL if reordered else SAME_ORDER_RTOL, err_msg=key)
    # The recorded histories are used: the step differs from one that records none yet.
    _, current = delayed_grads(ParallelConfig(), ref_micro, single_device=True, history=0 * RECORDED)
    assert max(relative_errors(split_records(current)[1], ref_grads).values()) > 1e-3


def test_delayed_histories_roll_and_scale_from_the_largest_or_latest():
    """The step writes each record into its history (newest first, the oldest dropped), not an
    optimizer update; `max` scales from the largest entry, `most_recent` from entry 0, and an
    empty history from the current amax."""
    rec = fp8.Recipe(history_max=True)
    h = jnp.asarray([3.0, 7.0, 0.0])
    assert float(fp8.from_history(h, jnp.float32(5.0), rec)) == 7.0
    assert float(fp8.from_history(h, jnp.float32(5.0), fp8.Recipe())) == 3.0
    assert float(fp8.from_history(jnp.zeros(3), jnp.float32(5.0), rec)) == 5.0
    params = {"layers": {"w": jnp.ones((2, 2)), f"{fp8.HISTORY}_qkv": jnp.asarray(RECORDED)}}
    grads = {"layers": {"w": jnp.ones((2, 2)), f"{fp8.HISTORY}_qkv": jnp.zeros((3, 3)).at[:, 0].set([9.0, 0.5, 4e-3])}}
    rolled = fp8.rolled(params, grads)["layers"]
    np.testing.assert_array_equal(rolled[f"{fp8.HISTORY}_qkv"],
                                  np.array([[9.0, 8.0, 6.0], [0.5, 0.2, 0.1], [4e-3, 2e-3, 1e-3]], np.float32))
    assert rolled["w"] is params["layers"]["w"]
    assert float(jnp.sum(fp8.without_records(grads)["layers"][f"{fp8.HISTORY}_qkv"])) == 0.0
    # An overflowed tensor records nothing (the next step scales by its current amax), and neither
    # does a step whose incoming gradient is all zero (a masked pipeline slot).
    got = fp8.record(jnp.asarray([jnp.inf, 0.5, 2e-3]), jnp.zeros((3, 2)), jnp.float32(2e-3))
    np.testing.assert_array_equal(got, np.array([[0, 0], [0.5, 0], [2e-3, 0]], np.float32))
    assert not np.any(np.asarray(fp8.record(jnp.ones(3), jnp.zeros((3, 2)), jnp.float32(0.0))))


def test_delayed_scaling_trains_and_resumes_bit_exactly(tmp_path):
    """Megatron's Llama-3 fp8 recipe on the tiny model (hybrid, delayed, history 4, max): 6
    iterations straight against 3, a checkpoint, and 3 resumed: losses and every parameter
    (the amax histories among them) bitwise; the histories hold the steps' records."""
    from mlm_jax import checkpoint as ckpt
    from tests.tiny_flags import NO_DROPOUT, tiny, train_run

    argv = tiny("--micro-batch-size", "2", "--global-batch-size", "16", *NO_DROPOUT, "--eval-iters", "0", "--bf16",
                "--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max",
                "--log-interval", "1")

    def losses(records):
        return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}

    _, straight, _ = train_run(argv + ["--train-iters", "6", "--save", str(tmp_path / "S"), "--save-interval", "3"],
                               tmp_path / "straight")
    _, resumed, _ = train_run(argv + ["--train-iters", "6", "--load", str(tmp_path / "S"), "--ckpt-step", "3",
                                      "--save", str(tmp_path / "R")], tmp_path / "resumed")
    a, b = losses(straight), losses(resumed)
    assert sorted(b) == [4, 5, 6] and all(a[i] == b[i] for i in b), (a, b)
    pa = ckpt.restore_host_params(ckpt.find_checkpoint(str(tmp_path / "S"), step=6))
    pb = ckpt.restore_host_params(ckpt.find_checkpoint(str(tmp_path / "R"), step=6))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    histories = [x for p, x in jax.tree_util.tree_leaves_with_path(pa) if fp8.is_history(p)]
    assert len(histories) == 4  # QKV, attention output, fc1, fc2 (stacked over the layers)
    assert all(x.shape == (2, 3, 4) and np.all(x > 0) for x in histories)  # 6 steps fill 4 entries


def test_checkpoints_move_between_recipes_and_history_lengths(tmp_path):
    """A bf16 checkpoint continues under delayed fp8 (histories start empty: the first step scales
    by the current amaxes), a delayed one continues in bf16 (its histories dropped) or with a
    shorter history (the newest entries kept) on another layout (dp8 -> dp4 x tp2)."""
    from mlm_jax import checkpoint as ckpt
    from tests.tiny_flags import NO_DROPOUT, tiny, train_run

    base = tiny("--micro-batch-size", "2", "--global-batch-size", "16", *NO_DROPOUT, "--eval-iters", "0", "--bf16")
    delayed = ["--fp8-format", "hybrid", "--fp8-amax-history-len"]

    def histories(folder, step):
        params = ckpt.restore_host_params(ckpt.find_checkpoint(str(tmp_path / folder), step=step))
        return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params) if fp8.is_history(p)}

    train_run(base + ["--train-iters", "2", "--save", str(tmp_path / "S")], tmp_path / "s")
    train_run(base + delayed + ["4", "--train-iters", "4", "--load", str(tmp_path / "S"), "--save", str(tmp_path / "F")],
              tmp_path / "f")
    f = histories("F", 4)
    assert len(f) == 4 and all(np.all(h[..., :2] > 0) and np.all(h[..., 2:] == 0) for h in f.values())
    _, records, _ = train_run(base + ["--train-iters", "5", "--load", str(tmp_path / "F")], tmp_path / "b")
    assert np.isfinite([r["lm_loss"] for r in records if "lm_loss" in r]).all()
    train_run(base + delayed + ["2", "--train-iters", "5", "--load", str(tmp_path / "F"), "--save", str(tmp_path / "G"),
                                "--tensor-model-parallel-size", "2"], tmp_path / "g")  # onto another layout too
    g = histories("G", 5)
    for key, h in g.items():
        assert h.shape[-1] == 2 and np.all(h > 0)
        np.testing.assert_array_equal(h[..., 1], f[key][..., 0], err_msg=key)  # F's newest, one step older


def test_fp8_param_gather_sends_e4m3_and_changes_no_product():
    """--fp8-param-gather (ZeRO dp4 x tp2): the step's parameter all-gathers carry the projections'
    weights in e4m3 (XLA:CPU has no fp8 collectives and widens them to f16; a GPU sends e4m3: the
    GPU tier), and under tensorwise scaling the products see the same e4m3 weights as without it
    (the gathered values widen and round back to themselves): loss within 2e-6, every gradient
    within 1e-5 of its largest magnitude."""
    from tests.parallel_util import build, fixed_batch, place

    layout = (ParallelConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True), 2)
    ref_loss, ref = grads_for(*layout, model=HYBRID)
    loss, got = grads_for(*layout, model=HYBRID + (("fp8_param_gather", True),))
    assert abs(loss - ref_loss) <= LOSS_ATOL
    errors = relative_errors(ref, got)
    assert max(errors.values()) <= SAME_ORDER_RTOL, errors
    def gathers(model):  # dtype -> the shapes the step's all-gathers produce
        pz = build(*layout, **dict(model))
        state = pz.init(0)
        hlo = pz.loss_and_grads.lower(state["params"], place(pz, fixed_batch()), jax.random.key(0)).compile().as_text()
        out = {}
        for dtype, shape in re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", hlo):
            out.setdefault(dtype, set()).add(shape)
        return out

    plain, fp8_gather = gathers(HYBRID), gathers(HYBRID + (("fp8_param_gather", True),))
    assert set(plain) == {"f32"}  # fp32 compute: ZeRO gathers the fp32 weights
    assert fp8_gather["f16"] and fp8_gather["f16"] <= plain["f32"], (plain, fp8_gather)
    assert not fp8_gather["f16"] & fp8_gather["f32"], (plain, fp8_gather)
    assert len(fp8_gather["f16"]) == 4  # QKV, attention output, fc1, fc2
    # A MoE model's experts are no projection: their weights keep the compute dtype.
    of = fp8.weight_dims(ModelConfig(num_experts=4, moe_shared_expert_intermediate_size=32))
    key = jax.tree_util.DictKey
    assert of((key("layers"), key("mlp"), key("w1"))) is None
    assert of((key("layers"), key("mlp"), key("shared"), key("w1"))) == 2
    assert of((key("layers"), key("attention"), key("wqkv"))) == 4
    dense_first = fp8.weight_dims(ModelConfig(num_layers=2, num_experts=4, moe_layer_freq=(0, 1)))
    assert dense_first((key("layers"), key("mlp"), key("w1"))) == 2
    assert dense_first((key("moe_layers"), key("mlp"), key("w1"))) is None
