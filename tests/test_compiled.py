"""Compile-only truths: the collectives XLA emits and the per-device memory of the state.

Megatron's analysis, per transformer layer, with tensor parallelism (TP): 2 all-reduces of the
[batch, seq, embed] activations in forward (after attention, after the MLP) and 2 in backward
(the input gradients of the two column-parallel matmuls). With sequence parallelism (SP) each
becomes an all-gather before a column-parallel matmul and a reduce-scatter after a row-parallel
one. XLA:CPU spells a reduce-scatter as an all-reduce whose every use keeps only this device's
slice (see mlm_jax/sharding/hlo.py); it is counted as `scattered`.
"""

import jax
import pytest

from mlm_jax.config import ParallelConfig
from mlm_jax.sharding.hlo import collectives, count
from tests.parallel_util import SEQ, build, fixed_batch, place

MICRO = 2
ACT = (MICRO, SEQ, 64)  # one microbatch's [batch, seq, embed] on a data-parallel rank (dp = 2)


@pytest.fixture(scope="module")
def compiled_hlo():
    out = {}
    for name, par in {
        "tp4": ParallelConfig(tensor_model_parallel_size=4),
        "tp4_sp": ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True),
    }.items():
        pz = build(par, MICRO)
        state = pz.init(0)
        lowered = pz.train_step.lower(state, place(pz, fixed_batch()), jax.random.key(0))
        out[name] = (pz, collectives(lowered.compile().as_text()))
    return out


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


def test_sequence_parallel_turns_all_reduce_into_gather_and_scatter(compiled_hlo):
    pz, found = compiled_hlo["tp4_sp"]
    for backward in (False, True):
        assert count(found, "all-gather", ACT, backward=backward) == 2
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

    from mlm_jax.config import finalize
    from mlm_jax.parallelize import parallelize
    from mlm_jax.sharding import make_mesh
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
    return {cp: _long_context_compiled(cp) for cp in (1, 2, 4)}


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
