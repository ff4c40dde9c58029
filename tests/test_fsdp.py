"""Sharded data parallelism (--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads /
optim_grads_params; mlm_jax/parallel/fsdp.py): the loss and every gradient of one device under
each layout, the layers' shards gathered and reduce-scattered one layer at a time in the compiled
program, the flags' rules.

Tolerances as tests/test_parallel.py's (stated there): loss within 2e-6 absolute, each gradient
leaf within 2e-6 of the leaf's largest reference magnitude plus 1e-10 absolute.
"""

import dataclasses

import jax
import pytest

from mlm_jax.config import ParallelConfig
from tests.parallel_util import grads_for, unpad
from tests.test_parallel import GRAD_RTOL, LOSS_ATOL, REFERENCE, assert_trees_close

ZERO3 = ParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True)
ZERO2 = dataclasses.replace(ZERO3, data_parallel_sharding_strategy="optim_grads")

# name -> (parallel, micro batch, model); a global batch of 16
LAYOUTS = {
    "dp8_zero3": (ZERO3, 1, ()),
    "dp8_zero2": (ZERO2, 1, ()),
    "dp4_tp2_sp_zero3": (dataclasses.replace(ZERO3, tensor_model_parallel_size=2, sequence_parallel=True), 2, ()),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_match_single_device(name):
    parallel, micro, model = LAYOUTS[name]
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True)
    loss, grads = grads_for(parallel, micro, model=model)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)
