"""Compile-only truths: the collectives XLA emits and the per-device memory of the state.

Megatron's analysis, per transformer layer, with tensor parallelism (TP): 2 all-reduces of the
[batch, seq, embed] activations in forward (after attention, after the MLP) and 2 in backward
(the input gradients of the two column-parallel matmuls). With sequence parallelism (SP) each
becomes an all-gather before a column-parallel matmul and a reduce-scatter after a row-parallel
one. XLA:CPU spells a reduce-scatter as an all-reduce whose every use keeps only this device's
slice (see mlm_jax/sharding/hlo.py); it is counted as `scattered`.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.config import ParallelConfig
from mlm_jax.sharding.hlo import collectives, count
from mlm_jax.sharding.mesh import DATA, EXPERT
from tests.parallel_util import SEQ, build, fixed_batch, layer_loop, place
from tests.tiny_flags import xla_flags_for

MICRO = 2
ACT = (MICRO, SEQ, 64)  # one microbatch's [batch, seq, embed] on a data-parallel rank (dp = 2)
LAYOUTS = {
    "tp4": (ParallelConfig(tensor_model_parallel_size=4), MICRO),  # dp2 x tp4
    "tp4_sp": (ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True), MICRO),
    "dp8": (ParallelConfig(), 1),  # 2 microbatches
    "dp8_zero": (ParallelConfig(use_distributed_optimizer=True), 1),
    "dp8_dropout": (ParallelConfig(), 1, (("hidden_dropout", 0.1), ("attention_dropout", 0.1))),
    "dp8_zero_bf16": (ParallelConfig(use_distributed_optimizer=True), 1, (("bf16", True),)),
    "cp2_zero": (ParallelConfig(context_parallel_size=2, use_distributed_optimizer=True), 1),  # dp4 x cp2
    "dp8_moe": (ParallelConfig(), 1, (("num_experts", 4), ("moe_router_topk", 2), ("moe_aux_loss_coeff", 0.01),
                                      ("moe_z_loss_coeff", 0.001))),  # dropless
    # dp4 x ep2 and dp2 x ep2 x tp2 + ZeRO, dropless, all-to-all dispatch
    "dp8_moe_capacity": (ParallelConfig(), 1, (("num_experts", 4), ("moe_router_topk", 2),
                                               ("moe_expert_capacity_factor", 0.75))),  # probs policy
    "ep2_moe": (ParallelConfig(expert_model_parallel_size=2), 1, (("num_experts", 4), ("moe_router_topk", 2),
                                                                  ("moe_aux_loss_coeff", 0.01))),
    "ep2_tp2_zero_moe": (ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                                        use_distributed_optimizer=True), 2,
                         (("num_experts", 4), ("moe_router_topk", 2), ("moe_aux_loss_coeff", 0.01))),
    "tp4_moe": (ParallelConfig(tensor_model_parallel_size=4), MICRO,  # dp2 x tp4, no expert parallelism
                (("num_experts", 4), ("moe_router_topk", 2), ("moe_aux_loss_coeff", 0.01))),
}


@pytest.fixture(scope="module")
def compiled_text():
    out = {}
    for name, (par, micro, *model) in LAYOUTS.items():
        pz = build(par, micro, fresh=True, **dict(*model))
        state = pz.init(0)
        with layer_loop():  # the per-layer counts below read the layer loop's body
            lowered = pz.train_step.lower(state, place(pz, fixed_batch()), jax.random.key(0))
            out[name] = (pz, lowered.compile().as_text())
    return out


@pytest.fixture(scope="module")
def compiled_hlo(compiled_text):
    return {name: (pz, collectives(text)) for name, (pz, text) in compiled_text.items()}


def test_tensor_parallel_has_megatrons_all_reduces(compiled_hlo):
    pz, found = compiled_hlo["tp4"]
    # Per layer (the scanned body appears once whatever the depth).
    assert count(found, "all-reduce", ACT, backward=False, scattered=False) == 2
    assert count(found, "all-reduce", ACT, backward=True, scattered=False) == 2
    assert count(found, "all-reduce", ACT, backward=False, scattered=True) == 0
    assert not [c for c in found if c.kind == "all-gather"], "plain TP must not gather anything"
    # Vocab-parallel embedding and loss: no collective ever carries the full (padded) vocab.
    vocab = pz.cfg.model.vocab
    assert all(vocab not in shape for c in found for shape in c.shapes), [
        c for c in found if any(vocab in s for s in c.shapes)
    ]


def test_experts_stay_split_over_tensor_without_expert_parallelism(compiled_hlo):
    """dp2 x tp4, ep 1: each rank runs its `tensor` share of every expert's hidden dim on its
    rows; no collective carries a layer's experts whole (Mixtral's tp8 x dp8 step gathered them
    all, every layer's, 7 GiB a device)."""
    pz, found = compiled_hlo["tp4_moe"]
    m = pz.cfg.model
    experts = m.num_experts * m.hidden_size * m.moe_ffn_size  # one layer's w1 (or w2)
    gathered = [c for c in found if c.kind == "all-gather" and any(math.prod(s) >= experts / 4 for s in c.shapes)]
    assert gathered == []


def test_sequence_parallel_turns_all_reduce_into_gather_and_scatter(compiled_hlo):
    """Per layer, Megatron's SP: forward, two sequence all-gathers (before QKV and fc1) and two
    reduce-scatters; backward, the reduce-scatters' transposes (two all-gathers), the same two
    input gathers again (`layers.column_parallel` keeps the s/t shard, not the gathered input)
    and two reduce-scatters of the input gradients."""
    pz, found = compiled_hlo["tp4_sp"]
    for backward in (False, True):
        assert count(found, "all-gather", ACT, backward=backward) == (4 if backward else 2)
        assert count(found, "all-reduce", ACT, backward=backward, scattered=True) == 2
        assert count(found, "all-reduce", ACT, backward=backward, scattered=False) == 0
    vocab = pz.cfg.model.vocab
    assert all(vocab not in shape for c in found for shape in c.shapes)


def _state_bytes(parallel: ParallelConfig) -> int:
    """Per-device bytes of the step's arguments (state + batch) from XLA's memory analysis."""
    pz = build(parallel, MICRO)
    state = pz.init(0)
    batch = place(pz, fixed_batch())
    analysis = pz.train_step.lower(state, batch, jax.random.key(0)).compile().memory_analysis()
    return analysis.argument_size_in_bytes


def test_distributed_optimizer_shards_master_params_and_moments_over_data():
    """dp=4 x tp=2: fp32 params + two Adam moments (12 bytes/param) drop ~4x per device."""
    plain = _state_bytes(ParallelConfig(tensor_model_parallel_size=2))
    zero = _state_bytes(ParallelConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True))
    # Ideal is 1/4; norm vectors and biases that dp cannot split evenly stay replicated.
    assert zero < 0.3 * plain, (zero, plain)


# ---------------------------------------------------------------- context parallelism

LONG = 4096  # a long sequence on a one-layer model: attention's [s, s] scores dominate memory


def _long_context_compiled(cp: int):
    """(temp bytes per device, collectives) of the train step, seq 4096, on `cp` devices (dp=1)."""
    import dataclasses

    from mlm_jax.build import parallelize
    from mlm_jax.sharding import make_mesh
    from mlm_jax.validation import finalize
    from tests.parallel_util import tiny_config

    cfg = tiny_config(ParallelConfig(context_parallel_size=cp), 1, num_layers=1, hidden_size=32,
                      num_attention_heads=4, num_query_groups=2, position_embedding_type="rope")
    cfg = cfg.replace(train=dataclasses.replace(cfg.train, seq_length=LONG, global_batch_size=1),
                      model=dataclasses.replace(cfg.model, max_position_embeddings=LONG))
    devices = jax.devices()[:cp]
    cfg = finalize(cfg, len(devices))
    pz = parallelize(cfg, make_mesh(cfg.parallel, devices))
    state = pz.init(0)  # a one-layer d=32 model: tiny; only the sequence is long
    batch = {k: jax.ShapeDtypeStruct((1, 1, LONG), jax.numpy.float32 if k == "loss_mask" else jax.numpy.int32,
                                     sharding=pz.batch_sharding())
             for k in ("tokens", "labels", "loss_mask", "position_ids")}
    compiled = pz.train_step.lower(state, batch, jax.random.key(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes, collectives(compiled.as_text())


@pytest.fixture(scope="module")
def long_context():
    from mlm_jax.models import attention

    compiled = {cp: _long_context_compiled(cp) for cp in (2, 4)}
    # The one device's attention as one [s, s] square: on a CPU it runs in causal query blocks
    # (attention.causal_blocks), which hold less than the square; the ring is measured against it.
    kept, attention._CAUSAL_BLOCKS = attention._CAUSAL_BLOCKS, {}
    try:
        compiled[1] = _long_context_compiled(1)
    finally:
        attention._CAUSAL_BLOCKS = kept
    return compiled


def test_context_parallel_temp_memory_falls_as_one_over_c(long_context):
    temp = {cp: long_context[cp][0] for cp in long_context}
    # The [s, s] scores of the one layer dominate; the ring keeps one [s/C, s/C] block alive.
    assert temp[2] < 0.55 * temp[1], temp
    assert temp[4] < 0.55 * temp[2], temp


def test_ring_message_is_one_kv_block(long_context):
    for cp in (2, 4):
        found = long_context[cp][1]
        permutes = [c for c in found if c.kind == "collective-permute"]
        block = (1, LONG // cp, 2, 8)  # [batch, seq/C, kv groups, head dim]: GQA's 2 groups, not 4 heads
        shapes = {s for c in permutes for s in c.shapes}
        assert shapes == {block}, (cp, shapes)
        assert not [c for c in found if c.kind == "all-gather" and any(LONG in s for s in c.shapes)]


# ------------------------------------------------------------------ gradients reduced once per step

_COLLECTIVE = re.compile(r"\s(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")


def _groups(line: str, n: int) -> list[list[int]]:
    """The device groups of one collective instruction, from either spelling XLA prints:
    explicit `{{0,1},{2,3}}`, iota `[groups,size]<=[dims]T(perm)`, or `mesh['axis_0'=a,...] {'axis_k',...}` with optional
    `device_ids=([dims]T(perm))` (an iota device list, reshaped and transposed)."""
    m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if m:
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:  # iota groups: arange(n) reshaped to dims, transposed, cut into [groups, size]
        ids = np.arange(n).reshape([int(d) for d in m.group(3).split(",")])
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                  r"\{([^}]*)\}", line)
    if not m:
        m2 = re.search(r"source_target_pairs=\{(.*?)\}\}?", line)
        if m2:  # collective-permute: each pair is a group
            return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", line)]
        return [list(range(n))]  # no groups printed: every device
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = np.arange(n)
    if m.group(2):
        dims = [int(d) for d in m.group(2).split(",")]
        ids = ids.reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(p) for p in m.group(3).split(",")])
    ids = ids.reshape(sizes)
    reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
    kept = [i for i in range(len(sizes)) if i not in reduced]
    moved = np.moveaxis(ids, kept + reduced, list(range(len(sizes))))
    return moved.reshape(-1, int(np.prod([sizes[i] for i in reduced]))).tolist()


def _lines_in_loops(text: str) -> list[str]:
    """The instructions of every computation a while loop runs (its body and condition, and
    what they call, transitively), from the compiled HLO text. (An instruction's op_name is no
    guide: XLA's combiners merge the metadata of what they merge.)"""
    comps, current = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            current = head.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)

    def callees(lines, keys=r"body|condition|calls|to_apply"):
        out = set()
        for line in lines:
            out.update(re.findall(rf"(?:{keys})=%([\w.\-]+)", line))
            for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", line):
                out.update(re.findall(r"%([\w.\-]+)", group))
        return out

    todo = callees([x for lines in comps.values() for x in lines if " while(" in x], r"body|condition")
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo |= callees(comps.get(name, []))
    return [x for name in seen for x in comps.get(name, [])]


def _data_parallel_collectives_in_loops(pz, text: str) -> list[str]:
    """Collectives inside a while loop (microbatch scan or layer scan) whose groups span
    devices at different `data` coordinates (or `expert` ones: expert parallelism is carved out
    of data parallelism, its ranks hold their own rows)."""
    dims = [pz.mesh.axis_names.index(a) for a in (DATA, EXPERT) if a in pz.mesh.axis_names]
    coord = {d.id: tuple(idx[i] for i in dims) for idx, d in np.ndenumerate(pz.mesh.devices)}
    bad = []
    for line in _lines_in_loops(text):
        if not _COLLECTIVE.search(line):
            continue
        groups = _groups(line, pz.mesh.devices.size)
        if any(len({coord[i] for i in g}) > 1 for g in groups):
            bad.append(line.strip()[:200])
    return bad


def _largest_result(line: str) -> int:
    """Elements of the largest array a collective instruction's line produces (a line cut
    before the instruction's name counts every shape on it: never fewer)."""
    result = line.split("=", 1)[1]
    found = _COLLECTIVE.search(line)
    if found:
        result = result.split(found.group(0))[0]
    return max(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\w+\[([\d,]*)\]", result))


@pytest.mark.parametrize("name", ["dp8", "dp8_zero", "tp4", "dp8_dropout", "dp8_zero_bf16", "cp2_zero", "dp8_moe",
                                  "dp8_moe_capacity", "ep2_moe", "ep2_tp2_zero_moe", "tp4_moe"])
def test_data_parallel_gradients_are_reduced_once_after_the_microbatch_loop(compiled_text, name):
    """Megatron reduces gradients once per step: no collective over `data` may run inside the
    microbatch loop or the layer scans; the reduction (and ZeRO's parameter gather) sits outside.
    A MoE's router sums its counts over the ranks in the loop: [experts] and scalars (capacity
    dropping too: capacity is each rank's own, no rank sees another's router scores); with
    expert parallelism the dispatch's all-to-alls (tokens) run there too, over `expert`."""
    pz, text = compiled_text[name]
    assert pz.num_microbatches >= 2 and pz.mesh.shape[DATA] >= 2
    in_loops = _data_parallel_collectives_in_loops(pz, text)
    if "moe" in name:
        experts = pz.cfg.model.num_experts
        dispatch = [line for line in in_loops if " all-to-all(" in line]
        assert bool(dispatch) == name.startswith("ep"), dispatch  # the tokens go to their experts
        in_loops = [line for line in in_loops if line not in dispatch]
        assert in_loops and all(_largest_result(line) <= experts for line in in_loops), in_loops
        in_loops = []
    assert in_loops == []
    looped = set(_lines_in_loops(text))  # by structure: a combined collective's op_name is no guide
    outside = [line for line in text.splitlines() if _COLLECTIVE.search(line) and line not in looped
               and any(len({i // 1 for i in g}) > 1 for g in _groups(line, pz.mesh.devices.size))]
    assert outside, "the gradient reduction must still happen, once, after the loop"
    if "zero" in name:  # ZeRO: the parameters are gathered once, before the loop
        assert any(" all-gather" in line for line in outside)
    if name.startswith("cp"):  # p2p context parallelism still rings its K/V blocks in the per-rank body
        assert any(re.search(r" collective-permute(-start)?\(", line) for line in text.splitlines())


_GATHER_WORKER = """
import jax
jax.config.update("jax_enable_compilation_cache", False)  # compile here, so that XLA dumps
from mlm_jax.config import ParallelConfig
from tests.parallel_util import build, fixed_batch, place
for pp, bf16 in ((1, False), (1, True), (2, True)):
    pz = build(ParallelConfig(use_distributed_optimizer=True, pipeline_model_parallel_size=pp), 1, bf16=bf16)
    pz.train_step.lower(pz.init(0), place(pz, fixed_batch()), jax.random.key(0)).compile()
"""


def test_zero_gathers_bf16_parameters_under_bf16(tmp_path):
    """Under --bf16 ZeRO's one all-gather per step moves the weights in bf16 (what the model reads
    them in) and the norms in fp32: half the gather bytes of the fp32 step. Read from the program
    XLA partitioned, before XLA:CPU's float-normalization-bf16 pass widens every bf16 collective to
    f32 (the CPU has none; GPUs gather bf16)."""
    import glob
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{xla_flags_for(8)} --xla_dump_to={tmp_path} "
                         "--xla_dump_hlo_pass_re=float-normalization-bf16 --xla_dump_hlo_module_re=.*train_step.*")
    proc = subprocess.run([sys.executable, "-c", _GATHER_WORKER], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dumps = sorted(glob.glob(str(tmp_path / "*jit_train_step*before_float-normalization-bf16.txt")))
    assert len(dumps) == 3, dumps  # fp32 step, bf16 step, bf16 pp2 step

    def gathers(path):
        lines = open(path).read().splitlines()
        return [re.search(r"= (\w+)\[([\d,]*)\]", x).groups() for x in lines
                if re.search(r" all-gather(-start)?\(", x) and "/while/body/" not in x]

    fp32 = gathers(dumps[0])
    assert fp32 and {t for t, _ in fp32} == {"f32"}
    for dump in dumps[1:]:  # without and with the pipeline (pp2: each stage gathers its layers)
        bf16 = gathers(dump)
        # every stacked weight, the embedding [512, 64] and the position table [32, 64]
        matrices = [t for t, dims in bf16 if dims.count(",") >= 2 or dims in ("512,64", "32,64")]
        assert len(matrices) >= 6 and set(matrices) == {"bf16"}, (dump, bf16)
        assert any(t == "f32" and dims.endswith(",64") and dims.count(",") == 1 and dims != "32,64"
                   and dims != "512,64" for t, dims in bf16), (dump, bf16)  # the norms' scales stay fp32


def test_group_parser_flags_the_per_microbatch_reduction():
    """The checker is not vacuous: the data-parallel all-reduce of a gradient computed inside a
    scan (what the step did before) is found."""
    mesh = jax.make_mesh((8,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))
    from jax.sharding import NamedSharding, PartitionSpec as P

    w = jax.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P()))
    xs = jax.device_put(np.ones((2, 8, 4), np.float32), NamedSharding(mesh, P(None, DATA)))

    def step(w, xs):
        def body(acc, x):
            g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
            return acc + jax.lax.with_sharding_constraint(g, NamedSharding(mesh, P())), None
        return jax.lax.scan(body, jnp.zeros_like(w), xs)[0]

    text = jax.jit(step).lower(w, xs).compile().as_text()

    class Stub:
        pass
    stub = Stub()
    stub.mesh = mesh
    assert _data_parallel_collectives_in_loops(stub, text)
