"""Every parallel layout computes the single-device model's loss and gradients (fp32).

Tolerances, stated once: loss within 2e-6 absolute (the loss is ~6.2, so ~3e-7 relative);
each gradient leaf within 2e-6 of the leaf's largest reference magnitude (max-abs relative),
plus 1e-10 absolute for leaves whose gradient is analytically zero (the key bias: softmax is
invariant to it, so both sides hold ~1e-11 noise). Measured worst: 8e-7 relative, loss 1e-6.
Both are a few fp32 roundings of a sum reordered across devices; a wrong collective, a missing
shard or a double-counted microbatch is off by orders of magnitude more.
"""

import jax
import numpy as np
import pytest

from mlm_jax.config import ParallelConfig
from tests.parallel_util import VOCAB, grads_for, train_for, unpad

LOSS_ATOL = 2e-6
GRAD_RTOL = 2e-6
GRAD_ATOL = 1e-10

REFERENCE = (ParallelConfig(), 4)  # one device, micro batch 4: four accumulated microbatches

LAYOUTS = {
    "dp8": (ParallelConfig(), 1),
    "tp8": (ParallelConfig(tensor_model_parallel_size=8), 2),
    "dp2_tp4": (ParallelConfig(tensor_model_parallel_size=4), 2),
    "dp2_tp4_sp": (ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True), 2),
    "zero1_dp4_tp2": (ParallelConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True), 2),
}


def assert_matches_one_device(ref: tuple, got: tuple) -> None:
    """(loss, grads) of a layout against one device's: the loss within LOSS_ATOL, the vocab
    padding rows' gradient zero, every gradient leaf within GRAD_RTOL (padding cut off)."""
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert not np.any(grads["embed"][VOCAB:])
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)


def assert_trees_close(ref: dict, got: dict, rtol: float, atol: float = GRAD_ATOL) -> None:
    ref_leaves = jax.tree_util.tree_leaves_with_path(ref)
    got_leaves = jax.tree.leaves(got)
    assert len(ref_leaves) == len(got_leaves)
    for (path, r), g in zip(ref_leaves, got_leaves):
        assert r.shape == g.shape, path
        scale = float(np.max(np.abs(r)))
        err = float(np.max(np.abs(r - g)))
        assert err <= rtol * scale + atol, (
            f"{jax.tree_util.keystr(path)}: max-abs error {err:.3g} > {rtol} x {scale:.3g} + {atol}"
        )


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_match_single_device(name):
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True)
    loss, grads = grads_for(*LAYOUTS[name])
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    # Padding rows of the vocab never receive gradient (their logits are masked).
    assert not np.any(grads["embed"][VOCAB:])
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)


def test_llama_style_model_matches_single_device():
    """GQA (8 heads in 4 groups), rotary, RMSNorm, SwiGLU, untied, no biases on dp=2 x tp=4 SP."""
    llama = (("num_query_groups", 4), ("position_embedding_type", "rope"), ("normalization", "RMSNorm"),
             ("swiglu", True), ("untie_embeddings_and_output_weights", True), ("add_bias_linear", False))
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True, model=llama)
    loss, grads = grads_for(ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True), 2,
                            model=llama)
    assert "lm_head" in grads and "bqkv" not in grads["layers"]["attention"]
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)


def test_dropout_masks_do_not_depend_on_the_data_parallel_split():
    """With dropout on, dp4 x tp2 (each data-parallel rank runs its own rows and the gradients
    are reduced once per step) draws the masks one device draws: the same microbatch split (4
    microbatches of 4 rows) gives the same loss and gradients at the stated tolerances."""
    dropout = (("hidden_dropout", 0.1), ("attention_dropout", 0.1))
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True, model=dropout)
    no_dropout_loss, _ = grads_for(*REFERENCE, single_device=True)
    assert abs(ref_loss - no_dropout_loss) > 1e-4, "dropout must really be on"
    loss, grads = grads_for(ParallelConfig(tensor_model_parallel_size=2), 1, model=dropout)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)


# After five AdamW steps. Adam divides by sqrt(v) + eps, so where a gradient entry is near zero
# (the key-bias part of bqkv is analytically zero; rare embedding rows are tiny) fp32 rounding
# noise becomes a visible step. The floor, measured: the *same single device* with the global
# batch split into 2 instead of 4 microbatches ends 2.7e-5 away after five steps. Parameters are
# therefore compared within 1e-4 absolute (a tenth of one lr=1e-3 step); a wrong gradient moves a
# parameter by whole steps. Losses within 1e-5. (Adam is blind to a gradient's scale, which is
# why the gradient test above, not this one, is the sharp check.)
PARAM_ATOL = 1e-4
# An entry whose first gradient is zero within the gradient tests' own tolerance (GRAD_RTOL of
# its leaf's largest: rounding noise, e.g. embed[382, 0] at 2.6e-9 against a row median of
# 2.6e-3, a cancellation) sits in Adam's eps regime: its step is lr * g / (|g| + 1e-8), so
# rounding alone moves it by a sizeable fraction of lr (measured: 1.07e-4 after the attention's
# einsums changed shape, that gradient 2.6e-9 on one device and 4.5e-9 on dp2 x tp4). Those few
# entries are held to Adam's own bound instead, at most 2 * lr per step away (lr = 1e-3 in
# `tiny_config`); every other entry to PARAM_ATOL.
NOISE_GRAD = GRAD_RTOL
ADAM_BOUND = 5 * 2 * 1e-3


def _noise_entries(ref_grads: dict) -> dict:
    """Entries with a nonzero gradient within NOISE_GRAD of their leaf's largest (an exact zero is
    no noise: Adam leaves it unmoved everywhere)."""
    return jax.tree.map(lambda g: (g != 0) & (np.abs(g) < NOISE_GRAD * np.max(np.abs(g))), ref_grads)


@pytest.mark.parametrize("name", ["dp2_tp4_sp", "zero1_dp4_tp2"])
def test_five_optimizer_steps_give_the_same_parameters(name):
    ref_losses, ref_params = train_for(*REFERENCE, single_device=True)
    losses, params = train_for(*LAYOUTS[name])
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
    assert ref_losses[-1] < ref_losses[0]
    noise = unpad(_noise_entries(grads_for(*REFERENCE, single_device=True)[1]))
    ref, got = unpad(ref_params), unpad(params)
    # 136 of 134,144 here: the analytically-zero key bias (128) and 8 cancellations.
    assert sum(int(n.sum()) for n in jax.tree.leaves(noise)) <= 2e-3 * sum(n.size for n in jax.tree.leaves(noise))
    assert all(np.all(np.abs(r - g)[n] <= ADAM_BOUND) for r, g, n in
               zip(jax.tree.leaves(ref), jax.tree.leaves(got), jax.tree.leaves(noise)))
    assert_trees_close(ref, jax.tree.map(lambda r, g, n: np.where(n, r, g), ref, got, noise),
                       rtol=0.0, atol=PARAM_ATOL)


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(pipeline_model_parallel_size=2)],
                         ids=["dp8", "dp4_pp2"])
def test_the_fused_loss_in_row_chunks_matches_single_device_inside_per_rank_steps(monkeypatch, parallel):
    """Past a logits budget the fused loss runs its rows in chunks (on a CPU from 2^21 logits,
    elsewhere 2^27: a GPT-2 micro batch of 4 x 2048 tokens already), a scan whose sums vary per
    rank inside the per-rank data-parallel and pipeline bodies. Forced to 4 chunks of 8 rows,
    loss and every gradient equal the single-device reference (tolerances above)."""
    from mlm_jax.models import gpt
    from tests.parallel_util import build, fixed_batch, place

    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True)
    monkeypatch.setattr(gpt, "_MIN_CHUNK_ROWS", 8)
    monkeypatch.setattr(gpt, "_CHUNK_LOGITS", {"cpu": 1})  # as many chunks as rows allow: 32 / 8
    assert gpt._row_chunks(1, 32, VOCAB) == 4
    pz = build(parallel, 1)
    loss, grads = pz.loss_and_grads(pz.init(0)["params"], place(pz, fixed_batch()), jax.random.key(0))
    assert abs(float(loss) - ref_loss) <= LOSS_ATOL, (float(loss), ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(jax.tree.map(np.asarray, pz.plain(grads))), GRAD_RTOL)
