"""A stand-in process for tests/test_megatron_flags_model.py's --grad-reduce-in-bf16 HLO test
(not a test itself).

`python tests/bf16_reduce_worker.py`, with XLA_FLAGS dumping the HLO before XLA:CPU's
all-reduce-promotion pass (the CPU backend widens bf16 all-reduces to f32 there, a CPU choice;
XLA:GPU keeps them bf16 for NCCL): compiles the gradient step of dp8 and dp8 ZeRO, with and
without the flag, each as a jit named grads_<case> so the dumps can be told apart.
"""

import jax

from mlm_jax.config import ParallelConfig
from mlm_jax.parallel import tracing
from tests.parallel_util import build, fixed_batch, place

CASES = {
    "dp8_f32": ParallelConfig(),
    "dp8_bf16": ParallelConfig(grad_reduce_in_bf16=True),
    "zero_f32": ParallelConfig(use_distributed_optimizer=True),
    "zero_bf16": ParallelConfig(use_distributed_optimizer=True, grad_reduce_in_bf16=True),
}

for name, parallel in CASES.items():
    pz = build(parallel, 1)
    inner = pz.loss_and_grads.fn

    def grads(params, batch, key, inner=inner):
        return inner(params, batch, key)

    grads.__name__ = f"grads_{name}"
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          pz.shapes, pz.param_sharding)
    with tracing(pz.mesh, pz.rules):
        jax.jit(grads).lower(params, place(pz, fixed_batch()), jax.random.key(0)).compile()
