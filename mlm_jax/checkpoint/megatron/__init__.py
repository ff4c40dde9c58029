"""Megatron-LM checkpoints read without PyTorch: `torch_dist` (the default) and legacy `torch`.

    from mlm_jax.checkpoint.megatron import read_checkpoint
    ck = read_checkpoint("megatron_run/checkpoints")   # a save root or an iter_XXXXXXX folder
    ck.config, ck.params, ck.iteration, ck.tokenizer   # ModelConfig, numpy params (plain layout)

`mlm_jax.load(path)` uses this for Megatron folders. A save root holds
`latest_checkpointed_iteration.txt` (an iteration, or `release`) and `iter_0000010/` (or
`release/`). The modules, by job: `torch_pickle` (torch.save archives, allow-listed unpickling),
`dcp` (torch_dist), `legacy` (mp_rank_* files), `layout` (names and layouts -> params), `args`
(args -> ModelConfig, tokenizer). Every failure is a `MegatronCheckpointError` naming the file
and the key.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from mlm_jax.checkpoint.megatron import dcp, legacy
from mlm_jax.checkpoint.megatron.args import model_config_from_args, tokenizer_from_args, true_vocab_size
from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.checkpoint.megatron.layout import Tensors, to_params
from mlm_jax.config import ModelConfig, padded_vocab_size
from mlm_jax.paths import not_there

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^(iter_\d{7,}|release)$")
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")

__all__ = ["MegatronCheckpoint", "MegatronCheckpointError", "is_megatron_checkpoint", "read_checkpoint",
           "resolve_iteration"]


@dataclasses.dataclass
class MegatronCheckpoint:
    config: ModelConfig  # padded_vocab_size set for the tensor-parallel size asked for
    params: dict  # fp32 numpy, mlm_jax's plain layout
    args: object  # the checkpoint's argparse.Namespace
    iteration: int | None  # None for a release checkpoint
    tokenizer: object | None
    path: str  # the iteration folder
    format: str  # "torch_dist" or "torch"
    common: dict = dataclasses.field(default_factory=dict, repr=False)  # the non-sharded state
    checkpoint_vocab: int | None = None  # the stored embedding's rows (Megatron's padded vocab)

    @property
    def consumed_samples(self) -> int:
        """Training samples the run had consumed (Megatron's args.consumed_train_samples)."""
        return int(getattr(self.args, "consumed_train_samples", 0) or 0)

    @property
    def schedule_samples(self) -> int | None:
        """The LR scheduler's position in samples (Megatron's opt_param_scheduler num_steps,
        which it advances by the global batch each step), or None when not saved."""
        sched = self.common.get("opt_param_scheduler")
        steps = sched.get("num_steps") if isinstance(sched, dict) else None
        return None if steps is None else int(steps)


def _is_iter_dir(path: str) -> bool:
    return os.path.isdir(path) and (dcp.is_torch_dist(path) or bool(legacy.rank_dirs(path)))


def is_megatron_checkpoint(path: str) -> bool:
    """A Megatron save root (with the tracker file) or one iteration folder."""
    return os.path.isfile(os.path.join(path, TRACKER)) or (
        bool(_ITER_DIR.match(os.path.basename(os.path.normpath(path)))) and _is_iter_dir(path))


def resolve_iteration(path: str, step: int | None = None, flag: str = "") -> tuple[str, int | None]:
    """(iteration folder, iteration) for a save root (its tracker, or `step`) or an iteration folder;
    `flag` (e.g. "--load") starts the errors about the folder itself."""
    path = os.path.normpath(path)
    tracker = os.path.join(path, TRACKER)
    if step is not None:
        folder = os.path.join(path, f"iter_{step:07d}")
    elif os.path.isfile(tracker):
        with open(tracker, "rb") as f:
            text = f.read(256).decode("utf-8", errors="replace").strip()
        if text == "release":
            folder = os.path.join(path, "release")
        elif text.isascii() and text.isdigit() and len(text) <= 18:  # an iteration (a few digits in practice)
            folder = os.path.join(path, f"iter_{int(text):07d}")
        else:
            raise MegatronCheckpointError(f"{tracker}: holds {text[:40]!r}{'...' if len(text) > 40 else ''}, an "
                                          "iteration number (at most 18 digits) or 'release' is expected")
    else:
        folder = path
    lead = f"{flag} " if flag else ""
    why = not_there(folder, "checkpoint folder")
    if why:
        named = (f" (--ckpt-step {step})" if step is not None else
                 f" (named by {tracker})" if os.path.isfile(tracker) else "")
        raise MegatronCheckpointError(f"{lead}{folder}: {why}{named}")
    if not _is_iter_dir(folder):
        raise MegatronCheckpointError(f"{lead}{folder}: neither a torch_dist checkpoint (.metadata) nor a legacy one "
                                      "(mp_rank_* folders)")
    name = os.path.basename(folder)
    return folder, (int(name[5:]) if name.startswith("iter_") else None)


def _dist_tensors(ck: dcp.Distcp, num_layers: int, prefix: str = "") -> dict:
    """torch_dist keys -> per-layer names: stacked `decoder.layers.<rest>` [L, ...] split by
    layer; `mlp.experts.experts.` (the experts' sharded prefix) -> `mlp.experts.`. With `prefix`
    (e.g. `optimizer.state.exp_avg.`), the keys under it, named without it: an optimizer state
    stored in the model's own keys and shapes."""
    out, cache = {}, {}
    where = os.path.join(ck.dir, dcp.DCP_METADATA)

    def whole(key):
        if key not in cache:
            cache.clear()  # one stacked tensor at a time: layers are taken in order
            cache[key] = ck.tensor(key)
        return cache[key]

    for key in ck.keys():
        if not key.startswith(prefix) or not key[len(prefix):].startswith(_MODEL_PREFIXES):
            continue  # optimizer states, RNG, ...
        name = key[len(prefix):].replace(".mlp.experts.experts.", ".mlp.experts.")
        rest = name[len("decoder.layers."):] if name.startswith("decoder.layers.") else None
        if rest is not None and not rest.split(".")[0].isdigit():
            shape = ck.shapes[key]
            if not shape or shape[0] != num_layers:
                raise MegatronCheckpointError(f"{where}: key {key!r} has shape {shape}; the layers dim should be "
                                              f"args.num_layers = {num_layers}")
            for i in range(num_layers):
                out[f"decoder.layers.{i}.{rest}"] = (f"{where} (stacked key {key!r}, layer {i})",
                                                     lambda key=key, i=i: whole(key)[i])
        else:
            out[name] = (where, lambda key=key: ck.tensor(key))
    return out


def read_checkpoint(path: str, tensor_parallel: int = 1, step: int | None = None,
                    flag: str = "") -> MegatronCheckpoint:
    """A Megatron checkpoint as (ModelConfig, numpy params, ...); `tensor_parallel` sets the
    padded vocab of the run that will hold it."""
    folder, iteration = resolve_iteration(path, step, flag)
    if dcp.is_torch_dist(folder):
        fmt, common = "torch_dist", dcp.read_common(folder)
        where = os.path.join(folder, dcp.COMMON)
    else:
        fmt = "torch"
        shards = legacy.LegacyShards(folder)
        common = shards.common()
        where = shards.path((0, 0, 0))
    args = common.get("args")
    if args is None or not hasattr(args, "num_layers"):
        raise MegatronCheckpointError(f"{where}: key 'args' is missing (run with --use-checkpoint-args "
                                      "needs them; this reader does too)")
    version = common.get("checkpoint_version", 0)
    if version < 3.0:
        raise MegatronCheckpointError(f"{where}: key 'checkpoint_version' = {version}: only version 3.0 "
                                      "(Megatron-Core's QKV layout) is read")
    m = model_config_from_args(args, where)
    if fmt == "torch_dist":
        ck = dcp.Distcp(folder)
        tensors = _dist_tensors(ck, m.num_layers)
        vocab_rows = ck.shapes.get("embedding.word_embeddings.weight", (None,))[0]
    else:
        shards.use_args(args)
        tensors = shards.tensors(m.num_experts, m.swiglu)
        rows = tensors.get("embedding.word_embeddings.weight")
        vocab_rows = None if rows is None else int(np.shape(rows[1]())[0])
    if vocab_rows is None:
        raise MegatronCheckpointError(f"{where}: the checkpoint has no 'embedding.word_embeddings.weight'")
    saved_rows = getattr(args, "padded_vocab_size", None)
    if saved_rows is not None and int(saved_rows) != vocab_rows:
        raise MegatronCheckpointError(f"{where}: key 'embedding.word_embeddings.weight' has {vocab_rows} rows, "
                                      f"args.padded_vocab_size says {saved_rows}")
    root = os.path.dirname(folder)
    tokenizer = tokenizer_from_args(args, root)
    vocab = min(true_vocab_size(args, tokenizer, vocab_rows), vocab_rows)
    divisible = int(getattr(args, "make_vocab_size_divisible_by", 128) or 1)
    m = dataclasses.replace(m, vocab_size=vocab, make_vocab_size_divisible_by=divisible,
                            padded_vocab_size=padded_vocab_size(vocab, divisible, tensor_parallel))
    params = to_params(Tensors(tensors), m, vocab_rows)
    return MegatronCheckpoint(m, params, args, iteration if iteration is not None else common.get("iteration"),
                              tokenizer, folder, fmt, common, vocab_rows)
