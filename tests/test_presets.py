"""Full-size presets built abstractly (no memory) give the published parameter counts."""

import jax
from flax import nnx

from mlm_jax.models import GPT, gpt3_175b, llama3_70b, llama3_8b


def n_params(cfg) -> int:
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_gpt3_175b():
    # 96 layers x (12 h^2 + 13 h) + token (50257 x h) and position (2048 x h) tables + final norm.
    h = 12288
    expected = 96 * (12 * h * h + 13 * h) + 50257 * h + 2048 * h + 2 * h
    assert expected == 174_604_259_328
    assert n_params(gpt3_175b()) == expected


def test_llama3_70b_and_8b():
    assert n_params(llama3_70b()) == 70_553_706_496  # Meta's published count
    assert n_params(llama3_8b()) == 8_030_261_248
