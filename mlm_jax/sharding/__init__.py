"""Mesh, logical-dim rules, and the named PartitionSpecs (no spec is written by hand elsewhere)."""

from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import AXES, CONTEXT, DATA, EXPERT, PIPE, REPLICA, TENSOR, make_mesh, mesh_shape
from mlm_jax.sharding.rules import (
    activation_rules, constrain, logical_to_spec, param_rules, unsharded, zero_spec,
)
from mlm_jax.sharding.specs import batch_spec, replicated, tokens_spec

__all__ = [
    "AXES", "CONTEXT", "DATA", "EXPERT", "PIPE", "REPLICA", "TENSOR", "make_mesh", "mesh_shape",
    "activation_rules", "batch_spec", "constrain", "logical_to_spec", "param_rules", "replicated",
    "tokens_spec", "trace", "unsharded", "zero_spec",
]
