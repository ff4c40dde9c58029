"""Mesh and logical-dim rules."""

from mlm_jax.sharding.mesh import AXES, CONTEXT, DATA, EXPERT, PIPE, TENSOR, make_mesh, mesh_shape
from mlm_jax.sharding.rules import (
    activation_rules, constrain, logical_to_spec, param_rules, use_rules, zero_spec,
)

__all__ = [
    "AXES", "CONTEXT", "DATA", "EXPERT", "PIPE", "TENSOR", "make_mesh", "mesh_shape",
    "activation_rules", "constrain", "logical_to_spec", "param_rules", "use_rules", "zero_spec",
]
