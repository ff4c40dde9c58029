"""Sharded data parallelism (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads /
optim_grads_params; mlm_jax/parallel/fsdp.py): the loss and every gradient of one device under
each layout, the layers gathered and reduce-scattered one layer at a time in the compiled
program, exact resume and restore across strategies, and the flags' rules.

Tolerances as tests/test_parallel.py's (stated there): loss within 2e-6 absolute, each gradient
leaf within 2e-6 of the leaf's largest reference magnitude plus 1e-10 absolute.
"""

import dataclasses

import jax
import numpy as np
import pytest

from mlm_jax import checkpoint as ckpt
from mlm_jax.arguments import parse_args
from mlm_jax.build import parallelize
from mlm_jax.config import ConfigError, ParallelConfig
from mlm_jax.plan import gpu_hlo
from mlm_jax.sharding.mesh import make_mesh
from mlm_jax.sharding.specs import entry_axes
from mlm_jax.validation import finalize
from tests.parallel_util import build, fixed_batch, grads_for, layer_loop, place
from tests.test_moe import MOE, REFERENCE as MOE_REFERENCE
from tests.test_parallel import REFERENCE, assert_matches_one_device
from tests.tiny_flags import tiny, train_run

ZERO3 = ParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True)  # optim_grads_params
ZERO2 = dataclasses.replace(ZERO3, data_parallel_sharding_strategy="optim_grads")
FULL_RECOMPUTE = (("recompute_granularity", "full"), ("recompute_method", "uniform"), ("recompute_num_layers", 1))


def both(name, parallel, micro, model=(), reference=REFERENCE):
    """The layout under each strategy: name -> (parallel, micro batch, model, reference)."""
    return {f"{name}_{tag}": (dataclasses.replace(parallel, use_megatron_fsdp=True, use_distributed_optimizer=True,
                                                  data_parallel_sharding_strategy=s), micro, model, reference)
            for tag, s in (("zero2", "optim_grads"), ("zero3", "optim_grads_params"))}


LAYOUTS = {
    **both("dp8", ParallelConfig(), 1),
    **both("dp4_tp2_sp", ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 2),
    **both("dp2_cp2_tp2", ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2), 2),
    **both("dp8_full_recompute", ParallelConfig(), 1, FULL_RECOMPUTE),
    **both("dp8_dots_recompute_one_microbatch", ParallelConfig(), 2, (("recompute_granularity", "dots"),)),
    # MoE: the experts split over `expert`, each expert's shard over its own data ranks
    **both("ep2_dp4_moe", ParallelConfig(expert_model_parallel_size=2), 1, MOE, MOE_REFERENCE),
    # a mixed dense/MoE stack: each layer's weights gathered in its run's scan (models/gpt.py _run_mixed)
    **both("dp8_mixed_moe", ParallelConfig(), 1, MOE + (("num_layers", 3), ("moe_layer_freq", (0, 1, 1))),
           MOE_REFERENCE),
}


# Hybrid sharding (--num-distributed-optimizer-instances 2): the state split within each of two
# instances of the data ranks, copied across them.
HYBRID = dict(num_distributed_optimizer_instances=2)
LAYOUTS.update({
    "dp8_zero1_instances2": (ParallelConfig(use_distributed_optimizer=True, **HYBRID), 1, (), REFERENCE),
    "dp8_zero3_instances2": (dataclasses.replace(ZERO3, **HYBRID), 1, (), REFERENCE),
    "dp4_tp2_sp_zero2_instances2": (dataclasses.replace(ZERO2, tensor_model_parallel_size=2, sequence_parallel=True,
                                                        **HYBRID), 2, (), REFERENCE),
    "ep2_dp4_moe_zero3_instances2": (dataclasses.replace(ZERO3, expert_model_parallel_size=2, **HYBRID), 1, MOE,
                                     MOE_REFERENCE),
})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_match_single_device(name):
    parallel, micro, model, reference = LAYOUTS[name]
    assert_matches_one_device(grads_for(*reference, single_device=True, model=model), grads_for(parallel, micro, model=model))


def test_the_layers_are_stored_split_over_data_one_layer_at_a_time():
    """Every stacked layer matrix of the 64-wide model is split over `data` past its layers dim
    (the layers dim whole), on a dim no other axis splits (a vector whose one dim is split over
    tensor, as the MLP's bias, stays whole over data); the optimizer moments follow."""
    pz = build(LAYOUTS["dp4_tp2_sp_zero3"][0], 2)
    shapes, specs = jax.tree.leaves(pz.shapes["layers"]), jax.tree.leaves(
        pz.param_sharding["layers"], is_leaf=lambda s: hasattr(s, "spec"))
    for shape, sharding in zip(shapes, specs):
        spec = sharding.spec
        assert not spec or "data" not in entry_axes(spec[0]), spec
        data_dims = [e for e in spec if "data" in entry_axes(e)]
        assert data_dims == (["data"] if len(shape.shape) >= 3 else data_dims) and len(data_dims) <= 1, spec
    assert sum(["data"] == [e for e in s.spec if e] for s in specs) >= 6  # qkv, out, fc1, fc2, norms
    mu = pz.opt_sharding[0].mu["layers"] if hasattr(pz.opt_sharding[0], "mu") else None
    if mu is not None:
        assert [s.spec for s in jax.tree.leaves(mu, is_leaf=lambda s: hasattr(s, "spec"))] == [s.spec for s in specs]


def test_hybrid_sharding_splits_the_state_within_an_instance():
    """--num-distributed-optimizer-instances 2 on 8 ranks: the mesh's `replica` axis of 2 outside
    `data` of 4; the parameters and optimizer state split over `data` alone (each instance a copy),
    the batch rows over both."""
    pz = build(LAYOUTS["dp8_zero3_instances2"][0], 1)
    assert dict(pz.mesh.shape)["replica"] == 2 and dict(pz.mesh.shape)["data"] == 4
    specs = [s.spec for s in jax.tree.leaves((pz.param_sharding, pz.opt_sharding), is_leaf=lambda s: hasattr(s, "spec"))]
    assert not [sp for sp in specs if any("replica" in entry_axes(e) for e in sp)], specs
    assert sum(any("data" in entry_axes(e) for e in sp) for sp in specs) >= len(specs) // 2
    assert entry_axes(pz.batch_sharding().spec[1])[:2] == ("replica", "data"), pz.batch_sharding().spec


def _data_collectives(name, num_layers=4):
    parallel, micro, model, _ = LAYOUTS[name]
    pz = build(parallel, micro, fresh=True, **dict(model), num_layers=num_layers)
    params = pz.init(0)["params"]
    with layer_loop():  # as a GPU compiles it: the layers in a loop
        text = pz.loss_and_grads.lower(params, place(pz, fixed_batch()), jax.random.key(0)).compile().as_text()
    program = gpu_hlo.read(text, dict(pz.mesh.shape))
    layers = sum(x.nbytes for x in jax.tree.leaves(params["layers"]))
    rest = sum(x.nbytes for x in jax.tree.leaves(params)) - layers
    return [c for c in program.collectives if "data" in c.axes], layers, rest


@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
def test_each_layer_is_gathered_and_reduce_scattered_inside_the_layer_loop(strategy):
    """In the compiled step (4 layers, 2 microbatches a rank): the layers' weights all-gathered
    and their gradients reduce-scattered inside the layer loop, in the forward and (optim_grads_params)
    again in the backward; no collective outside it moves a layer stack's bytes; no layer gradient
    all-reduced whole."""
    collectives, layers, rest = _data_collectives(f"dp8_{strategy}")
    assert layers > 4 * rest  # a stack gathered outside the loop would show
    in_loop = [c for c in collectives if c.in_loop and "while/body" in c.op_name.split("shard_map")[-1]]
    forward = [c for c in in_loop if c.kind == "all-gather" and "transpose" not in c.op_name]
    backward = [c for c in in_loop if c.kind == "all-gather" and "transpose" in c.op_name]
    scattered = [c for c in in_loop if c.kind == "reduce-scatter"]
    assert len(forward) >= 4 and len(scattered) >= 4, collectives  # wqkv, wo, w1, w2 at least
    assert len(backward) >= 4 if strategy == "zero3" else not backward, collectives
    assert all(c.runs == 8 for c in forward + scattered), collectives  # 4 layers x 2 microbatches
    # Outside the loop: the embedding's (and final norm's) gather and gradient reduction only.
    outside = [c for c in collectives if not c.in_loop]
    assert sum(c.bytes for c in outside) <= 2 * rest + 64, (outside, rest)  # (+ the loss)
    # All-reduced whole in the loop: only a vector no dim of which splits (the MLP's bias, 1 KiB).
    assert not [c for c in in_loop if c.kind == "all-reduce" and c.bytes > 1024], in_loop


# --------------------------------------------------------------------------- runs and checkpoints

TINY = tiny("--global-batch-size", "16", "--eval-iters", "1", "--eval-interval", "1000", "--log-interval", "1",
            "--lr", "1e-3", "--hidden-dropout", "0.1", "--micro-batch-size", "1", "--tensor-model-parallel-size",
            "2")  # dp4 x tp2, 4 microbatches a rank
FSDP = ["--use-megatron-fsdp"]


def _run(tmp, name, extra, iters=4):
    summary, records, log = train_run(TINY + ["--train-iters", str(iters)] + extra, tmp / name)
    return summary, {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}, log


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def straight(tmp):
    """4 iterations under optim_grads_params, saving at 2 and 4."""
    return _run(tmp, "straight", FSDP + ["--save", str(tmp / "S"), "--save-interval", "2"])


def test_the_curve_is_zero1s_and_a_resume_is_bit_exact(straight, tmp):
    _, losses, log = straight
    _, zero1, _ = _run(tmp, "zero1", ["--use-distributed-optimizer"])
    assert max(abs(losses[i] - zero1[i]) for i in range(1, 5)) < 2e-5, (losses, zero1)
    _, resumed, log = _run(tmp, "resumed", FSDP + ["--load", str(tmp / "S"), "--ckpt-step", "2"])
    assert "saved on [data=4 x tensor=2, FSDP optim_grads_params], restored onto [data=4 x tensor=2, FSDP " \
           "optim_grads_params]" in log, log
    assert [resumed[i] for i in (3, 4)] == [losses[i] for i in (3, 4)]  # bit for bit


@pytest.mark.parametrize("layout", [
    ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--tensor-model-parallel-size", "1"],
    ["--use-distributed-optimizer", "--tensor-model-parallel-size", "4", "--micro-batch-size", "2"],
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
], ids=["zero2_dp8", "zero1_tp4", "pp2_tp2"])
def test_restore_across_strategies_is_exact(straight, tmp, layout):
    """The optim_grads_params checkpoint restored onto another strategy and layout: every
    parameter and optimizer-state value equals the saved one."""
    found = ckpt.find_checkpoint(str(tmp / "S"))
    quiet = lambda *_: None  # noqa: E731
    cfg_a = finalize(parse_args(TINY + FSDP + ["--train-iters", "4"]), jax.device_count())
    cfg = finalize(parse_args(TINY + layout + ["--train-iters", "4"]), jax.device_count())
    pz_a, pz = (parallelize(c, make_mesh(c.parallel)) for c in (cfg_a, cfg))
    a, _ = ckpt.restore_train_state(cfg_a, pz_a, found, log=quiet)
    b, _ = ckpt.restore_train_state(cfg, pz, found, log=quiet)
    for x, y in zip(jax.tree.leaves(pz_a.plain(a["params"])), jax.tree.leaves(pz.plain(b["params"]))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(pz_a.plain(a["opt_state"])), jax.tree.leaves(pz.plain(b["opt_state"]))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --------------------------------------------------------------------------- flags

def test_megatron_fsdp_flags_map_onto_the_strategy():
    def strategy(*argv):
        p = parse_args(list(argv)).parallel
        return p.sharding_strategy, p.use_distributed_optimizer

    assert strategy() == ("no_shard", False)
    assert strategy("--use-distributed-optimizer") == ("optim", True)
    assert strategy("--use-megatron-fsdp") == ("optim_grads_params", True)  # Megatron's default
    assert strategy("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads") == ("optim_grads", True)
    assert strategy("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim") == ("optim", True)
    assert strategy("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard") == ("no_shard", False)
    assert strategy("--use-torch-fsdp2") == ("optim_grads_params", True)
    assert strategy("--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward") == ("optim_grads", True)
    assert strategy("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--num-distributed-optimizer-instances",
                    "1", "--outer-dp-sharding-strategy", "no_shard") == ("optim_grads_params", True)


@pytest.mark.parametrize("argv,message", [
    (["--data-parallel-sharding-strategy", "optim_grads"], "--data-parallel-sharding-strategy optim_grads needs "
                                                           "--use-megatron-fsdp"),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "zero3"],
     "--data-parallel-sharding-strategy 'zero3': choose one of no_shard, optim, optim_grads, optim_grads_params"),
    (["--num-distributed-optimizer-instances", "2"],
     "--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer (or --use-megatron-fsdp)"),
    (["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "0"],
     "--num-distributed-optimizer-instances must be 1 or more, got 0"),
    (["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "optim"],
     "--outer-dp-sharding-strategy optim needs --num-distributed-optimizer-instances > 1"),
    (["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2", "--outer-dp-sharding-strategy", "optim"],
     "--outer-dp-sharding-strategy optim: not built"),
    (["--use-megatron-fsdp", "--outer-dp-sharding-strategy", "full"],
     "--outer-dp-sharding-strategy 'full': choose one of no_shard, optim"),
    (["--torch-fsdp2-no-reshard-after-forward"], "--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2"),
])
def test_bad_fsdp_flags_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError, match=None) as e:
        parse_args(argv)
    assert message in str(e.value), str(e.value)


@pytest.mark.parametrize("argv,message", [
    (["--pipeline-model-parallel-size", "2"], "with --pipeline-model-parallel-size 2: not built"),
    (["--fp8-format", "hybrid", "--bf16", "--fp8-param-gather"], "with --fp8-param-gather: not built"),
])
def test_what_fsdp_does_not_compose_with_is_refused(argv, message):
    with pytest.raises(ConfigError) as e:
        finalize(parse_args(TINY + FSDP + ["--tensor-model-parallel-size", "1"] + argv), jax.device_count())
    assert "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params " + message in str(e.value)


@pytest.mark.parametrize("argv,message", [
    (["--num-distributed-optimizer-instances", "3"],
     "--num-distributed-optimizer-instances 3 does not divide the data-parallel size 4"),
    (["--num-distributed-optimizer-instances", "2", "--pipeline-model-parallel-size", "2",
      "--use-distributed-optimizer"], "--num-distributed-optimizer-instances 2 with --pipeline-model-parallel-size 2: "
                                      "not built"),
])
def test_what_hybrid_sharding_cannot_do_is_refused(argv, message):
    with pytest.raises(ConfigError) as e:
        finalize(parse_args(TINY + ["--use-distributed-optimizer"] + argv), jax.device_count())
    assert message in str(e.value), str(e.value)


def test_a_hybrid_run_saves_what_any_layout_restores(tmp, straight):
    """A run with 2 instances resumes the optim_grads_params checkpoint (the format is the global
    arrays), names the layouts, and trains on as the checkpoint's own layout does."""
    _, losses, _ = straight
    _, resumed, log = _run(tmp, "hybrid", FSDP + ["--num-distributed-optimizer-instances", "2", "--load",
                                                  str(tmp / "S"), "--ckpt-step", "2"])
    assert "restored onto [replica=2 x data=2 x tensor=2, FSDP optim_grads_params]" in log, log
    assert max(abs(resumed[i] - losses[i]) for i in (3, 4)) < 2e-5, (resumed, losses)


def test_recompute_modules_under_optim_grads_params_recompute_each_layer_whole():
    """Under optim_grads_params the layer is one checkpoint (its weights gathered again in the
    backward) and jax applies the outermost checkpoint's policy to every value inside it: the
    --recompute-modules' checkpoints kept all they should recompute, as much as without them
    (2,010,192 bytes of temporaries against 2,010,184). Each layer is recomputed whole instead:
    the compiled gradient step keeps no more than --recompute-granularity full's, and the run's
    note says so."""
    from mlm_jax.parallel.fsdp import recompute_modules_note
    from tests.parallel_util import tiny_config

    def temporaries(model):
        with layer_loop():
            pz = build(ZERO3, 1, fresh=True, num_layers=4, ffn_hidden_size=512, **model)
            args = (pz.init(0)["params"], place(pz, fixed_batch()), jax.random.key(0))
            return pz.loss_and_grads.lower(*args).compile().memory_analysis().temp_size_in_bytes

    modules = dict(recompute_granularity="selective", recompute_modules=("mlp", "layernorm"))
    none, full, named = temporaries({}), temporaries(dict(FULL_RECOMPUTE)), temporaries(modules)
    # (jax 0.10: named = full within 64 bytes; jax 0.12: named 4% below full, the modules'
    # checkpoints inside the layer's giving XLA a slightly different program)
    assert full < 0.7 * none and named <= 1.01 * full, (none, full, named)
    note = recompute_modules_note(finalize(tiny_config(ZERO3, 1, **modules), 8))
    assert note.startswith("mlp layernorm under --data-parallel-sharding-strategy optim_grads_params: each layer "
                           "is recomputed whole"), note
    assert recompute_modules_note(finalize(tiny_config(ZERO2, 1, **modules), 8)) is None


def test_torch_fsdp2_runs_as_megatron_fsdp_and_says_so(tmp):
    _, losses, log = _run(tmp, "torch_fsdp2", ["--use-torch-fsdp2", "--torch-fsdp2-no-reshard-after-forward"], iters=1)
    assert "> --use-torch-fsdp2: runs as --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads" in log, log
    assert sorted(losses) == [1]


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "mlm_jax.train", "--use-megatron-fsdp",
                        "--outer-dp-sharding-strategy", "optim", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r
    assert "--outer-dp-sharding-strategy optim needs --num-distributed-optimizer-instances > 1" in r.stderr
    assert "Traceback" not in r.stderr
