"""A model's parameters without memory (shapes and logical dim names), its initial values, and
its size: what the step, checkpoints, evaluation and loading all build on."""

from __future__ import annotations

import jax
from flax import nnx

from mlm_jax.config import Config
from mlm_jax.models.gpt import GPT


def abstract_model(cfg: Config, model_class=GPT) -> tuple[nnx.GraphDef, dict, dict]:
    """(graphdef, pure dict of ShapeDtypeStruct, pure dict of logical names): no memory used."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: model_class(cfg.model, nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    names = jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"]),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return graphdef, shapes, nnx.to_pure_dict(names) if isinstance(names, nnx.State) else names


def init_params(cfg: Config, seed: int, model_class=GPT) -> dict:
    """Unsharded fp32 parameters as a pure dict (the reference the parallel layouts must match)."""
    with nnx.use_eager_sharding(False):
        return nnx.to_pure_dict(nnx.state(model_class(cfg.model, nnx.Rngs(seed))))


def count_params(shapes: dict) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(shapes))
