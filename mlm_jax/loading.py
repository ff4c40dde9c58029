"""`mlm_jax.load(path)`: a trained, imported or Hugging Face model, ready for logits.

    import mlm_jax
    m = mlm_jax.load("runs/20260101-120000/checkpoints")   # or a checkpoint, HF or Megatron-LM folder
    logits = m.logits(tokens)   # int [batch, seq] -> float32 numpy [batch, seq, m.config.vocab_size]
    outs = m.generate(["a prompt"], max_new_tokens=32)   # KV-cached decoding (mlm_jax/generate.py)

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
    iteration: int | None  # None for a Hugging Face folder (and a Megatron release checkpoint)

    def __post_init__(self):
        self._forward = {}  # "logits" / "mtp" -> its jitted function
        self._decoder = None

    def logits(self, tokens) -> np.ndarray:
        """float32 [batch, seq, config.vocab_size] (true vocab) for int tokens [batch, seq]."""
        return self._run(tokens, "logits")

    def mtp_logits(self, tokens) -> list[np.ndarray]:
        """Each multi-token prediction depth's logits, as `logits` (depth k's at position i score
        token i + k + 1); [] for a model without --mtp-num-layers."""
        return list(self._run(tokens, "mtp")) if self.config.mtp_num_layers else []

    def _run(self, tokens, what: str):
        import jax
        import jax.numpy as jnp
        from flax import nnx
        from jax.sharding import NamedSharding

        from mlm_jax.models.build import abstract_model
        from mlm_jax.parallel import tracing
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
        if what not in self._forward:
            graphdef, _, _ = abstract_model(Config(model=m))

            def forward(params, tokens_bs):
                model = nnx.merge(graphdef, params)
                if what == "mtp":
                    return [x[..., : m.vocab_size] for x in model.mtp_logits(tokens_bs)]
                return model(tokens_bs)[..., : m.vocab_size]  # [b, s, true vocab]

            self._forward[what] = jax.jit(forward)
        spec = tokens_spec(tokens.shape[0], dict(self.mesh.shape))
        x = jax.device_put(jnp.asarray(tokens, jnp.int32), NamedSharding(self.mesh, spec))
        with tracing(self.mesh, activation_rules(False)):
            return jax.tree.map(lambda a: np.asarray(a, dtype=np.float32), self._forward[what](self.params, x))


    def decoder(self):
        """The cached `mlm_jax.generate.Decoder` for these parameters (made on first use)."""
        if self._decoder is None:
            from mlm_jax.config import Config
            from mlm_jax.generate import Decoder
            from mlm_jax.models.build import abstract_model
            from mlm_jax.sharding.rules import activation_rules

            m = self.config
            graphdef, _, _ = abstract_model(Config(model=m))
            limit = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None
            self._decoder = Decoder(graphdef, self.params, m.vocab_size, limit, self.mesh, activation_rules(False))
        return self._decoder

    def encode(self, prompt) -> list[int]:
        """A prompt as token ids: a string through the tokenizer, a sequence of ints as is."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.path} carries no tokenizer: give prompts as token-id lists")
            return list(self.tokenizer.tokenize(prompt))
        return [int(t) for t in prompt]

    def generate(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 0.0, seed: int = 0, logprobs: bool = False, stop_token: int | None = None):
        """Continue each prompt (token-id lists, or strings when the checkpoint has a tokenizer)
        with up to `max_new_tokens` tokens, with the KV cache (`mlm_jax.generate`).

        temperature 0 is greedy; top_k / top_p 0 are off; `seed` fixes the draws (row i uses
        fold_in(key(seed), i)); `stop_token` ends a row early. Returns one
        `mlm_jax.generate.Generated` per prompt (`.tokens`, `.text` with a tokenizer, and
        `.logprobs` / `.prompt_logprobs`, kept only when `logprobs`).
        """
        from mlm_jax.generate import check_sampling

        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise ValueError("prompts is a list of prompts: wrap one prompt in a list")
        check_sampling(temperature, top_k, top_p, max_new_tokens, flags=False)
        outs = self.decoder()([self.encode(p) for p in prompts], max_new_tokens, temperature, top_k,
                              top_p, seed, stop_token, prompt_logprobs=logprobs)
        for out in outs:
            if self.tokenizer is not None:
                try:
                    out.text = self.tokenizer.detokenize(out.tokens)
                except Exception:  # noqa: BLE001 - a tokenizer without text (NullTokenizer)
                    out.text = None
            if not logprobs:
                out.logprobs = out.prompt_logprobs = None
        return outs


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

    from mlm_jax.models.build import abstract_model
    from mlm_jax.sharding.rules import logical_to_spec, param_rules

    _, shapes, names = abstract_model(Config(model=model))
    shardings = jax.tree.map(lambda n: NamedSharding(mesh, logical_to_spec(n, param_rules())), names,
                             is_leaf=lambda x: isinstance(x, tuple))
    return shapes, shardings


def _load_megatron(path: str, mesh, step: int | None) -> LoadedModel:
    """A Megatron-LM checkpoint (torch_dist or legacy; mlm_jax/checkpoint/megatron/) onto `mesh`."""
    import jax

    from mlm_jax.checkpoint.megatron import MegatronCheckpointError, read_checkpoint
    from mlm_jax.sharding.mesh import TENSOR

    ck = read_checkpoint(path, tensor_parallel=mesh.shape[TENSOR], step=step)
    shapes, shardings = _shardings(ck.config, mesh)
    want = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(shapes)}
    got = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(ck.params)}
    if want != got:  # a reader bug, not the user's: say which leaf
        bad = sorted(set(want.items()) ^ set(got.items()))[:3]
        raise MegatronCheckpointError(f"{ck.path}: the parameters read do not match the model's: {bad}")
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), ck.params, shardings)
    return LoadedModel(ck.config, params, mesh, ck.tokenizer, ck.path, ck.iteration)


def load(path: str, mesh=None, step: int | None = None) -> LoadedModel:
    """Load an mlm_jax save folder (its latest complete checkpoint, or iteration `step`), one
    checkpoint folder, a Hugging Face folder (config.json + *.safetensors), or a Megatron-LM
    checkpoint (a save root with latest_checkpointed_iteration.txt, or an iter_XXXXXXX folder;
    torch_dist or legacy torch format) onto `mesh`."""
    import jax

    from mlm_jax.checkpoint import find_checkpoint, is_checkpoint, is_hf_folder, load_tokenizer, restore_params
    from mlm_jax.checkpoint.megatron import is_megatron_checkpoint
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
    if os.path.isdir(path) and is_megatron_checkpoint(path):
        return _load_megatron(path, mesh, step)
    found = find_checkpoint(path, step, flag="mlm_jax.load", log=lambda *_: None)
    if found is None:
        weightless = " (it holds a config.json but no *.safetensors weights)" if os.path.isfile(
            os.path.join(path, "config.json")) else ""
        raise FileNotFoundError(f"mlm_jax.load {path}: no complete checkpoint in this folder{weightless}")
    saved = found.config.model
    model = dataclasses.replace(saved, padded_vocab_size=padded_vocab_size(
        saved.vocab_size, saved.make_vocab_size_divisible_by, tp))
    shapes, shardings = _shardings(model, mesh)
    params = restore_params(found, shapes, shardings, model.vocab)
    return LoadedModel(model, params, mesh, load_tokenizer(found.path, found.meta.get("tokenizer")),
                       found.path, found.iteration)
