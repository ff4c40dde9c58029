"""`mlm_jax.load(path)`: a trained, imported or Hugging Face model, ready for logits.

    import mlm_jax
    m = mlm_jax.load("runs/20260101-120000/checkpoints")   # or a checkpoint folder, or an HF folder
    logits = m.logits(tokens)   # int [batch, seq] -> float32 numpy [batch, seq, m.config.vocab_size]

`logits` returns the *true* vocab (the padding columns Megatron adds are dropped). Parameters
are placed on the available devices: by default one mesh over all of them, data-parallel
(parameters replicated, the batch split when it divides); pass `mesh=` (an
`mlm_jax.sharding.make_mesh` mesh, pipeline size 1) to shard the model over `tensor` as well.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mlm_jax.config import Config, ModelConfig, padded_vocab_size


@dataclasses.dataclass
class LoadedModel:
    """A model's parameters on a mesh. `config` is the mlm_jax ModelConfig (padded vocab set)."""

    config: ModelConfig
    params: dict  # plain layout, sharded on `mesh`
    mesh: object
    tokenizer: object | None
    path: str
    iteration: int | None  # None for a Hugging Face folder

    def __post_init__(self):
        self._forward = None

    def logits(self, tokens) -> np.ndarray:
        """float32 [batch, seq, config.vocab_size] (true vocab) for int tokens [batch, seq]."""
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from jax.sharding import NamedSharding

        from mlm_jax.parallelize import abstract_model, tracing
        from mlm_jax.sharding.rules import activation_rules
        from mlm_jax.sharding.specs import tokens_spec

        tokens = np.asarray(tokens)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens must be an int array [batch, seq], got {tokens.dtype} {tokens.shape}")
        m = self.config
        if m.position_embedding_type == "learned_absolute" and tokens.shape[1] > m.max_position_embeddings:
            raise ValueError(f"{tokens.shape[1]} tokens exceed the model's {m.max_position_embeddings} positions")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= m.vocab_size):
            raise ValueError(f"token ids must be in [0, {m.vocab_size})")
        if self._forward is None:
            graphdef, _, _ = abstract_model(Config(model=m))
            rules = activation_rules(False)

            def forward(params, tokens_bs):
                return nnx.merge(graphdef, params)(tokens_bs)[..., : m.vocab_size]  # [b, s, true vocab]

            self._forward = (jax.jit(forward), rules)
        fn, rules = self._forward
        spec = tokens_spec(tokens.shape[0], dict(self.mesh.shape))
        x = jax.device_put(jnp.asarray(tokens, jnp.int32), NamedSharding(self.mesh, spec))
        with tracing(self.mesh, rules):
            return np.asarray(fn(self.params, x), dtype=np.float32)


def _mesh(mesh):
    from mlm_jax.config import ParallelConfig
    from mlm_jax.sharding.mesh import AXES, PIPE, make_mesh

    if mesh is None:
        return make_mesh(ParallelConfig())
    if tuple(mesh.axis_names) != AXES or mesh.shape[PIPE] != 1:
        raise ValueError(f"mesh must have the axes {AXES} (mlm_jax.sharding.make_mesh) and pipe size 1, "
                         f"got {dict(mesh.shape)}")
    return mesh


def _shardings(model: ModelConfig, mesh):
    import jax
    from jax.sharding import NamedSharding

    from mlm_jax.parallelize import abstract_model
    from mlm_jax.sharding.rules import logical_to_spec, param_rules

    _, shapes, names = abstract_model(Config(model=model))
    shardings = jax.tree.map(lambda n: NamedSharding(mesh, logical_to_spec(n, param_rules())), names,
                             is_leaf=lambda x: isinstance(x, tuple))
    return shapes, shardings


def load(path: str, mesh=None, step: int | None = None) -> LoadedModel:
    """Load an mlm_jax save folder (its latest complete checkpoint, or iteration `step`), one
    checkpoint folder, or a Hugging Face folder (config.json + *.safetensors) onto `mesh`."""
    import jax

    from mlm_jax.checkpoint import find_checkpoint, is_checkpoint, is_hf_folder, load_tokenizer, restore_params
    from mlm_jax.sharding.mesh import TENSOR

    mesh = _mesh(mesh)
    tp = mesh.shape[TENSOR]
    if os.path.isdir(path) and not is_checkpoint(path) and is_hf_folder(path):
        from mlm_jax.tools.checkpoint import hf_tokenizer_record, load_hf, tokenizer_files

        model, host, _, _ = load_hf(path, tensor_parallel=tp)
        shapes, shardings = _shardings(model, mesh)
        params = jax.tree.map(lambda x, s: jax.device_put(x, s), host, shardings)
        record = hf_tokenizer_record(tokenizer_files(path), model.vocab_size)
        tokenizer = None
        if record is not None:
            from mlm_jax.data.tokenizers import make_tokenizer

            args = {k: os.path.join(path, v) for k, v in record.items()
                    if k in ("tokenizer_model", "vocab_file", "merge_file")}
            tokenizer = make_tokenizer(record["tokenizer_type"], **args)
        return LoadedModel(model, params, mesh, tokenizer, path, None)
    found = find_checkpoint(path, step, flag="mlm_jax.load", log=lambda *_: None)
    if found is None:
        raise FileNotFoundError(f"mlm_jax.load {path}: no complete checkpoint in this folder")
    saved = found.config.model
    model = dataclasses.replace(saved, padded_vocab_size=padded_vocab_size(
        saved.vocab_size, saved.make_vocab_size_divisible_by, tp))
    shapes, shardings = _shardings(model, mesh)
    params = restore_params(found, shapes, shardings, model.vocab)
    return LoadedModel(model, params, mesh, load_tokenizer(found.path, found.meta.get("tokenizer")),
                       found.path, found.iteration)
