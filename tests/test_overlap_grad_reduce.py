"""--overlap-grad-reduce: the data-parallel gradients reduced inside the last microbatch's
backward, layer by layer (mlm_jax/parallel/data.py `ReduceInBackward`), compute the single-device
model's loss and gradients, and the program shows the reduction where it says.

Tolerances as tests/test_parallel.py's (stated there): loss within 2e-6 absolute, each gradient
leaf within 2e-6 of the leaf's largest reference magnitude plus 1e-10 absolute.
"""

import dataclasses

import jax
import numpy as np
import pytest

from mlm_jax.config import ParallelConfig
from mlm_jax.parallel.data import overlap_grad_reduce_note, overlaps_grad_reduce
from mlm_jax.plan import gpu_hlo
from mlm_jax.sharding.mesh import make_mesh
from mlm_jax.sharding.specs import entry_axes
from mlm_jax.validation import finalize
from tests.parallel_util import build, fixed_batch, grads_for, layer_loop, place, tiny_config, unpad
from tests.test_parallel import GRAD_RTOL, LOSS_ATOL, REFERENCE, assert_trees_close

OVERLAP = ParallelConfig(overlap_grad_reduce=True)
FOUR_LAYERS = (("num_layers", 4),)  # the layers dim divides dp 4: ZeRO would split it (see below)

# name -> (parallel, micro batch, model); a global batch of 16: 2 or 4 microbatches per rank
LAYOUTS = {
    "dp8": (OVERLAP, 1, ()),
    "dp4_tp2_sp_zero": (dataclasses.replace(OVERLAP, tensor_model_parallel_size=2, sequence_parallel=True,
                                            use_distributed_optimizer=True), 2, ()),
    "dp4_tp2_zero_four_layers": (dataclasses.replace(OVERLAP, tensor_model_parallel_size=2,
                                                     use_distributed_optimizer=True), 1, FOUR_LAYERS),
    "dp8_full_recompute": (OVERLAP, 1, (("recompute_granularity", "full"), ("recompute_method", "uniform"),
                                        ("recompute_num_layers", 1))),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_match_single_device(name):
    parallel, micro, model = LAYOUTS[name]
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True, model=tuple(m for m in model if m in FOUR_LAYERS))
    loss, grads = grads_for(parallel, micro, model=model)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)


def test_zero_keeps_the_layers_dim_whole_so_each_layer_reduce_scatters_alone():
    """ZeRO splits the first evenly divisible dim over data: with 4 layers and dp 4 that is the
    stacked layers dim, unless the gradients are reduced layer by layer."""
    def stacked_specs(parallel):
        pz = build(parallel, 1, **dict(FOUR_LAYERS))
        return [s.spec for s in jax.tree.leaves(pz.param_sharding["layers"])]

    plain = dataclasses.replace(LAYOUTS["dp4_tp2_zero_four_layers"][0], overlap_grad_reduce=False)
    assert any("data" in entry_axes(spec[0]) for spec in stacked_specs(plain))
    overlapped = stacked_specs(LAYOUTS["dp4_tp2_zero_four_layers"][0])
    assert not any(spec and "data" in entry_axes(spec[0]) for spec in overlapped), overlapped
    assert any("data" in entry_axes(e) for spec in overlapped for e in spec)  # still ZeRO


def _data_reductions(name):
    parallel, micro, model = LAYOUTS[name]
    pz = build(parallel, micro, fresh=True, **dict(model))
    params = pz.init(0)["params"]
    with layer_loop():  # as a GPU compiles it: the reductions inside the layer loop
        text = pz.loss_and_grads.lower(params, place(pz, fixed_batch()), jax.random.key(0)).compile().as_text()
    program = gpu_hlo.read(text, dict(pz.mesh.shape))
    return [c for c in program.collectives if "data" in c.axes and c.kind in ("all-reduce", "reduce-scatter")
            and c.bytes >= 1024]


def test_each_layer_is_reduced_inside_the_last_microbatchs_backward():
    """In the compiled step: the layers' gradients reduce-scattered inside the layer loop, in the
    last microbatch's branch (4 layers: once per layer); nothing reduced per microbatch (in a loop
    outside that branch); the stacked [layers, ...] gradients never reduced whole."""
    reductions = _data_reductions("dp4_tp2_zero_four_layers")
    in_layers = [c for c in reductions if c.in_loop and c.in_branch and "while/body" in c.op_name.split("cond")[-1]]
    assert in_layers and all(c.kind == "reduce-scatter" for c in in_layers), reductions
    assert not [c for c in reductions if c.in_loop and not c.in_branch], reductions
    # Per layer: the reduce-scatters inside the layer loop move one layer's gradients (fp32), not
    # the stack's: a quarter of the stacked layers' bytes at most.
    pz = build(*LAYOUTS["dp4_tp2_zero_four_layers"][:2], **dict(FOUR_LAYERS))
    stacked = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(pz.shapes["layers"]))
    tp = dict(pz.mesh.shape)["tensor"]
    assert max(c.bytes for c in in_layers) <= stacked / 4 / tp * 1.01, (max(c.bytes for c in in_layers), stacked)


@pytest.mark.parametrize("parallel, model, applies", [
    (OVERLAP, {}, True),
    (dataclasses.replace(OVERLAP, use_distributed_optimizer=True, tensor_model_parallel_size=2), {}, True),
    (dataclasses.replace(OVERLAP, tensor_model_parallel_size=8), {}, False),  # no data parallelism
    (dataclasses.replace(OVERLAP, pipeline_model_parallel_size=2), {}, False),  # reduced after the schedule
    (dataclasses.replace(OVERLAP, expert_model_parallel_size=2), {"num_experts": 4}, False),
    (OVERLAP, {"num_experts": 4, "moe_layer_freq": (0, 1)}, False),  # mixed dense/MoE stacks
    (OVERLAP, {"num_experts": 4}, True),  # one MoE stack without expert parallelism
    (ParallelConfig(), {}, False),  # not asked
])
def test_where_it_applies_and_what_the_run_says_where_not(parallel, model, applies):
    cfg = finalize(tiny_config(parallel, 1, **model), 8)
    mesh = make_mesh(cfg.parallel)
    assert overlaps_grad_reduce(cfg, mesh) == applies
    note = overlap_grad_reduce_note(cfg, mesh)
    if applies or not parallel.overlap_grad_reduce:
        assert note is None
    elif cfg.parallel.tensor_model_parallel_size == 8:
        assert note.startswith("no effect: the data-parallel size is 1"), note
    else:
        assert note.startswith("the gradients are reduced once after the backward (") and "not inside it" in note
