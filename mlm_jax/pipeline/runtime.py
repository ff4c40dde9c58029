"""The pipeline runtime: one SPMD program that executes any schedule table.

`schedules` says what each stage does in each tick; this module turns a table into int32
arrays (`Program`) and runs them inside one `jax.shard_map` that is manual over `pipe` only
(data, tensor and sequence sharding stay automatic inside each stage). There is no Python
dispatch per microbatch: the program is a `lax.scan` over ticks, and in every tick each stage
looks its action up in the arrays (indexed by `axis_index('pipe')`) and runs it through
`lax.switch`: idle, forward or backward. Every tick then moves one activation forward and one
gradient backward with `ppermute` (stage s -> s+1 and s -> s-1, wrapping around for the
interleaved schedule's chunk hand-over), whether or not the neighbour needs it this tick.

Stages and their state
----------------------
- Layer params are stacked [P*V*Lmax, ...] and sharded over `pipe` (see `layout`): each stage
  sees its own [V, Lmax, ...] and picks chunk c per tick. Embedding, position embedding, final
  norm and LM head are replicated over `pipe`; the first virtual stage embeds, the last one
  runs the head and the loss. Their gradients are accumulated per stage and summed over `pipe`
  once at the end of the step: that sum is also what adds the tied embedding's two gradients
  (lookup on the first stage, LM head on the last).
- A stage keeps the *inputs* of its forwards until their backward (the activation buffer), and
  the gradients that arrived from its successor until it can use them (the gradient buffer).
  Slots are assigned ahead of time from the table (`build_program`), so the buffers hold exactly
  the schedule's peak: m microbatches for GPipe, about P for 1F1B (see `Program`).
- The backward of a stage recomputes its forward with `jax.vjp` from the stashed input, and
  applies the vjp at once. This is activation recomputation at stage granularity: one extra
  forward per microbatch (Megatron's full recompute costs the same), in exchange for stashing
  one [batch, seq, embed] tensor per in-flight microbatch instead of every layer's activations.
  `--recompute-granularity` still applies inside the recomputed stage (it bounds the memory of
  the one vjp alive at a time).

A virtual stage runs the model's stage API (`embed_tokens` on the first, `run_layers` on its
chunk, padded rows included, `head` on the last); this file holds no copy of the layer loop,
the loss or the dtype rules. The loss is the unpipelined one: the sum of masked token losses
over the global batch, divided by the global batch's token count; the head's `aux` scalars are
summed over microbatches and stages; dropout keys are folded from (step key, microbatch index,
layer index) exactly as `parallelize` does, so pipelined and unpipelined runs draw the same masks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.config import Config, ConfigError, pipeline_plan
from mlm_jax.models.gpt import stage_keys
from mlm_jax.models.layers import compute_dtype
from mlm_jax.models.moe import aux_terms
from mlm_jax.pipeline import schedules
from mlm_jax.pipeline.layout import map_layer_leaves
from mlm_jax.sharding.mesh import PIPE
from mlm_jax.sharding.rules import active_rules, constrain, use_rules
from mlm_jax.sharding.specs import pipe_blocks, pipe_stored, replicated, stage_chunks

KIND_IDLE, KIND_FORWARD, KIND_BACKWARD = (schedules.KIND_CODES[k] for k in ("idle", "F", "B"))
ACT_BUFFER = (None, "batch", "seq", "embed")  # [slot, batch, seq, embed], like a block boundary


# --------------------------------------------------------------------------- plan


plan = pipeline_plan  # (schedule name, layer layout) of a config


# --------------------------------------------------------------------------- program


@dataclasses.dataclass(frozen=True)
class Program:
    """A schedule table compiled for the runtime.

    arrays, each int32 [ticks, stages]:
      kind, microbatch, chunk  the action (`schedules.to_arrays`);
      act_slot                 activation-buffer slot holding this action's input (v > 0);
      grad_slot                gradient-buffer slot holding a backward's output gradient
                               (v < P*V-1; the last virtual stage starts from the loss);
      recv_act, recv_grad      slot where the activation / gradient arriving at the end of
                               this tick is written, -1 when nothing arrives.
    A slot is taken when its tensor arrives and freed by the backward that uses it last, so
    num_act_slots / num_grad_slots are the schedule's true peak of stashed microbatches.
    """

    name: str
    num_stages: int
    num_chunks: int
    num_microbatches: int
    forward_only: bool
    table: schedules.Table
    arrays: dict[str, np.ndarray]
    num_act_slots: int
    num_grad_slots: int

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

    def find(self, stage: int, key) -> int:
        return self.owner[stage][key]

    def release(self, stage: int, key) -> int:
        slot = self.owner[stage].pop(key)
        self.free[stage].append(slot)
        return slot

    @property
    def peak(self) -> int:
        return max(self.used)


@functools.cache
def build_program(name: str, P: int, m: int, V: int = 1, forward_only: bool = False) -> Program:
    """The table of schedule `name` (or its forwards only, for evaluation) with buffer slots."""
    table = (schedules.forward_only(P, m, V) if forward_only
             else schedules.build_schedule(name, P, m, V))
    if not forward_only:
        schedules.validate_schedule(table, P, m, V)
    arrays = schedules.to_arrays(table)
    T, last = len(table), P * V - 1
    for key in ("act_slot", "grad_slot"):
        arrays[key] = np.zeros((T, P), np.int32)
    for key in ("recv_act", "recv_grad"):
        arrays[key] = np.full((T, P), -1, np.int32)
    acts, grads = _Slots(P), _Slots(P)
    for t, row in enumerate(table):
        # Reads (and frees) during the tick...
        for s, a in enumerate(row):
            if a.is_idle:
                continue
            v = a.chunk * P + s
            key = (a.microbatch, a.chunk)
            if v > 0:
                done = a.kind == schedules.BACKWARD or forward_only
                arrays["act_slot"][t, s] = (acts.release if done else acts.find)(s, key)
            if a.kind == schedules.BACKWARD and v < last:
                arrays["grad_slot"][t, s] = grads.release(s, key)
        # ...then what the neighbours sent lands at the end of it.
        for s, a in enumerate(row):
            if a.is_idle:
                continue
            v = a.chunk * P + s
            if a.kind == schedules.FORWARD and v < last:
                dest, chunk = (s + 1) % P, a.chunk + (s == P - 1)
                arrays["recv_act"][t, dest] = acts.take(dest, (a.microbatch, chunk))
            if a.kind == schedules.BACKWARD and v > 0:
                dest, chunk = (s - 1) % P, a.chunk - (s == 0)
                arrays["recv_grad"][t, dest] = grads.take(dest, (a.microbatch, chunk))
    return Program(name, P, V, m, forward_only, table, arrays,
                   num_act_slots=max(acts.peak, 1), num_grad_slots=max(grads.peak, 1))


# --------------------------------------------------------------------------- runtime


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; older releases: aval.vma
    return manual.varying if manual is not None else getattr(aval, "vma", frozenset())


def _varying(x):
    """Mark `x` as varying over `pipe` (a no-op if it already is)."""
    if PIPE in _varying_axes(x):
        return x
    return jax.lax.pcast(x, PIPE, to="varying")


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

    def stored_specs(self, specs: dict) -> dict:
        return map_layer_leaves(pipe_stored, specs)

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
        total_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
        if loss_scale is not None:
            total_tokens = total_tokens / loss_scale  # the `scale` below: loss_scale / tokens
        params = jax.lax.with_sharding_constraint(params, compute_sharding)  # ZeRO: all-gather
        program = self.program(batch["tokens"].shape[0])
        specs = jax.tree.map(lambda sh: sh.spec, compute_sharding)
        loss, grads, aux = self._run(program, params, batch, key, 1.0 / total_tokens, specs)
        return loss, jax.lax.with_sharding_constraint(grads, param_sharding), aux

    def loss_sum(self, params: dict, batch: dict, compute_sharding) -> jax.Array:
        """Sum of masked token losses of the batch, no dropout (evaluation)."""
        params = jax.lax.with_sharding_constraint(params, compute_sharding)
        program = self.program(batch["tokens"].shape[0], forward_only=True)
        return self._run(program, params, batch, None, jnp.float32(1.0))[0]

    def _run(self, program: Program, params: dict, batch: dict, key, scale, specs=None):
        """(loss, grads or None, aux) of `program` on the global batch, in one shard_map."""
        train = not program.forward_only
        layers = params["layers"]
        shared = {k: v for k, v in params.items() if k != "layers"}
        arrays = {k: jnp.asarray(v) for k, v in program.arrays.items()}
        use_dropout = key is not None
        key = jax.random.key(0) if key is None else key

        def body(layers_blk, shared, batch, key, scale, arrays):
            stage = _Stage(self, program, specs, use_dropout, layers_blk, shared, batch, key, scale)
            return stage.run(arrays)

        rep = replicated()
        run = jax.shard_map(
            body, mesh=self.mesh,
            in_specs=(pipe_blocks(), rep, rep, rep, rep, rep),
            out_specs=(rep, pipe_blocks(), rep, rep),
            axis_names=frozenset({PIPE}),
        )
        loss, d_layers, d_shared, aux = run(layers, shared, batch, key, jnp.asarray(scale, jnp.float32), arrays)
        return loss, ({**d_shared, "layers": d_layers} if train else None), aux


class _Stage:
    """One stage's view inside the shard_map: its layer block, the replicated params, the batch.

    Per device: layer leaves [V*Lmax, ...] (this stage's rows), seen as [V, Lmax, ...]; shared
    leaves and the batch [m, b/data, s] whole over pipe; data/tensor sharding stays automatic.
    """

    def __init__(self, pipeline: Pipeline, program: Program, specs, use_dropout: bool,
                 layers_blk, shared, batch, key, scale):
        L = pipeline.layout
        self.graphdef, self.program, self.specs = pipeline.graphdef, program, specs
        self.P, self.V, self.Lmax, self.last = L.num_stages, L.num_chunks, L.max_layers, L.num_vstages - 1
        self.padded = L.is_padded
        self.first_layer = jnp.asarray([L.first_layer(v) for v in range(L.num_vstages)], jnp.int32)
        self.layer_count = jnp.asarray(L.layers_per_vstage, jnp.int32)
        self.train = not program.forward_only
        self.use_dropout, self.key, self.scale, self.batch = use_dropout, key, scale, batch
        self.stage = jax.lax.axis_index(PIPE)
        self.layers_vl = jax.tree.map(lambda a: a.reshape(self.V, self.Lmax, *a.shape[1:]), layers_blk)
        # Per-stage gradients of the replicated params stay per stage until the final psum.
        self.shared = jax.tree.map(_varying, shared)
        _, B, S = batch["tokens"].shape  # [microbatches, micro * dp, seq]
        self.act_shape = (B, S, pipeline.cfg.model.hidden_size)
        self.dtype = compute_dtype(pipeline.cfg.model)
        self.zeros_act = _varying(constrain(jnp.zeros(self.act_shape, self.dtype), ACT_BUFFER[1:]))

    def forward(self, layers_c, shared, x_in, mb_in, v, mb):
        """One virtual stage on one microbatch: (output [b, s, d], its loss share, its layers'
        MoE loss term (value 0, gradient of the MoE losses: every stage's counts), aux)."""
        model = nnx.merge(self.graphdef, {**shared, "layers": layers_c})
        k_embed, k_layers = stage_keys(jax.random.fold_in(self.key, mb) if self.use_dropout else None)
        positions = mb_in["position_ids"]
        x = jax.lax.cond(v == 0, lambda: _embed(model, mb_in["tokens"], positions, k_embed), lambda: x_in)
        x = constrain(x, ACT_BUFFER[1:])
        y, stats = model.run_layers_aux(x, positions, mb_in.get("segment_ids"), k_layers,
                                        self.first_layer[v], self.layer_count[v] if self.padded else None)
        moe_term, moe_aux = aux_terms(stats, mb_in["loss_mask"])

        def head():
            loss_sum, aux = model.head(y, mb_in["labels"], mb_in["loss_mask"])
            return jax.tree.map(_varying, (loss_sum * self.scale, aux))  # as no_head's

        def no_head():
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(head))
            return jax.tree.map(_varying, zeros)

        loss, aux = jax.lax.cond(v == self.last, head, no_head)
        # MoE metrics: each stage's layers, counted once per microbatch (the psum over pipe adds
        # the stages); the microbatch counter only on the last virtual stage.
        if moe_aux:
            moe_aux["moe_microbatches"] = jnp.where(v == self.last, 1.0, 0.0)
        return y, loss, moe_term * self.scale, jax.tree.map(_varying, {**aux, **moe_aux})

    # Gradients accumulate in the compute layout (replicated over data, as Megatron's grad
    # buffer); the ZeRO reduce-scatter to storage happens once, after the schedule. Pinned,
    # because GSPMD otherwise pulls the storage layout into the embedding's scatter-add and lays
    # it out with collective-permutes inside a branch (see `_embed`).

    def pin_layers(self, tree):  # [V, Lmax, ...]
        if self.specs is None:
            return tree
        return jax.tree.map(lambda x, sp: jax.lax.with_sharding_constraint(x, stage_chunks(sp)),
                            tree, self.specs["layers"])

    def pin_shared(self, tree):
        if self.specs is None:
            return tree
        shared_specs = {k: v for k, v in self.specs.items() if k != "layers"}
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, shared_specs)

    def aux_zeros(self):
        """The forward's aux dict (head's and MoE layers'), zero (its structure, from the model)."""
        layers_0 = jax.tree.map(lambda x: x[0], self.layers_vl)
        mb_0 = jax.tree.map(lambda x: x[0], self.batch)
        aux = jax.eval_shape(lambda: self.forward(layers_0, self.shared, self.zeros_act, mb_0, 0, 0)[3])
        return jax.tree.map(lambda a: _varying(jnp.zeros(a.shape, a.dtype)), aux)

    def init_carry(self) -> dict:
        def buffer(slots):  # [slot, b, s, d]
            return _varying(constrain(jnp.zeros((slots, *self.act_shape), self.dtype), ACT_BUFFER))

        carry = {"acts": buffer(self.program.num_act_slots), "loss": _varying(jnp.zeros((), jnp.float32)),
                 "aux": self.aux_zeros()}
        if self.train:
            zeros = lambda tree: jax.tree.map(lambda a: _varying(jnp.zeros_like(a)), tree)  # noqa: E731
            carry["grads_in"] = buffer(self.program.num_grad_slots)
            carry["d_layers"] = self.pin_layers(zeros(self.layers_vl))  # [V, Lmax, ...]
            carry["d_shared"] = self.pin_shared(zeros(self.shared))
        return carry

    def action(self, carry, a: dict):
        """This tick's action -> (sent forward, sent backward, loss, aux, d_layers_c, d_shared).

        Branches see only this tick's tensors and return this tick's deltas: a branch that
        passed the buffers or accumulators through would copy them every tick."""
        mb, c = a["microbatch"], a["chunk"]
        v = c * self.P + self.stage
        mb_in = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, mb, keepdims=False), self.batch)
        if self.V == 1:  # a static index: no per-tick copy of the stage's weights
            layers_c = jax.tree.map(lambda x: x[0], self.layers_vl)  # [Lmax, ...]
        else:
            layers_c = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, c, keepdims=False),
                                    self.layers_vl)  # [Lmax, ...]
        shared, zeros_act = self.shared, self.zeros_act
        x_in = carry["acts"][a["act_slot"]]  # [b, s, d]
        g_in = carry["grads_in"][a["grad_slot"]] if self.train else None  # [b, s, d]

        def idle():
            zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
            return (zeros_act, zeros_act, _varying(jnp.zeros((), jnp.float32)), self.aux_zeros(),
                    zeros(layers_c), zeros(shared))

        def forward():  # aux is counted here, once per microbatch (not in the recompute)
            y, loss, _, aux = self.forward(layers_c, shared, x_in, mb_in, v, mb)
            *_, d_lc, d_sh = idle()
            return y, zeros_act, loss, aux, d_lc, d_sh

        def backward():
            (_, loss, moe_term), vjp = jax.vjp(
                lambda lp, sp, x: self.forward(lp, sp, x, mb_in, v, mb)[:3], layers_c, shared, x_in)
            at_loss = v == self.last
            g_y = jnp.where(at_loss, jnp.zeros_like(x_in), g_in)
            # The MoE losses of this stage's layers are part of the objective on every stage.
            d_lc, d_sh, d_x = vjp((g_y, jnp.where(at_loss, 1.0, 0.0).astype(loss.dtype),
                                   jnp.ones_like(moe_term)))
            return zeros_act, d_x, jnp.zeros_like(loss), self.aux_zeros(), d_lc, self.pin_shared(d_sh)

        return jax.lax.switch(a["kind"], [idle, forward, backward] if self.train else [idle, forward])

    def tick(self, carry, row):
        a = {k: r[self.stage] for k, r in row.items()}  # this stage's action, scalars
        send_fwd, send_bwd, loss, aux, d_lc, d_sh = self.action(carry, a)
        carry = {**carry, "loss": carry["loss"] + loss, "aux": jax.tree.map(jnp.add, carry["aux"], aux)}
        if self.train:
            carry["d_layers"] = self.pin_layers(
                jax.tree.map(lambda acc, d: acc.at[a["chunk"]].add(d), carry["d_layers"], d_lc))
            carry["d_shared"] = self.pin_shared(jax.tree.map(jnp.add, carry["d_shared"], d_sh))
        ring = range(self.P)
        got_act = jax.lax.ppermute(send_fwd, PIPE, [(i, (i + 1) % self.P) for i in ring])
        carry["acts"] = _land(carry["acts"], a["recv_act"], got_act)
        if self.train:
            got_grad = jax.lax.ppermute(send_bwd, PIPE, [(i, (i - 1) % self.P) for i in ring])
            carry["grads_in"] = _land(carry["grads_in"], a["recv_grad"], got_grad)
        return carry, None

    def run(self, arrays):
        """The scan over ticks; (loss, d_layers [V*Lmax, ...], d_shared, aux), summed over pipe."""
        carry, _ = jax.lax.scan(self.tick, self.init_carry(), arrays)
        loss, aux = jax.lax.psum((carry["loss"], carry["aux"]), PIPE)
        if not self.train:
            return loss, {}, {}, aux
        d_layers = jax.tree.map(lambda a: a.reshape(self.V * self.Lmax, *a.shape[2:]), carry["d_layers"])
        return loss, d_layers, jax.lax.psum(carry["d_shared"], PIPE), aux


def _embed(model, tokens_bs, positions_bs, key):
    """The embedding, its output whole along seq. With sequence parallelism GSPMD otherwise
    lays the vocab-parallel lookup out with collective-permutes, and a collective-permute inside
    a branch that only some stages take deadlocks (XLA:CPU rendezvouses every device on it).
    Sharding the result over seq afterwards is a local slice. The split over `context` stays
    (the tokens arrive split so; the lookup is local along seq)."""
    rules = active_rules()
    ctx = dict(rules).get("context_seq")
    with use_rules(tuple((n, ctx if n == "seq" else a) for n, a in rules)):
        return model.embed_tokens(tokens_bs, positions_bs, key)


def _land(buf, slot, value):
    """Write `value` into buffer slot `slot`, or leave the buffer as is when slot is -1."""
    i = jnp.maximum(slot, 0)
    keep = buf[i]
    return buf.at[i].set(jnp.where(slot >= 0, value, keep))
