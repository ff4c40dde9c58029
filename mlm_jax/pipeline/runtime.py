"""The pipeline runtime: one SPMD program that executes a two-slot lockstep schedule.

`lockstep` says which unit (microbatch, chunk) each stage runs in each tick's forward slot and
backward slot; this module turns that into int32 arrays (`Program`) and runs them inside one
`jax.shard_map` that is manual over `pipe` only (data, tensor and sequence sharding stay
automatic inside each stage). There is no Python dispatch per microbatch and no per-tick choice
of action: the program is one `lax.scan` per phase of the schedule (1F1B and interleaved:
forward-only warmup, steady ticks with both slots, backward-only cooldown (at P=2 its one tick
runs in the steady scan, `lockstep.phases`); GPipe: forwards then
backwards; evaluation: forwards), and every tick runs the phase's slots on every stage. A slot
with no unit in this tick runs masked on microbatch 0 (its loss and aux are dropped with
`jnp.where`, its backward gets zero cotangents). After the slots, the activation moves to
stage s+1 and the gradient to s-1 with `ppermute` (a ring: the interleaved schedule's chunk
hand-over goes from the last stage to the first). So a tick costs F + B in the steady state and
the whole program costs (m*V + P - 1)(F + B)/V, the asynchronous schedule's time (see
`lockstep` and benchmarks/pipeline.py).

Stages and their state
----------------------
- Layer params are stacked [P*V*Lmax, ...] and sharded over `pipe` (see `layout`): each stage
  sees its own [V, Lmax, ...] and picks chunk c per slot.
- The embedding's output is used on the first virtual stage only, by a select on the virtual
  stage: every stage runs the lookup (a gather of [b, s] rows, no matmul), so the program
  holds no conditional (on a GPU each one reads its predicate on the host), and the other
  stages' lookups get zero cotangents, hence exactly zero gradients. Padding rows of an uneven
  split run and are dropped the same way (`GPT.run_layers_aux`).
- The LM head and its loss are split over `pipe` by vocab rows: in the backward slot (and in
  evaluation's forward slot) the last virtual stage's output is summed over `pipe` (only its
  stage's is nonzero), every stage computes the logits of its 1/P of the vocab, and the
  softmax's max, sum and label logit are reduced over `pipe` ([b, s] each); autodiff's
  transpose of the first sum adds the stages' shares of the output's gradient on the last
  stage. So a tick costs each stage 1/P of a head, where Megatron's last stage runs it whole
  (and in lockstep a tick lasts as long as its slowest stage); the loss is counted on the last
  virtual stage. An untied head is held split over `pipe` in contiguous vocab blocks
  (`Pipeline.stored_specs`): each stage computes with its own block, and its gradient stays
  that block (nothing gathered or summed over `pipe`). A tied head is the embedding table,
  which the first stage needs whole for the lookup: each stage takes every P-th row of it
  (`GPT.head_weight`, `VocabSplit`).
- Embedding, position embedding, final norm and a tied LM head are *stored* split over `pipe`
  (`shared_storage_specs`: the fp32 master copy and Adam moments 1/P per device) and gathered
  once per step: every stage holds them whole while it computes. Their gradients are
  accumulated per stage and summed over `pipe` once at the end of the step, a reduce-scatter
  into the block each stage stores (`Pipeline._sum_stages`): that sum is also what adds the tied
  embedding's gradients (the lookup's on the first stage, the head's shares on every stage),
  as Megatron's embedding-group all-reduce does, at half its bytes.
- Every input a slot needs was produced exactly one tick earlier (`lockstep.validate` checks
  it), so what arrives is used at once: no receive buffers. A stage keeps the *inputs* of its
  forwards until their backward in a stash; slots are assigned ahead of time (`build_program`),
  so the stash holds the schedule's peak: m for GPipe, flat in m for 1F1B (2(P-1-s)+1 on stage
  s: the lockstep round trip) and interleaved.
- The backward recomputes the stage's forward with `jax.vjp` from the stashed input, and
  applies the vjp at once. This is activation recomputation at stage granularity: one extra
  forward per microbatch (Megatron's full recompute costs the same), in exchange for stashing
  one [batch, seq, embed] tensor per in-flight unit instead of every layer's activations.
  `--recompute-granularity` still applies inside the recomputed stage (it bounds the memory of
  the one vjp alive at a time).

A virtual stage runs the model's stage API (`embed_tokens` on the first, `run_layers` on its
chunk, padded rows included, `head` split over `pipe` for the last); this file holds no copy of the layer loop,
the loss or the dtype rules. The loss is the unpipelined one: the sum of masked token losses
over the global batch, divided by the global batch's token count; the head's `aux` scalars are
summed over microbatches and stages; dropout keys are folded from (step key, microbatch index,
layer index) exactly as `parallelize` does, so pipelined and unpipelined runs draw the same masks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax import loss_scale as ls
from mlm_jax import platform
from mlm_jax.config import Config, ConfigError
from mlm_jax.models import fp8
from mlm_jax.models.gpt import VocabSplit, stage_keys
from mlm_jax.models.layers import compute_dtype
from mlm_jax.models.moe import aux_terms, is_expert_bias
from mlm_jax.pipeline import lockstep
from mlm_jax.pipeline.layout import map_layer_leaves, pipeline_plan
from mlm_jax.parallel.data import (fp8_param_gather, gather_once, per_rank_trace, rank_axes, reduce_over_ranks, reduces_once,
                                   zero_gather_dtype)
from mlm_jax.sharding.mesh import DATA, PIPE, varying
from mlm_jax.sharding.rules import constrain, zero_spec
from mlm_jax.sharding.specs import (auto_part, blocks_over_pipe, holds, manual_part, pipe_blocks, pipe_scatter_dim,
                                    pipe_stored, replicated, rows_over, stacked_per_rank, stage_chunks, with_pipe)

ACT_BUFFER = (None, "batch", "seq", "embed")  # [slot, batch, seq, embed], like a block boundary


# --------------------------------------------------------------------------- plan


plan = pipeline_plan  # (schedule name, layer layout) of a config


# --------------------------------------------------------------------------- program


@dataclasses.dataclass(frozen=True)
class Program:
    """A two-slot lockstep table (`lockstep`) compiled for the runtime.

    arrays, each int32 [ticks, stages], per slot (f_ forward, b_ backward):
      *_valid       1 where the slot has a unit (else it runs masked on microbatch 0, chunk 0);
      *_mb, *_chunk the unit;
      f_stash       stash slot that keeps this forward's input for its backward (-1: none, for
                    the first virtual stage, which re-embeds, and in evaluation);
      b_stash       stash slot the backward reads its stage input from.
    A slot is taken by a forward and freed by its backward (forward slot before backward slot
    within a tick), so num_stash_slots is the schedule's true peak of stashed stage inputs.
    phases: runs of ticks that use the same slots; the runtime scans each with only those.
    """

    name: str
    num_stages: int
    num_chunks: int
    num_microbatches: int
    forward_only: bool
    table: list
    phases: tuple
    arrays: dict[str, np.ndarray]
    num_stash_slots: int

    @property
    def ticks(self) -> int:
        return len(self.table)


class _Slots:
    """Lowest-free-slot allocation per stage; records the high-water mark."""

    def __init__(self, num_stages: int):
        self.free: list[list[int]] = [[] for _ in range(num_stages)]
        self.used: list[int] = [0] * num_stages
        self.owner: list[dict] = [{} for _ in range(num_stages)]

    def take(self, stage: int, key) -> int:
        if self.free[stage]:
            slot = min(self.free[stage])
            self.free[stage].remove(slot)
        else:
            slot = self.used[stage]
            self.used[stage] += 1
        self.owner[stage][key] = slot
        return slot

    def release(self, stage: int, key) -> int:
        slot = self.owner[stage].pop(key)
        self.free[stage].append(slot)
        return slot

    @property
    def peak(self) -> int:
        return max(self.used)


@functools.cache
def build_program(name: str, P: int, m: int, V: int = 1, forward_only: bool = False) -> Program:
    """The two-slot table of schedule `name` (or its forward phase, for evaluation), checked,
    with its stash slots."""
    table = lockstep.two_slot(name, P, m, V, forward_only)
    lockstep.validate(table, P, m, V, forward_only)
    T = len(table)
    arrays = {k: np.zeros((T, P), np.int32) for k in
              ("f_valid", "f_mb", "f_chunk", "b_valid", "b_mb", "b_chunk", "b_stash")}
    arrays["f_stash"] = np.full((T, P), -1, np.int32)
    stash = _Slots(P)
    for t, (fwd, bwd) in enumerate(table):
        for slot, row in (("f", fwd), ("b", bwd)):  # forward slot first: it stores, then B reads
            for s, a in enumerate(row):
                if a.is_idle:
                    continue
                arrays[f"{slot}_valid"][t, s] = 1
                arrays[f"{slot}_mb"][t, s], arrays[f"{slot}_chunk"][t, s] = a.microbatch, a.chunk
                if forward_only or a.chunk * P + s == 0:
                    continue
                key = (a.microbatch, a.chunk)
                if slot == "f":
                    arrays["f_stash"][t, s] = stash.take(s, key)
                else:
                    arrays["b_stash"][t, s] = stash.release(s, key)
    return Program(name, P, V, m, forward_only, table, tuple(lockstep.phases(table)), arrays,
                   num_stash_slots=max(stash.peak, 1))


# --------------------------------------------------------------------------- runtime


class Pipeline:
    """Pipeline parallelism for one (config, mesh): the layout, the programs, the step pieces."""

    def __init__(self, cfg: Config, mesh, graphdef: nnx.GraphDef):
        self.cfg, self.mesh, self.graphdef = cfg, mesh, graphdef
        self.schedule, self.layout = plan(cfg)
        if self.layout.num_stages != mesh.shape[PIPE]:
            raise ConfigError(
                f"--pipeline-model-parallel-size {self.layout.num_stages} != the mesh's pipe axis "
                f"({mesh.shape[PIPE]})"
            )

    # Storage: what parallelize needs to shard the stacked layers over `pipe`.

    def stored_shapes(self, shapes: dict) -> dict:
        n = self.layout.stored_layers
        return map_layer_leaves(lambda s: jax.ShapeDtypeStruct((n, *s.shape[1:]), s.dtype), shapes)

    def stored_specs(self, specs: dict, shapes: dict) -> dict:
        """The compute specs under the pipeline: stacked layer leaves split over `pipe` by
        stage; an untied LM head [embed, vocab] with its vocab split over `pipe` in contiguous
        blocks (when they divide evenly): each stage computes its share of the head's logits
        with its own block (`VocabSplit` blocked), so no stage holds the whole head or its
        gradient, and neither is gathered or summed over `pipe`."""
        specs = map_layer_leaves(pipe_stored, specs)
        if "lm_head" in specs:
            specs = {**specs, "lm_head": blocks_over_pipe(specs["lm_head"], shapes["lm_head"].shape, 1,
                                                          dict(self.mesh.shape))}
        return specs

    def shared_storage_specs(self, specs: dict, shapes: dict) -> dict:
        """Storage of the parameters every stage holds whole while it computes (embeddings,
        final norm, a tied LM head; an untied head is computed split over `pipe` already, see
        `stored_specs`, and stored so): split over `pipe` as ZeRO splits over `data` (`zero_spec`), so
        their fp32 master copy and Adam moments are not kept P times; the step gathers them
        once, before the schedule, and reduce-scatters their gradients over `pipe` after it.
        On its dim `pipe` comes right after the axes the leaf computes with and before ZeRO's
        `data`: each device's share of that reduce-scatter is then a block of its own compute
        shard (no data moves to reach storage), and ZeRO's reduce-scatter over `data` splits it
        further."""
        sizes = dict(self.mesh.shape)

        def store(spec, shape):
            zero = holds(spec, DATA)
            spec = zero_spec(auto_part(spec, (DATA,)), shape.shape, sizes, PIPE)
            return zero_spec(spec, shape.shape, sizes) if zero else spec

        return {k: v if k == "layers" else jax.tree.map(store, v, shapes[k]) for k, v in specs.items()}

    def to_pipelined(self, tree):
        return self.layout.to_pipelined(tree)

    def to_plain(self, tree):
        return self.layout.to_plain(tree)

    def program(self, num_microbatches: int, forward_only: bool = False) -> Program:
        L = self.layout
        return build_program(self.schedule, L.num_stages, num_microbatches, L.num_chunks, forward_only)

    # The step pieces (traced inside parallelize's jit, under its mesh and activation rules).

    def loss_and_grads(self, params: dict, batch: dict, key, compute_sharding, param_sharding,
                       loss_scale=None):
        """(token-mean loss of the global batch, grads in the storage sharding, summed aux);
        with `loss_scale` (fp16) the loss and grads are those of loss x loss_scale."""
        # ZeRO: the one all-gather per step, the weights in bf16 under --bf16 (see gather_once).
        # The layers' stay so: each tick's weight gradients come in bf16 (the values the fp32
        # copy's cast would widen), accumulated in fp32 (`init_carry`, `accumulate`); widened,
        # they entered the tick loops as an fp32 copy of the stage's weights. The shared leaves
        # (embedding, head) are widened back: several stages' and slots' uses of them sum their
        # gradients, in fp32 as without ZeRO.
        gathered = gather_once(params, param_sharding, compute_sharding, zero_gather_dtype(self.cfg),
                               fp8_param_gather(self.cfg))
        params = {k: v if k == "layers" else jax.tree.map(lambda x, p: x.astype(p.dtype), v, params[k])
                  for k, v in gathered.items()}
        program = self.program(batch["tokens"].shape[0])
        specs = jax.tree.map(lambda sh: sh.spec, compute_sharding)
        per_rank = self.reduces_once(params, batch)
        weight = ls.token_weight(batch, loss_scale)
        loss, grads, aux = self._run(program, params, batch, key, weight, specs, per_rank,
                                     jax.tree.map(lambda sh: sh.spec, param_sharding))
        if per_rank:  # [dp/data, ...] per-rank gradients: the one data-parallel reduction
            return loss, reduce_over_ranks(grads, param_sharding, self.cfg.parallel.grad_reduce_in_bf16), aux
        return loss, jax.lax.with_sharding_constraint(grads, param_sharding), aux

    def reduces_once(self, params: dict, batch: dict) -> bool:
        """Whether data-parallel gradients are accumulated per rank over the whole schedule and
        reduced once after it: `parallel.data.reduces_once`, the rule the plain step follows,
        asked with the head's aux (batch-wide statistics that a per-rank body would change)."""
        if not reduces_once(self.mesh):
            return False

        def head_aux():
            _, B, S = batch["tokens"].shape  # [microbatches, micro * dp, seq]
            x = jnp.zeros((B, S, self.cfg.model.hidden_size), compute_dtype(self.cfg.model))
            return nnx.merge(self.graphdef, params).head_and_mtp(x, jax.tree.map(lambda a: a[0], batch), None)[1]

        return reduces_once(self.mesh, jax.eval_shape(head_aux))

    def loss_sum(self, params: dict, batch: dict, compute_sharding) -> jax.Array:
        """Sum of masked token losses of the batch, no dropout (evaluation)."""
        params = jax.lax.with_sharding_constraint(params, compute_sharding)
        program = self.program(batch["tokens"].shape[0], forward_only=True)
        specs = jax.tree.map(lambda sh: sh.spec, compute_sharding)
        return self._run(program, params, batch, None, jnp.float32(1.0), specs)[0]

    def _run(self, program: Program, params: dict, batch: dict, key, scale, specs: dict,
             per_rank: bool = False, storage=None):
        """(loss, grads or None, aux) of `program` on the global batch, in one shard_map.

        specs: the params' compute specs. The shared leaves enter whole over `pipe`, but for an
        untied LM head split over it (`stored_specs`): each stage gets its block, and its
        gradient leaves as that block.
        per_rank: the shard_map is manual over `data` too, and over `expert` with expert
        parallelism (tensor stays GSPMD's): each rank runs the schedule on its own rows (and
        experts) and returns its unreduced gradients stacked [ranks, ...] (see
        `specs.stacked_per_rank`), so no data-parallel collective runs inside the ticks.
        storage: the params' storage specs (training): the shared leaves' gradients come out
        summed over `pipe` in their layout (`_sum_stages`)."""
        train = not program.forward_only
        layers = params["layers"]
        shared = {k: v for k, v in params.items() if k != "layers"}
        arrays = {k: jnp.asarray(v) for k, v in program.arrays.items()}
        use_dropout = key is not None
        key = jax.random.key(0) if key is None else key
        ranks = rank_axes(self.mesh) if per_rank else ()
        axes = (PIPE, *ranks)
        specs_in = specs
        shared_held = jax.tree.map(lambda sp: manual_part(sp, axes), {k: v for k, v in specs.items() if k != "layers"})
        head_split = VocabSplit(PIPE, blocked="lm_head" in specs and holds(specs["lm_head"], PIPE))
        if per_rank:  # a stage's own experts: the layer leaves' `expert` split is manual too
            layer_specs = jax.tree.map(lambda sp: manual_part(sp, axes), specs["layers"])
        else:
            layer_specs = pipe_blocks()
        specs = jax.tree.map(lambda sp: auto_part(sp, axes), specs)  # inside: the automatic axes

        def body(layers_blk, shared, batch, key, scale, arrays):
            # Per rank, dropout masks are drawn for this rank's rows of the global batch.
            # A dropless MoE router keeps the whole microbatch's statistics (summed over the ranks).
            inner = per_rank_trace(self.mesh, ranks, batch["tokens"].shape[1]) if per_rank else contextlib.nullcontext()
            with inner:
                stage = _Stage(self, program, specs, use_dropout, layers_blk, shared, batch, key, scale, axes,
                               head_split)
                loss, d_layers, d_shared, aux = stage.run(arrays)
            if per_rank:  # [1, ...] per rank, stacked over the ranks and summed outside
                loss, d_layers, aux = jax.tree.map(lambda g: g[None], (loss, d_layers, aux))
            # [1, ...] per stage (and rank): summed over pipe by `_sum_stages` (the blocked head's
            # per rank only: its stage's block is all of its gradient there is)
            return loss, d_layers, jax.tree.map(lambda g: g[None], d_shared), aux

        rep = replicated()
        stacked = stacked_per_rank(rep, ranks) if per_rank else rep
        d_layer_specs = jax.tree.map(lambda sp: stacked_per_rank(sp, ranks), layer_specs) if per_rank else layer_specs
        d_shared_specs = jax.tree.map(lambda sp: stacked_per_rank(sp, axes), shared_held) if train else rep
        run = jax.shard_map(
            body, mesh=self.mesh,
            in_specs=(layer_specs, shared_held, rows_over(ranks) if per_rank else rep, rep, rep, rep),
            out_specs=(stacked, d_layer_specs, d_shared_specs, stacked),
            axis_names=frozenset(axes),
        )
        loss, d_layers, d_shared, aux = run(layers, shared, batch, key, jnp.asarray(scale, jnp.float32), arrays)
        if per_rank:
            loss, aux = jax.tree.map(lambda x: jnp.sum(x, axis=0), (loss, aux))
        if not train:
            return loss, None, aux
        compute, storage = ({k: v for k, v in t.items() if k != "layers"} for t in (specs_in, storage))
        return loss, {**self._sum_stages(d_shared, compute, storage, ranks), "layers": d_layers}, aux

    def _sum_stages(self, d_shared, compute: dict, storage: dict, ranks: tuple):
        """The shared leaves' per-stage (per-rank) gradients [P * ranks, ...] summed over `pipe`
        -> [ranks, ...] per rank (the caller sums those) or the sum. A leaf whose storage splits
        it over `pipe` after its compute axes (`pipe_scatter_dim`) is reduce-scattered there, each
        device keeping its stored block of its own compute shard: an all-reduce's sum at half its
        bytes, and the data-parallel sum after it moves 1/P of the table (Megatron all-reduces a
        tied embedding's gradient between the first and last stage); other leaves (tiny ones)
        are all-reduced; a leaf computed split over `pipe` (the blocked head) passes as it is.
        Fully manual, so each device reduces the shard it holds: inside the
        schedule's shard_map `tensor` is automatic, and there XLA gathers a tensor-split operand
        over `tensor` before a reduce-scatter. On the CPU one collective is in flight at a time
        (the in-process pool, see `_Stage.tick`): each waits for the one before through an
        optimization barrier, which moves no data; elsewhere XLA may combine or overlap them."""
        sizes = dict(self.mesh.shape)
        chain = platform.mesh_platform(self.mesh) == platform.CPU  # the mesh's devices, not this process's
        stack = (PIPE, *ranks)
        splits = jax.tree.map(lambda c, st: pipe_scatter_dim(c, st, sizes), compute, storage)
        held = jax.tree.map(lambda c: holds(c, PIPE), compute)

        def body(d_shared):
            leaves, treedef = jax.tree.flatten(d_shared)
            split_of, held_of = treedef.flatten_up_to(splits), treedef.flatten_up_to(held)
            out, done = [], None
            for g, split, own in zip(leaves, split_of, held_of):
                if own:  # this stage's block already
                    out.append(g if ranks else g[0])
                    continue
                g = jax.lax.optimization_barrier((g[0], done))[0] if chain and done is not None else g[0]
                if split:
                    done = jax.lax.psum_scatter(g, PIPE, scatter_dimension=split[0], tiled=True)
                else:
                    done = jax.lax.psum(g, PIPE)
                out.append(done[None] if ranks else done)
            return treedef.unflatten(out)

        def out_spec(c, split):
            spec = with_pipe(c, split)
            return stacked_per_rank(spec, ranks) if ranks else spec

        return jax.shard_map(
            body, mesh=self.mesh,
            in_specs=(jax.tree.map(lambda c: stacked_per_rank(c, stack), compute),),
            out_specs=jax.tree.map(out_spec, compute, splits),
            # unchecked: the barrier's outputs would carry every chained leaf's varying axes
            check_vma=False,
        )(d_shared)


class _Stage:
    """One stage's view inside the shard_map: its layer block, the replicated params, the batch.

    Per device: layer leaves [V*Lmax, ...] (this stage's rows), seen as [V, Lmax, ...]; shared
    leaves and the batch [m, b/data, s] whole over pipe; data/tensor sharding stays automatic.
    """

    def __init__(self, pipeline: Pipeline, program: Program, specs, use_dropout: bool,
                 layers_blk, shared, batch, key, scale, axes=(PIPE,), head_split=VocabSplit(PIPE)):
        L = pipeline.layout
        self.graphdef, self.program, self.specs = pipeline.graphdef, program, specs
        self.P, self.V, self.Lmax, self.last = L.num_stages, L.num_chunks, L.max_layers, L.num_vstages - 1
        self.padded = L.is_padded
        self.first_layer = jnp.asarray([L.first_layer(v) for v in range(L.num_vstages)], jnp.int32)
        self.layer_count = jnp.asarray(L.layers_per_vstage, jnp.int32)
        self.train = not program.forward_only
        self.use_dropout, self.key, self.scale, self.batch = use_dropout, key, scale, batch
        self.head_split = head_split
        self.mtp = pipeline.cfg.model.mtp_num_layers is not None  # the head runs the depths on its microbatch
        self.stage = jax.lax.axis_index(PIPE)
        # Everything a stage accumulates varies over the manual axes: the gradients of the
        # (invariant) params are then this stage's and this rank's own, with no implicit psum.
        self.vary = functools.partial(varying, axes=axes)
        layers_blk = jax.tree.map(self.vary, layers_blk)
        self.layers_vl = jax.tree.map(lambda a: a.reshape(self.V, self.Lmax, *a.shape[1:]), layers_blk)
        # Per-stage gradients of the replicated params stay per stage until the final psum.
        self.shared = jax.tree.map(self.vary, shared)
        _, B, S = batch["tokens"].shape  # [microbatches, micro * dp, seq]
        self.act_shape = (B, S, pipeline.cfg.model.hidden_size)
        self.dtype = compute_dtype(pipeline.cfg.model)
        self.zeros_act = self.vary(constrain(jnp.zeros(self.act_shape, self.dtype), ACT_BUFFER[1:]))

    def forward(self, layers_c, shared, x_in, mb_in, v, mb, head_in=None):
        """One virtual stage on one microbatch: (output [b, s, d], its loss share, its layers'
        MoE loss term (value 0, gradient of the MoE losses: every stage's counts), aux).
        head_in: labels and loss mask of the unit the last virtual stage runs in this slot,
        whose head every stage computes a 1/P vocab share of; None (a training forward slot:
        the backward slot's recompute counts the loss) skips the head: loss and head aux are
        zero."""
        model = nnx.merge(self.graphdef, {**shared, "layers": layers_c})
        k_embed, k_layers = stage_keys(jax.random.fold_in(self.key, mb) if self.use_dropout else None)
        positions = mb_in["position_ids"]
        # Every stage embeds, masked to the first virtual stage: no conditional per tick (see
        # the module docstring).
        x = jnp.where(v == 0, model.embed_tokens(mb_in["tokens"], positions, k_embed), x_in)
        x = constrain(x, ACT_BUFFER[1:])
        y, stats = model.run_layers_aux(x, positions, mb_in.get("segment_ids"), k_layers,
                                        self.first_layer[v], self.layer_count[v] if self.padded else None)
        moe_term, moe_aux = aux_terms(stats, mb_in["loss_mask"])

        def head(head_in):
            # The last virtual stage's output, on every stage (one is nonzero: the sum is
            # exact); each computes the logits of its 1/P of the vocab, and the loss's
            # collectives combine them. The loss is counted on the last virtual stage. The sum
            # (and its transpose, which adds the stages' shares of the output's gradient) runs
            # in fp32: XLA:CPU's bf16 all-reduce promotion aborts on it (its reducer carries a
            # sharding annotation), and the shares then add without rounding.
            y_last = jax.lax.psum(jnp.where(v == self.last, y, 0).astype(jnp.float32), PIPE).astype(y.dtype)
            # Multi-token prediction (--mtp-num-layers) runs here, after the last layer as in
            # Megatron's last stage: every stage runs its depths on the same output (in lockstep
            # the tick waits for the slowest stage anyway) with its 1/P of the vocab, so each
            # one's backward carries its share of the gradient, and the sums over `pipe` (the
            # output's above, the shared parameters' after the schedule) add the shares up.
            key = jax.random.fold_in(self.key, head_in.get("mb", mb)) if self.use_dropout else None
            loss_sum, aux, mtp_stats = model.head_and_mtp(y_last, head_in, key, vocab_split=self.head_split)
            if mtp_stats:  # an MoE depth's losses: once, with the head's loss (their metrics add to the layers')
                mtp_moe_term, mtp_moe_aux = aux_terms(mtp_stats, head_in["loss_mask"])
                loss_sum = loss_sum + mtp_moe_term
                aux = {**aux, **{k: a for k, a in mtp_moe_aux.items() if k != "moe_microbatches"}}
            return _masked(v == self.last, (loss_sum * self.scale, aux))

        def no_head():
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(head, mb_in))

        loss, aux = jax.tree.map(self.vary, head(head_in) if head_in is not None else no_head())
        # MoE metrics: each stage's layers, counted once per microbatch (the psum over pipe adds
        # the stages); the microbatch counter only on the last virtual stage.
        if moe_aux:
            moe_aux["moe_microbatches"] = jnp.where(v == self.last, moe_aux["moe_microbatches"], 0.0)
        # moe_term is varying whenever it depends on the layers; without MoE it is a constant 0,
        # made varying so that the backward slot's masked cotangent (varying) fits it.
        aux = {**moe_aux, **{k: a + moe_aux[k] if k in moe_aux else a for k, a in aux.items()}}
        return y, loss, self.vary(moe_term * self.scale), jax.tree.map(self.vary, aux)

    # Gradients accumulate in the compute layout (replicated over data, as Megatron's grad
    # buffer); the ZeRO reduce-scatter to storage happens once, after the schedule. Pinned,
    # because GSPMD otherwise pulls the storage layout into the embedding's scatter-add and lays
    # it out with collective-permutes every tick.

    def pin_layers(self, tree):  # [V, Lmax, ...]
        return jax.tree.map(lambda x, sp: jax.lax.with_sharding_constraint(x, stage_chunks(sp)),
                            tree, self.specs["layers"])

    def pin_shared(self, tree):
        shared_specs = {k: v for k, v in self.specs.items() if k != "layers"}
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, shared_specs)

    def aux_zeros(self):
        """The forward's aux dict (head's and MoE layers'), zero (its structure, from the model)."""
        layers_0 = jax.tree.map(lambda x: x[0], self.layers_vl)
        mb_0 = jax.tree.map(lambda x: x[0], self.batch)
        aux = jax.eval_shape(lambda: self.forward(layers_0, self.shared, self.zeros_act, mb_0, 0, 0, mb_0)[3])
        return jax.tree.map(lambda a: self.vary(jnp.zeros(a.shape, a.dtype)), aux)

    def init_carry(self, live) -> dict:
        def buffer(*lead):  # [*lead, b, s, d]
            spec = ACT_BUFFER if lead else ACT_BUFFER[1:]
            return self.vary(constrain(jnp.zeros((*lead, *self.act_shape), self.dtype), spec))

        # The first tick starts after the step's inputs are complete (the token count in
        # `scale`, ZeRO's gathered params: collectives outside the shard_map), so a device never
        # has those and a tick's collectives in flight at once (see `tick`): the initial carry
        # depends on them, elementwise (`_after`), so no collective is added.
        carry = {"x_recv": _after(live, buffer(), self.scale), "loss": self.vary(jnp.zeros((), jnp.float32)),
                 "aux": self.aux_zeros()}
        if self.train:
            zeros = lambda tree: jax.tree.map(  # noqa: E731  fp32 accumulators, whatever the weights' dtype
                lambda a: self.vary(_after(live, jnp.zeros(a.shape, _accumulated(a.dtype)), a)), tree)
            carry["stash"] = buffer(self.program.num_stash_slots)  # [slot, b, s, d]
            carry["g_recv"] = buffer()
            carry["d_layers"] = self.pin_layers(zeros(self.layers_vl))  # [V, Lmax, ...]
            carry["d_shared"] = self.pin_shared(zeros(self.shared))
        return carry

    def unit(self, a: dict, slot: str):
        """(microbatch, chunk, virtual stage, valid, microbatch inputs, chunk layers, head
        inputs: labels and loss mask of the last stage's microbatch in this slot, with MTP its
        whole microbatch, and "mb" its index) of a slot."""
        mb, c, valid = a[f"{slot}_mb"], a[f"{slot}_chunk"], a[f"{slot}_valid"] > 0
        mb_in = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, mb, keepdims=False), self.batch)
        head_mb = a[f"{slot}_head_mb"]
        head_in = {k: jax.lax.dynamic_index_in_dim(self.batch[k], head_mb, keepdims=False)
                   for k in (self.batch if self.mtp else ("labels", "loss_mask"))}
        head_in["mb"] = head_mb
        if self.V == 1:  # a static index: no per-tick copy of the stage's weights
            layers_c = jax.tree.map(lambda x: x[0], self.layers_vl)  # [Lmax, ...]
        else:
            layers_c = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, c, keepdims=False),
                                    self.layers_vl)  # [Lmax, ...]
        return mb, c, c * self.P + self.stage, valid, mb_in, layers_c, head_in

    def forward_slot(self, carry, a: dict):
        """The forward of this tick's unit on the input that arrived last tick.
        Training: stashes the input for the backward; -> (carry, y, None). Evaluation: runs the
        head too; -> (carry, y, (loss, aux)), masked when the slot has no unit."""
        mb, _, v, valid, mb_in, layers_c, head_in = self.unit(a, "f")
        x_in = carry["x_recv"]  # [b, s, d]
        y, loss, _, aux = self.forward(layers_c, self.shared, x_in, mb_in, v, mb, None if self.train else head_in)
        if self.train:
            return {**carry, "stash": _land(carry["stash"], a["f_stash"], x_in)}, y, None
        return carry, y, _masked(valid, (loss, aux))

    def backward_slot(self, a: dict, x_in, g_recv):
        """Recompute the unit's forward from its stashed input `x_in` and apply its vjp to the
        gradient that arrived last tick (the loss's, on the last virtual stage).
        -> (d_layers of the chunk, d_shared, d_x, (loss, aux)). A masked slot gets zero
        cotangents, so its gradients are exactly zero. The loss and aux are counted here, from
        the recompute: once per unit, and the forward slot needs no head."""
        mb, _, v, valid, mb_in, layers_c, head_in = self.unit(a, "b")

        def run(lp, sp, x):
            y, loss, moe_term, aux = self.forward(lp, sp, x, mb_in, v, mb, head_in)
            return (y, loss, moe_term), aux

        (_, loss, moe_term), vjp, aux = jax.vjp(run, layers_c, self.shared, x_in, has_aux=True)
        at_loss = v == self.last
        g_y = jnp.where(valid & ~at_loss, g_recv, jnp.zeros_like(x_in))
        # The MoE losses of this stage's layers are part of the objective on every stage.
        d_lc, d_sh, d_x = vjp((g_y, self.vary(jnp.where(valid & at_loss, 1.0, 0.0).astype(loss.dtype)),
                               self.vary(jnp.where(valid, 1.0, 0.0).astype(moe_term.dtype))))
        # The expert biases' "gradients" are the loads the recompute routed (moe.py), whatever the
        # cotangent: a masked slot's routing of microbatch 0 is no one's.
        d_lc = jax.tree_util.tree_map_with_path(
            lambda p, d: jnp.where(valid, d, jnp.zeros_like(d)) if is_expert_bias(p) else d, d_lc)
        # An MoE MTP depth's (shared parameters): every stage routed the head's microbatch; its
        # loads are the last virtual stage's, when it had a unit.
        d_sh = jax.tree_util.tree_map_with_path(
            lambda p, d: jnp.where(valid & at_loss, d, jnp.zeros_like(d)) if is_expert_bias(p) else d, d_sh)
        return d_lc, self.pin_shared(d_sh), d_x, _masked(valid, (loss, aux))

    def accumulate(self, carry, a: dict, d_lc, d_sh):
        """Add one backward's gradients to the accumulators ([V, Lmax, ...] and shared)."""
        c = 0 if self.V == 1 else a["b_chunk"]  # a static index when there is one chunk
        d_layers = jax.tree_util.tree_map_with_path(  # delayed fp8 scaling's amax records: a max
            lambda p, acc, d: (acc.at[c].max if fp8.is_history(p) else acc.at[c].add)(d.astype(acc.dtype)),
            carry["d_layers"], d_lc)
        d_shared = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), carry["d_shared"], d_sh)
        return {**carry, "d_layers": self.pin_layers(d_layers), "d_shared": self.pin_shared(d_shared)}

    def tick(self, carry, row, forward: bool, backward: bool):
        """One tick of a phase: the forward slot, then the backward slot (each only if the phase
        uses it), then the activation goes to stage s+1 and then the gradient to s-1.

        The slots hold collectives of their own (tensor and sequence parallelism, inside the
        layer scans, the embedding and the head), and XLA:CPU runs independent operations
        concurrently, each waiting collective holding a thread of its intra-op pool: too many
        at once starved the pool and deadlocked the fake CPU mesh (see
        `xla_flags.cpu_collective_threads`, the fix). `_after` also chains the slots, so a
        device has one chain of collectives in flight: the backward slot waits for the
        forward's output, the activation's send for the backward's input gradient (the end of
        its chain), the gradient's send for the activation's."""
        a = {k: r[self.stage] for k, r in row.items()}  # this stage's slots, scalars
        for slot in "fb":  # the last stage's microbatch, whose head every stage shares
            a[f"{slot}_head_mb"] = row[f"{slot}_mb"][self.P - 1]
        ring = range(self.P)
        live = a["b_stash"] >= 0  # always true; the compiler cannot know it
        if forward:
            carry, y, counted = self.forward_slot(carry, a)
            if counted is not None:  # evaluation: after the head's collectives
                carry = self.count(carry, counted)
                y = _after(live, y, carry["loss"])
        if backward:
            x_b = carry["stash"][a["b_stash"]]  # [b, s, d], read after the forward slot stored
            if forward:
                x_b = _after(live, x_b, y)
            d_lc, d_sh, d_x, counted = self.backward_slot(a, x_b, carry["g_recv"])
            carry = self.count(self.accumulate(carry, a, d_lc, d_sh), counted)
            if forward:
                y = _after(live, y, d_x)  # d_x ends the backward's chain of collectives
        if forward:
            carry["x_recv"] = jax.lax.ppermute(y, PIPE, [(i, (i + 1) % self.P) for i in ring])
        if backward:
            if forward:
                d_x = _after(live, d_x, carry["x_recv"])
            carry["g_recv"] = jax.lax.ppermute(d_x, PIPE, [(i, (i - 1) % self.P) for i in ring])
        return carry, None

    @staticmethod
    def count(carry, counted):
        loss, aux = counted
        return {**carry, "loss": carry["loss"] + loss, "aux": jax.tree.map(jnp.add, carry["aux"], aux)}

    def run(self, arrays):
        """One scan per phase; (loss and aux summed over pipe, d_layers [V*Lmax, ...], d_shared
        per stage: `Pipeline._sum_stages` sums them; per rank, the sums over `data` are left to
        the caller)."""
        carry = self.init_carry(arrays["b_stash"][0, self.stage] >= 0)  # always true at run time
        for p in self.program.phases:
            rows = {k: x[p.start:p.stop] for k, x in arrays.items()}  # [ticks of p, stages]
            step = functools.partial(self.tick, forward=p.forward, backward=p.backward)
            carry, _ = jax.lax.scan(step, carry, rows)
        if not self.train:
            loss, aux = jax.lax.psum((carry["loss"], carry["aux"]), PIPE)
            return loss, {}, {}, aux
        loss, aux = jax.lax.psum((carry["loss"], carry["aux"]), PIPE)
        d_shared = carry["d_shared"]
        d_layers = jax.tree.map(lambda a: a.reshape(self.V * self.Lmax, *a.shape[2:]), carry["d_layers"])
        return loss, d_layers, d_shared, aux


def _accumulated(dtype):
    """The dtype a gradient of a `dtype` leaf is accumulated in: fp32 for bf16/fp16 weights."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def _after(live, x, dep):
    """`x`, available only once `dep` (a tensor shaped and laid out like `x`, or a scalar) is:
    a select on a predicate that is always true at run time. Elementwise, so it adds no
    collective under any sharding of `x`."""
    return jnp.where(live, x, dep.astype(x.dtype))


def _masked(valid, tree):
    """`tree` where the slot is valid, zeros where it ran masked."""
    return jax.tree.map(lambda x: jnp.where(valid, x, jnp.zeros_like(x)), tree)


def _land(buf, slot, value):
    """Write `value` into buffer slot `slot`, or leave the buffer as is when slot is -1."""
    i = jnp.maximum(slot, 0)
    keep = buf[i]
    return buf.at[i].set(jnp.where(slot >= 0, value, keep))
