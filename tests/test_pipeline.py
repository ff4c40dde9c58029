"""Pipeline parallelism computes the single-device model's loss and gradients (fp32).

The runtime (mlm_jax/pipeline/runtime.py) executes the two-slot lockstep schedules of
mlm_jax/pipeline/lockstep.py in one shard_map over `pipe`. Checked here:
  - pure Python: the compiled programs feed every slot exactly the tensor it needs (what arrived
    last tick, or its stash slot) and never overwrite a live stash slot, for every schedule over
    a sweep of sizes; the stash is flat in m for 1F1B; the layer layout round-trips; invalid
    configurations fail naming their numbers;
  - on the fake 8-device mesh: loss and every gradient leaf against one device, for pp=2 and
    pp=4 with each schedule, pp=2 x tp=2 x dp=2 with the distributed optimizer, with sequence
    parallelism (with dropout and full recompute; and with the distributed optimizer and
    interleaving), an uneven split of the Llama-style model (untied head); the evaluation
    program; a 10-step training curve against pp=1; the compiled temp memory of 1F1B flat in
    the number of microbatches while GPipe's grows by one stashed activation per microbatch;
    no collective-permute but the pipeline's own; and no data-parallel collective inside the
    ticks (gradients reduced once per step).

Tolerances are those of tests/test_parallel.py and for the same reason: loss within 2e-6
absolute, each gradient leaf within 2e-6 of the leaf's largest reference magnitude (plus 1e-10
absolute for the analytically-zero key bias). Measured worst: 8.5e-7 relative, loss 4.8e-7
(0 without tensor parallelism). A microbatch routed to the wrong stage, a lost tied-embedding
gradient or a stale buffer slot is off by orders of magnitude more.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.config import ConfigError, ParallelConfig
from mlm_jax.models import GPT
from mlm_jax.build import parallelize
from mlm_jax.pipeline.layout import PipelineLayout
from mlm_jax.pipeline.runtime import build_program
from mlm_jax.sharding import make_mesh
from mlm_jax.sharding.hlo import collectives
from mlm_jax.validation import finalize
from tests.test_compiled import _COLLECTIVE, _data_parallel_collectives_in_loops, _lines_in_loops
from tests.parallel_util import VOCAB, build, fixed_batch, grads_for, place, tiny_config, unpad
from tests.test_parallel import GRAD_RTOL, LOSS_ATOL, assert_trees_close

LAYERS = 8
MODEL = (("num_layers", LAYERS),)
REFERENCE = (ParallelConfig(), 4)  # one device, micro batch 4: four accumulated microbatches

# (parallel config, micro batch). 8 devices: dp = 8 / (pp * tp); microbatches = 16 / (micro * dp).
LAYOUTS = {
    "pp2_gpipe": (ParallelConfig(pipeline_model_parallel_size=2, pipeline_schedule="gpipe"), 1),
    "pp2_1f1b": (ParallelConfig(pipeline_model_parallel_size=2, pipeline_schedule="1f1b"), 1),
    "pp2_interleaved_v2": (
        ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 1),
    "pp4_gpipe": (ParallelConfig(pipeline_model_parallel_size=4, pipeline_schedule="gpipe"), 1),
    "pp4_1f1b": (ParallelConfig(pipeline_model_parallel_size=4), 1),
    # 8 layers / (4 stages x 1 layer per virtual stage) = 2 chunks per stage.
    "pp4_interleaved_v2": (
        ParallelConfig(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1), 1),
    "pp2_tp2_dp2_sp": (  # with dropout and full recompute (LAYOUT_MODEL below)
        ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                       sequence_parallel=True), 2),
    "pp2_tp2_dp2_sp_zero_interleaved": (
        ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                       sequence_parallel=True, use_distributed_optimizer=True,
                       virtual_pipeline_model_parallel_size=2), 2),
    "pp2_tp2_dp2_zero": (  # 1F1B, distributed optimizer, tensor parallel without SP, untied head
        ParallelConfig(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                       use_distributed_optimizer=True), 2),
    # Megatron's uneven split: 1 + 2 + 2 + 3 layers, stored padded to 3 rows per stage (Llama-style).
    "pp4_uneven_1_2_2_3": (
        ParallelConfig(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
                       decoder_last_pipeline_num_layers=3), 1),
}


# Dropout with full recompute on the 3-D layout: the backward recomputes each stage's forward
# and must redraw the same masks (keys folded from microbatch and layer index, as unpipelined).
# Its microbatches hold the same 4 rows as the reference's, so the masks are the same.
DROPOUT = (("hidden_dropout", 0.1), ("attention_dropout", 0.1), ("recompute_granularity", "full"))
# The uneven split and the tensor-parallel ZeRO layout run the Llama-style model (GQA, rotary,
# RMSNorm, SwiGLU, no biases): with untied embeddings the first stage alone updates the
# embedding, and each stage holds and updates only its block of the LM head's vocab.
LLAMA = (("num_query_groups", 4), ("position_embedding_type", "rope"), ("normalization", "RMSNorm"),
         ("swiglu", True), ("untie_embeddings_and_output_weights", True), ("add_bias_linear", False))
LAYOUT_MODEL = {"pp2_tp2_dp2_sp": DROPOUT, "pp4_uneven_1_2_2_3": LLAMA, "pp2_tp2_dp2_zero": LLAMA}


def model_of(name: str) -> tuple:
    return MODEL + LAYOUT_MODEL.get(name, ())


@functools.cache
def pipelined(name: str):
    """(Parallel, loss, grads in the stored layout, grads in the plain layout), cached."""
    parallel, micro = LAYOUTS[name]
    pz = build(parallel, micro, **dict(model_of(name)))
    state = pz.init(0)
    loss, grads = pz.loss_and_grads(state["params"], place(pz, fixed_batch()), jax.random.key(0))
    stored = jax.tree.map(np.asarray, grads)
    return pz, float(loss), stored, pz.plain(stored)


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_match_single_device(name):
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True, model=model_of(name))
    pz, loss, stored, grads = pipelined(name)
    assert pz.pipeline is not None and pz.mesh.shape["pipe"] == pz.cfg.parallel.pipeline_model_parallel_size
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert not np.any(grads["embed"][VOCAB:])
    assert ("lm_head" in grads) == (LAYOUT_MODEL.get(name) == LLAMA)
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)
    # Padding rows of an uneven split get no gradient (so AdamW leaves them at zero).
    padding = pz.pipeline.layout.plain_index < 0
    assert padding.any() == name.startswith("pp4_uneven")
    for leaf in jax.tree.leaves(stored["layers"]):
        assert not np.any(leaf[padding])


def test_dropout_is_really_on_in_the_sp_layout():
    ref_loss, _ = grads_for(*REFERENCE, single_device=True, model=model_of("pp2_tp2_dp2_sp"))
    no_dropout_loss, _ = grads_for(*REFERENCE, single_device=True, model=MODEL)
    assert abs(ref_loss - no_dropout_loss) > 1e-4, (ref_loss, no_dropout_loss)


def test_evaluation_program_matches_single_device():
    pz = pipelined("pp2_tp2_dp2_sp_zero_interleaved")[0]
    ref = build(*REFERENCE, jax.devices()[:1], **dict(MODEL))
    ref_sum, ref_count = ref.eval_step(ref.init(0)["params"], place(ref, fixed_batch()))
    loss_sum, count = pz.eval_step(pz.init(0)["params"], place(pz, fixed_batch()))
    assert float(count) == float(ref_count)
    np.testing.assert_allclose(float(loss_sum), float(ref_sum), rtol=1e-6)


def test_only_the_pipeline_permutes():
    """The only permutes are the pipeline's: one per slot a phase runs (warmup: the activation,
    steady: both, cooldown: the gradient), of one [batch, seq/tensor, embed] each (with
    sequence parallelism GSPMD could lay the vocab-parallel lookup or the gradient accumulators
    out with permutes of its own, every tick)."""
    pz = pipelined("pp2_tp2_dp2_sp_zero_interleaved")[0]
    state = pz.init(0)
    hlo = pz.loss_and_grads.lower(state["params"], place(pz, fixed_batch()),
                                  jax.random.key(0)).compile().as_text()
    permutes = [c for c in collectives(hlo) if c.kind == "collective-permute"]
    program = pz.pipeline.program(pz.num_microbatches)
    assert [(p.forward, p.backward) for p in program.phases] == [(1, 0), (1, 1), (0, 1)]
    assert len(permutes) == 4, [c.op_name for c in permutes]  # one per used slot of each phase
    micro_rows_per_device = 2  # micro batch 2 per data-parallel rank
    assert all(c.op_name.endswith("ppermute") for c in permutes)
    assert all(c.shapes == ((micro_rows_per_device, 32 // 2, 64),) for c in permutes)


@functools.cache
def train_step_text(name: str) -> str:
    pz = pipelined(name)[0]
    state = pz.init(0)
    return pz.train_step.lower(state, place(pz, fixed_batch()), jax.random.key(0)).compile().as_text()


@pytest.mark.parametrize("name", ["pp2_1f1b", "pp2_tp2_dp2_zero", "pp2_tp2_dp2_sp", "pp2_tp2_dp2_sp_zero_interleaved"])
def test_data_parallel_gradients_are_reduced_once_after_the_schedule(name):
    """As for the plain step (tests/test_compiled.py): no collective over `data` inside the
    tick scans (or the layer scans within them), with dropout too (its masks are drawn for each
    rank's rows of the global batch); the gradient reduction (a reduce-scatter into ZeRO's
    storage) and ZeRO's parameter gather run once, outside."""
    pz = pipelined(name)[0]
    assert pz.mesh.shape["data"] >= 2 and pz.num_microbatches >= 2
    text = train_step_text(name)
    assert _data_parallel_collectives_in_loops(pz, text) == []
    looped = set(_lines_in_loops(text))  # by structure: a combined collective's op_name is no guide
    outside = [line for line in text.splitlines() if _COLLECTIVE.search(line) and line not in looped]
    assert any(" all-reduce" in line or " reduce-scatter" in line for line in outside)
    if pz.cfg.parallel.use_distributed_optimizer:
        assert any(" all-gather" in line for line in outside)


@pytest.mark.parametrize("name", ["pp2_1f1b", "pp2_interleaved_v2", "pp2_tp2_dp2_sp", "pp4_uneven_1_2_2_3"])
def test_the_schedule_runs_without_conditionals(name):
    """No `lax.cond` / `lax.switch` per tick (a GPU reads each conditional's predicate on the
    host): the embedding, the head and an uneven split's padding rows are selected by masks,
    with one or several chunks per stage. The step before this had 10 conditionals (pp2_1f1b)."""
    text = train_step_text(name)
    assert " while(" in text  # the tick scans are there
    assert " conditional(" not in text


@pytest.mark.parametrize("name,stages", [("pp2_1f1b", 2), ("pp2_interleaved_v2", 2), ("pp4_uneven_1_2_2_3", 4)])
def test_each_stage_computes_1_over_p_of_the_lm_head(name, stages):
    """The LM head is split over `pipe` by vocab rows: no stage multiplies by the whole
    [512 (padded vocab), 64] head (neither the logits nor the head's gradient), each by its
    [512 / P, 64] share. Before, every stage ran the whole head and the last stage's counted."""
    vocab, share = 512, 512 // stages  # the whole head's step had (32, 512) and (512, 64) dots
    dots = [m.group(1) for m in re.finditer(r"= \w+\[([0-9,]*)\]\S* dot\(", train_step_text(name))]
    shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in dots]
    assert not [s for s in shapes if vocab in s], shapes
    assert (share, 64) in shapes and (32, share) in shapes, shapes  # [rows, vocab share] logits


@pytest.mark.parametrize("name,whole,shares", [
    # pp4 x dp2, untied head (the uneven layout's Llama-style model): the table [512, 64]
    ("pp4_uneven_1_2_2_3", {(512, 64)}, {(512 // 4, 64)}),
    # pp2 x tp2 x dp2, ZeRO: the vocab-parallel table's [256, 64] tensor shard, reduce-scattered
    # within the shard (no gather over tensor first)
    ("pp2_tp2_dp2_zero", {(256, 64)}, {(256 // 2, 64)}),
])
def test_shared_gradients_are_reduce_scattered_over_pipe(name, whole, shares):
    """The embedding's and final norm's gradients (every stage adds its part; the tied
    embedding's the LM head's too) are summed over `pipe` by a reduce-scatter into the block
    each stage stores, not an all-reduce of the whole table (or of its tensor shard): half the
    bytes, and the data-parallel sum that follows moves 1/P of it. Before, each was all-reduced
    whole twice (over pipe, then over data). Both steps are compiled by the tests above."""
    found = collectives(train_step_text(name))
    assert not [c for c in found if c.kind == "all-reduce" and whole & set(c.shapes)], found
    scattered = {s for c in found if c.kind == "reduce-scatter" for s in c.shapes}
    assert shares <= scattered, scattered


@pytest.mark.parametrize("name,stages,tensor", [("pp4_uneven_1_2_2_3", 4, 1), ("pp2_tp2_dp2_zero", 2, 2)])
def test_an_untied_head_is_held_and_updated_in_blocks_over_pipe(name, stages, tensor):
    """The untied LM head [64, 512] is stored and computed with split over `pipe` by vocab
    (each stage's contiguous block, tensor-split inside it): no device ever holds it whole or
    a whole gradient of it, so no collective in the step carries the whole head or its tensor
    shard (no gather of it over `pipe`, no sum of its gradient over `pipe`). Before, every
    stage gathered [64, 512 / tensor] and reduce-scattered a gradient of that shape. The
    equivalence test above checks its gradient."""
    pz = pipelined(name)[0]
    head = pz.init(0)["params"]["lm_head"]
    assert head.shape == (64, 512)
    assert pz.compute_sharding["lm_head"].spec[1][0] == "pipe", pz.compute_sharding["lm_head"]
    block = (64, 512 // (stages * tensor))
    assert head.addressable_shards[0].data.shape[1] <= block[1]
    found = collectives(train_step_text(name))
    whole = {(64, 512), (64, 512 // tensor)}
    assert not [c for c in found if whole & set(c.shapes)], found
    # ZeRO's gather and the data-parallel sum move the block only.
    assert [c for c in found if block in c.shapes], found


def test_shared_parameters_are_stored_split_over_pipe():
    """Every stage computes with the embeddings and the final norm whole, but their fp32 master
    copy and Adam moments are stored split over `pipe` (as ZeRO splits over `data`): 1/P of them
    per device, not P copies. The step gathers them once before the schedule; the equivalence
    tests and the ten-step curve above run through that storage."""
    pz = pipelined("pp4_1f1b")[0]
    state = pz.init(0)
    V, d = pz.shapes["embed"].shape
    leaves = [x for x in jax.tree.leaves(state) if getattr(x, "shape", None) == (V, d)]
    assert len(leaves) == 3  # the parameter and Adam's two moments
    for x in leaves:
        assert x.addressable_shards[0].data.shape == (V // 4, d), x.sharding
    # The layers stay stored by stage, as before.
    assert all(x.sharding.spec[0] == "pipe" for x in jax.tree.leaves(state["params"]["layers"]))


# --------------------------------------------------------------------------- training curve

# Ten AdamW steps. As in test_parallel.py: Adam turns fp32 reorder noise in near-zero gradient
# entries into visible steps, so parameters are compared within 1e-4 absolute (a tenth of one
# lr=1e-3 step) and losses within 2e-5; a wrong gradient moves parameters by whole steps.
# Measured: losses 9.5e-7 apart, parameters 1.4e-5.
CURVE_STEPS = 10
CURVE_LOSS_ATOL = 2e-5
CURVE_PARAM_ATOL = 1e-4


@functools.cache
def curve(parallel: ParallelConfig, micro: int, single_device: bool = False):
    pz = build(parallel, micro, jax.devices()[:1] if single_device else None, **dict(MODEL))
    state = pz.init(0)
    losses = []
    for i in range(CURVE_STEPS):  # two batches in turn: memorised, so the loss falls clearly
        state, metrics = pz.train_step(state, place(pz, fixed_batch(i % 2)), jax.random.key(i))
        losses.append(float(metrics["lm_loss"]))
    return losses, pz.plain(jax.tree.map(np.asarray, state["params"]))


def test_ten_step_training_curve_matches_pp1():
    ref_losses, ref_params = curve(*REFERENCE, single_device=True)
    losses, params = curve(*LAYOUTS["pp2_tp2_dp2_sp_zero_interleaved"])
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=CURVE_LOSS_ATOL)
    assert ref_losses[-1] < ref_losses[0] - 0.1
    assert_trees_close(unpad(ref_params), unpad(params), rtol=0.0, atol=CURVE_PARAM_ATOL)


# --------------------------------------------------------------------------- aux scalars


class ZLossGPT(GPT):
    """Test-only model whose head reports two aux scalars (as MoE's losses will): the sum of
    squared log-partition values over unmasked tokens, and the count of those tokens."""

    def head(self, x_bsd, labels_bs, loss_mask_bs, vocab_split=None):
        loss_sum, aux = super().head(x_bsd, labels_bs, loss_mask_bs, vocab_split)
        lse = jax.nn.logsumexp(self.logits(x_bsd), axis=-1)  # [b, s]
        return loss_sum, {**aux, "z_sum": jnp.sum(lse * lse * loss_mask_bs), "tokens": jnp.sum(loss_mask_bs)}


@functools.cache
def aux_metrics(parallel: ParallelConfig, micro: int, single_device: bool = False) -> dict:
    pz = build(parallel, micro, jax.devices()[:1] if single_device else None, model_class=ZLossGPT,
               num_layers=4)
    _, metrics = pz.train_step(pz.init(0), place(pz, fixed_batch()), jax.random.key(0))
    return jax.tree.map(float, metrics)


@pytest.mark.parametrize("name", ["pp2_1f1b", "pp2_interleaved_v2"])
def test_head_aux_is_summed_over_microbatches_into_the_metrics(name):
    """Each microbatch's aux counted once (not again in the backward's recompute), on the last
    stage only, summed over stages: equal to the plain step's sum (fp32, 1e-6 relative)."""
    ref = aux_metrics(*REFERENCE, single_device=True)
    got = aux_metrics(*LAYOUTS[name])
    assert ref["aux"]["tokens"] == got["aux"]["tokens"] == got["tokens"] == float(fixed_batch()["loss_mask"].sum())
    assert ref["aux"]["z_sum"] > 1.0
    assert got["aux"]["z_sum"] == pytest.approx(ref["aux"]["z_sum"], rel=1e-6)
    assert got["lm_loss"] == pytest.approx(ref["lm_loss"], abs=LOSS_ATOL)


# --------------------------------------------------------------------------- memory


def temp_bytes(schedule: str, m: int) -> int:
    """Per-device temp bytes of the compiled loss_and_grads, pp=2 x dp=4, m microbatches."""
    cfg = tiny_config(ParallelConfig(pipeline_model_parallel_size=2, pipeline_schedule=schedule),
                      1, num_layers=2)
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, global_batch_size=m * 4))
    cfg = finalize(cfg, jax.device_count())
    pz = parallelize(cfg, make_mesh(cfg.parallel))
    assert pz.num_microbatches == m
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          pz.shapes, pz.param_sharding)
    batch = {k: jax.ShapeDtypeStruct(pz.batch_shape(), jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=pz.batch_sharding())
             for k in ("tokens", "labels", "loss_mask", "position_ids")}
    compiled = pz.loss_and_grads.lower(params, batch, jax.random.key(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_temp_memory_is_flat_in_microbatches_and_gpipe_grows():
    """A stashed stage input is [1 row, seq 32, embed 64] fp32 = 8 KiB per device. GPipe
    stashes all m; 1F1B at most 2(P-1)-1 = 1 (P = 2) whatever m. The schedule arrays grow with m
    by a few bytes per tick, hence the 1 KiB allowance (an eighth of one stashed activation).
    A two-slot tick holds a forward's and a backward's working set, the latter with the head's
    broadcast of the last stage's output and the sum of its gradient shares (fp32), so at small
    m 1F1B's temp is above GPipe's (measured m=4: 1F1B 847 KiB, GPipe 774 KiB, 9 slots apart);
    it is below from an m between 8 and 16 on (m=16: 847 against 870 KiB), and the gap grows by a
    slot per microbatch."""
    slot = 1 * 32 * 64 * 4
    one_f_one_b = {m: temp_bytes("1f1b", m) for m in (4, 8, 16)}
    gpipe = {m: temp_bytes("gpipe", m) for m in (4, 16)}  # benchmarks/pipeline.py has m = 8 too
    assert one_f_one_b[16] - one_f_one_b[4] < 1024, one_f_one_b
    assert abs(one_f_one_b[8] - one_f_one_b[4]) < 1024, one_f_one_b
    assert gpipe[16] - gpipe[4] >= 12 * slot, gpipe
    assert gpipe[16] > one_f_one_b[16], (gpipe, one_f_one_b)
    assert (gpipe[16] - one_f_one_b[16]) - (gpipe[4] - one_f_one_b[4]) >= 12 * slot, (gpipe, one_f_one_b)
    assert one_f_one_b[4] - gpipe[4] <= 10 * slot, (gpipe, one_f_one_b)  # the two-slot tick's extra


# --------------------------------------------------------------------------- programs (no devices)

PROGRAM_CASES = (
    [("gpipe", P, m, 1) for P in (2, 3, 4) for m in (1, 2, 3, 5, 8)]
    + [("1f1b", P, m, 1) for P in (2, 3, 4, 5) for m in (1, 2, 3, 5, 8)]
    + [("interleaved", P, k * P, V) for P in (2, 3, 4) for k in (1, 2, 3) for V in (2, 3)]
)


def _interpret(program) -> None:
    """Run a program on symbols as the runtime does: every slot must find exactly the tensor it
    needs in what arrived last tick or in its stash slot, and a stash slot is only overwritten
    after its backward read it."""
    P, V, a = program.num_stages, program.num_chunks, program.arrays
    last = P * V - 1
    x_recv, g_recv = [None] * P, [None] * P  # ('act', microbatch, v out) / ('grad', microbatch, v out)
    stash = [dict() for _ in range(P)]  # stage -> slot -> ('act', microbatch, v out)
    for t in range(program.ticks):
        sent_fwd, sent_bwd = [None] * P, [None] * P
        for s in range(P):
            if a["f_valid"][t, s]:
                mb, v = int(a["f_mb"][t, s]), int(a["f_chunk"][t, s]) * P + s
                if v > 0:
                    assert x_recv[s] == ("act", mb, v - 1), (t, s, x_recv[s])
                slot = int(a["f_stash"][t, s])
                assert (slot >= 0) == (v > 0 and not program.forward_only), (t, s, slot)
                if slot >= 0:
                    assert slot not in stash[s] and slot < program.num_stash_slots, (t, s, slot)
                    stash[s][slot] = x_recv[s]
                sent_fwd[s] = ("act", mb, v)
            else:
                assert a["f_stash"][t, s] == -1
        for s in range(P):
            if a["b_valid"][t, s]:
                mb, v = int(a["b_mb"][t, s]), int(a["b_chunk"][t, s]) * P + s
                if v > 0:
                    assert stash[s].pop(int(a["b_stash"][t, s])) == ("act", mb, v - 1), (t, s)
                if v < last:
                    assert g_recv[s] == ("grad", mb, v + 1), (t, s, g_recv[s])
                sent_bwd[s] = ("grad", mb, v)
        x_recv = [sent_fwd[(s - 1) % P] for s in range(P)]  # ppermute s -> s+1 (ring)
        g_recv = [sent_bwd[(s + 1) % P] for s in range(P)]  # ppermute s -> s-1 (ring)
    assert all(not st for st in stash)


@pytest.mark.parametrize("name,P,m,V", PROGRAM_CASES)
def test_programs_route_every_tensor_to_its_reader(name, P, m, V):
    _interpret(build_program(name, P, m, V))
    _interpret(build_program(name, P, m, V, forward_only=True))


@pytest.mark.parametrize("P,m", list(itertools.product((2, 3, 4, 5), (1, 4, 8, 16))))
def test_stash_is_flat_in_m_for_1f1b_and_m_for_gpipe(P, m):
    """1F1B's lockstep round trip on stage s is 2(P-1-s) ticks, so stage s holds up to
    2(P-1-s)+1 inputs: the most on stage 1 (stage 0 re-embeds), 2P-3, whatever m. GPipe: m."""
    assert build_program("1f1b", P, m).num_stash_slots == min(2 * P - 3, m)
    assert build_program("gpipe", P, m).num_stash_slots == m
    assert build_program("1f1b", P, m).ticks == m + 2 * P - 2


def test_forward_only_program_ticks():
    assert build_program("1f1b", 4, 8, forward_only=True).ticks == 8 + 4 - 1
    assert build_program("interleaved", 2, 4, 2, forward_only=True).ticks == 4 * 2 + 2 - 1


# --------------------------------------------------------------------------- layout


def test_layout_round_trips_and_places_layers():
    plain = {"layers": {"w": np.arange(8 * 3).reshape(8, 3).astype(np.float32)},
             "embed": np.ones((4, 3), np.float32)}
    flat = PipelineLayout(2, 1, (4, 4))
    assert flat.is_identity and flat.to_pipelined(plain) is plain  # checkpoints as pp=1
    interleaved = PipelineLayout(2, 2, (2, 2, 2, 2))
    assert interleaved.stage_layers(0) == [0, 1, 4, 5] and interleaved.stage_layers(1) == [2, 3, 6, 7]
    uneven = PipelineLayout(4, 1, (1, 2, 2, 3))
    assert uneven.stored_layers == 12 and uneven.stage_layers(3) == [5, 6, 7]
    for layout in (interleaved, uneven):
        stored = layout.to_pipelined(plain)
        assert stored["embed"] is plain["embed"]
        np.testing.assert_array_equal(layout.to_plain(stored)["layers"]["w"], plain["layers"]["w"])
        rows = stored["layers"]["w"].reshape(layout.num_stages, -1, 3)  # [stage, V*Lmax, 3]
        for s in range(layout.num_stages):
            real = layout.plain_index.reshape(layout.num_stages, -1)[s] >= 0
            np.testing.assert_array_equal(rows[s][real], plain["layers"]["w"][layout.stage_layers(s)])
            assert not rows[s][~real].any()


# --------------------------------------------------------------------------- config errors


def _finalize(micro=1, global_batch=16, _layers=LAYERS, **parallel):
    cfg = tiny_config(ParallelConfig(**parallel), micro, num_layers=_layers)
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, global_batch_size=global_batch))
    return finalize(cfg, jax.device_count())


@pytest.mark.parametrize("parallel,message", [
    (dict(pipeline_model_parallel_size=4, _layers=6),
     "--num-layers 6 is not divisible by --pipeline-model-parallel-size 4"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3),
     r"--num-layers 8 is not divisible by --pipeline-model-parallel-size 2 x 3 virtual stages per rank = 6"),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3),
     r"--num-layers 8 is not divisible by --pipeline-model-parallel-size 2 x "
     r"--num-layers-per-virtual-pipeline-stage 3 = 6"),
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, micro=4),
     r"too few microbatches for the interleaved schedule: 2 .* < --pipeline-model-parallel-size 4"),
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, global_batch=48, micro=4),
     r"microbatches \(6 = .*\) to be a multiple of --pipeline-model-parallel-size 4"),
    (dict(virtual_pipeline_model_parallel_size=2),
     "need --pipeline-model-parallel-size > 1, got 1"),
    (dict(decoder_first_pipeline_num_layers=2),
     r"--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1, got 1"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          num_layers_per_virtual_pipeline_stage=2),
     r"set only one of --num-virtual-stages-per-pipeline-rank \(2\) and "
     r"--num-layers-per-virtual-pipeline-stage \(2\)"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="interleaved"),
     "interleaved needs at least 2 virtual stages per pipeline rank, got 1"),
    (dict(pipeline_model_parallel_size=2, pipeline_schedule="1f1b", virtual_pipeline_model_parallel_size=2),
     "--pipeline-schedule 1f1b runs one model chunk per pipeline rank, but 2 virtual stages"),
    (dict(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=3,
          decoder_last_pipeline_num_layers=4),
     r"first 3 \+ last 4 leaves 1 layers for the other 2 of 4 stages"),
    (dict(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2,
          decoder_last_pipeline_num_layers=3),
     r"first 2 \+ last 3 leaves 3 layers, not divisible by the 2 remaining pipeline stages"),
    (dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=8),
     r"first 8 leaves 0 layers for the other 1 of 2 stages"),
    (dict(pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2,
          virtual_pipeline_model_parallel_size=2),
     r"with virtual pipeline stages is not supported \(V=2\)"),
])
def test_invalid_pipeline_configs_name_their_numbers(parallel, message):
    parallel = dict(parallel)
    kwargs = {k: parallel.pop(k) for k in ("micro", "global_batch", "_layers") if k in parallel}
    with pytest.raises(ConfigError, match=message):
        _finalize(**kwargs, **parallel)


def test_valid_pipeline_configs_pass_and_pick_megatrons_default_schedule():
    from mlm_jax.pipeline.runtime import plan

    cfg = _finalize(pipeline_model_parallel_size=2)
    assert plan(cfg) == ("1f1b", PipelineLayout(2, 1, (4, 4)))
    cfg = _finalize(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2)
    assert plan(cfg) == ("interleaved", PipelineLayout(2, 2, (2, 2, 2, 2)))
    cfg = _finalize(pipeline_model_parallel_size=4, decoder_last_pipeline_num_layers=2)
    assert plan(cfg)[1].layers_per_vstage == (2, 2, 2, 2)
    _finalize(pipeline_schedule="1f1b")  # a schedule with pp=1 is harmless: no pipeline


@pytest.mark.parametrize("pp", [1, 2])
def test_zero_bf16_parameter_gather_changes_only_the_bytes(pp):
    """Under --bf16, ZeRO gathers the weights in bf16 once per step (HLO: `test_compiled`), with
    and without the pipeline. The model rounds the same fp32 weights to bf16 either way, so the
    loss and every gradient equal the same step without ZeRO (dp4 x pp2, dp8)."""
    bf16 = (("bf16", True),) + (MODEL if pp > 1 else ())
    plain = ParallelConfig(pipeline_model_parallel_size=pp)
    loss, grads = grads_for(plain, 1, model=bf16)
    zero_loss, zero_grads = grads_for(dataclasses.replace(plain, use_distributed_optimizer=True), 1, model=bf16)
    assert abs(zero_loss - loss) <= 1e-6, (zero_loss, loss)
    assert_trees_close(grads, zero_grads, 1e-6)
