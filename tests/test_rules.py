"""The rules table: logical dims to one mesh axis or a tuple of axes, each axis used at most once
per array; the named specs (no PartitionSpec written by hand outside mlm_jax/sharding/); the
pipeline's single forward (the model's stage API, no second layer loop)."""

import inspect

import pytest
from jax.sharding import PartitionSpec as P

from mlm_jax.sharding.rules import activation_rules, logical_to_spec, unsharded
from mlm_jax.sharding.specs import batch_spec, pipe_stored, stage_chunks, tokens_spec

RULES = (("batch", ("data", "expert")), ("seq", ("context", "tensor")), ("heads", "tensor"),
         ("embed", None), ("one", ("pipe",)))


def test_a_dim_may_map_to_a_tuple_of_axes():
    assert logical_to_spec(("batch", "seq", "embed"), RULES) == P(("data", "expert"), ("context", "tensor"), None)
    assert logical_to_spec(("one", None), RULES) == P("pipe", None)  # a 1-tuple is the axis itself


def test_each_axis_is_used_at_most_once():
    # heads takes tensor first; seq then gets only context.
    assert logical_to_spec(("heads", "seq"), RULES) == P("tensor", "context")
    assert logical_to_spec(("seq", "heads"), RULES) == P(("context", "tensor"), None)
    assert logical_to_spec(("batch", "batch"), RULES) == P(("data", "expert"), None)


def test_unknown_dim_is_named():
    with pytest.raises(KeyError, match="logical dim 'vocabulary' has no rule"):
        logical_to_spec(("vocabulary",), RULES)


def test_unsharded_and_the_named_specs():
    assert dict(unsharded(activation_rules(True), "seq"))["seq"] is None
    assert dict(activation_rules(True))["seq"] == ("context", "tensor")  # context-major
    assert dict(activation_rules(False))["seq"] == "context"
    assert dict(activation_rules(True))["context_seq"] == "context"
    # [microbatch, batch, seq]; hybrid sharding's instances outermost
    assert batch_spec() == P(None, ("replica", "data", "expert"), "context")
    assert tokens_spec(4, {"replica": 1, "data": 2, "expert": 2}) == P(("replica", "data", "expert"), None)
    assert tokens_spec(4, {"replica": 2, "data": 2, "expert": 2}) == P()  # 8 ranks of rows: 4 do not divide
    assert tokens_spec(3, {"replica": 1, "data": 2, "expert": 1}) == P()
    assert pipe_stored(P(None, "tensor")) == P("pipe", "tensor")
    assert stage_chunks(P("pipe", "tensor")) == P(None, None, "tensor")


def test_the_pipeline_runs_the_models_stage_api_and_has_no_layer_loop():
    """One lax.scan in the runtime (over ticks); the layers, the embedding and the loss come from
    the model (run_layers, embed_tokens, head_and_mtp: the head with the MTP depths)."""
    from mlm_jax.pipeline import runtime

    src = inspect.getsource(runtime)
    assert src.count("jax.lax.scan(") == 1 and "self.tick" in src
    for call in ("model.run_layers_aux(", "model.embed_tokens(", "model.head_and_mtp("):
        assert call in src, call
    for copy in ("cross_entropy", "logsumexp", "jnp.bfloat16", "nnx.split(", "PartitionSpec"):
        assert copy not in src, copy
