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
