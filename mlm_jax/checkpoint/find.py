"""Resolving what to load: a checkpoint folder, a save folder's latest (or --ckpt-step)
complete checkpoint, or none; and --use-checkpoint-args."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mlm_jax.config import Config
from mlm_jax.paths import not_there
from mlm_jax.checkpoint.format import (ARCH_FIELDS, FORMAT, META, ORBAX_COMMIT, PARAMS, TMP_MARK,
                                       CheckpointError, config_from_dict, config_to_dict, tokenizer_flags,
                                       tokenizer_record)


@dataclasses.dataclass(frozen=True)
class Found:
    """A complete checkpoint: its folder, iteration and metadata; `params` (host arrays) when it was
    read whole already (a Megatron-LM checkpoint: `megatron_found`)."""

    path: str
    iteration: int
    meta: dict
    params: Any = None
    optimizer: Any = None  # a Megatron-LM checkpoint's Adam state (megatron.optimizer.AdamState)

    @property
    def config(self) -> Config:
        return config_from_dict(self.meta["config"])


def is_checkpoint(path: str) -> bool:
    """A complete mlm_jax checkpoint folder (committed by Orbax, with our metadata and params)."""
    return (os.path.isfile(os.path.join(path, ORBAX_COMMIT))
            and os.path.isfile(os.path.join(path, META, "metadata"))
            and os.path.isdir(os.path.join(path, PARAMS)))


def is_hf_folder(path: str) -> bool:
    """A Hugging Face model folder: config.json beside *.safetensors weights or their index."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") or f == "model.safetensors.index.json" for f in os.listdir(path))


def scan(root: str) -> tuple[list[int], list[str]]:
    """(complete iterations ascending, names of incomplete entries) of a save folder."""
    complete, incomplete = [], []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.isdigit() and is_checkpoint(path):
            complete.append(int(name))
        elif TMP_MARK in name or name.isdigit():
            incomplete.append(name)
    return sorted(complete), incomplete


def previous_hint(path: str) -> str:
    """What to load instead of the damaged checkpoint folder `path`: the save folder's previous
    complete checkpoint, by --ckpt-step."""
    root, name = os.path.split(os.path.abspath(path))
    if not name.isdigit() or not os.path.isdir(root):
        return "there is no earlier complete checkpoint to fall back on"
    earlier = [i for i in scan(root)[0] if i < int(name)]
    return (f"load the previous complete checkpoint with --ckpt-step {earlier[-1]}" if earlier
            else "there is no earlier complete checkpoint to fall back on")


def read_meta(path: str) -> dict:
    """The checkpoint's metadata; a damaged file is an error naming it."""
    file = os.path.join(path, META, "metadata")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: the checkpoint's metadata is damaged (not JSON: {e}); "
                              f"{previous_hint(path)}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: not an mlm_jax checkpoint (metadata format {got!r})")
    missing = [k for k in ("iteration", "config") if k not in meta]
    if missing or not isinstance(meta["config"], dict) or not isinstance(meta["iteration"], int):
        raise CheckpointError(f"{file}: the checkpoint's metadata is damaged ("
                              + (f"no {', '.join(missing)}" if missing else "bad iteration or config")
                              + f"); {previous_hint(path)}")
    return meta


def find_checkpoint(path: str, step: int | None = None, flag: str = "--load",
                    log=print) -> Found | None:
    """The checkpoint `path` names: a checkpoint folder itself, or a save folder's latest complete
    (or `step`) checkpoint. None when the folder holds none; errors name the path and the reason.
    A relative `path` is taken from the working directory: `Found.path` is always absolute
    (Orbax refuses relative paths)."""
    path = os.path.abspath(path)
    why = not_there(path)
    if why:
        raise CheckpointError(f"{flag} {path}: {why}; give a save folder or one checkpoint folder")
    if is_checkpoint(path):
        meta = read_meta(path)
        if step is not None and step != meta["iteration"]:
            raise CheckpointError(
                f"{flag} {path} is the checkpoint of iteration {meta['iteration']}, not --ckpt-step {step}")
        return Found(path, int(meta["iteration"]), meta)
    if is_hf_folder(path):
        raise CheckpointError(
            f"{flag} {path}: this is a Hugging Face model folder, not an mlm_jax checkpoint; convert it "
            f"first: python -m mlm_jax.tools.checkpoint import-hf --hf-dir {path} --save OUT")
    complete, incomplete = scan(path)
    if incomplete:
        log(f"> {flag} {path}: ignoring incomplete checkpoint(s) {', '.join(incomplete)} "
            "(interrupted saves; never loaded)")
    if step is not None:
        if step not in complete:
            raise CheckpointError(
                f"--ckpt-step {step}: {path} has no complete checkpoint of iteration {step} "
                f"(complete: {complete or 'none'})")
        chosen = step
    elif not complete:
        return None
    else:
        chosen = complete[-1]
    full = os.path.join(path, str(chosen))
    return Found(full, chosen, read_meta(full))



def resolve_load(cfg: Config, log=print) -> tuple[Config, Found | None]:
    """Find the `--load` checkpoint (before the config is finalized: its args are part of it) and
    apply --use-checkpoint-args (the model sizes, and the tokenizer flags where none are given).
    Returns the (possibly updated, not yet finalized) config and the checkpoint."""
    c = cfg.checkpoint
    if not c.load:
        return cfg, None
    resume_pattern = c.save is not None and os.path.abspath(c.save) == os.path.abspath(c.load)
    if not os.path.isdir(c.load) and resume_pattern and not c.exit_on_missing_checkpoint:
        log(f"> --load {c.load}: no such folder yet; starting from scratch (it is also --save)")
        return cfg, None
    from mlm_jax.checkpoint.megatron import is_megatron_checkpoint

    if os.path.isdir(c.load) and is_megatron_checkpoint(c.load) and not own_checkpoint_beside(c.load, c.ckpt_step):
        found = megatron_found(c.load, c.ckpt_step, cfg.parallel.tensor_model_parallel_size,
                               optimizer=c.load_optim and not c.finetune)
        log(f"> --load {c.load}: Megatron-LM {found.meta['megatron']['format']} checkpoint {found.path}, "
            f"iteration {found.iteration}, read without PyTorch"
            + (f"; Adam state (step {found.meta['opt_step']}) from its fully reshardable optimizer state"
               if found.meta["has_optimizer"] else ""))
    else:
        found = find_checkpoint(c.load, c.ckpt_step, log=log)
    if found is None:
        if c.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {c.load}: no complete checkpoint there; exiting "
                                  "(--exit-on-missing-checkpoint)")
        if not resume_pattern:
            raise CheckpointError(f"--load {c.load}: no complete checkpoint in this folder")
        log(f"> --load {c.load}: no checkpoint yet; starting from scratch (it is also --save)")
        return cfg, None
    if c.use_checkpoint_args:
        saved = found.config
        model = dataclasses.replace(cfg.model, **{f: getattr(saved.model, f) for f in ARCH_FIELDS},
                                    padded_vocab_size=None)
        data = cfg.data
        if data.tokenizer_type is None:
            data = dataclasses.replace(data, **tokenizer_flags(found.path, found.meta.get("tokenizer")))
        train = cfg.train if c.seq_length_given else dataclasses.replace(cfg.train, seq_length=saved.train.seq_length)
        cfg = cfg.replace(model=model, data=data, train=train)
        log(f"> --use-checkpoint-args: model from {found.path}: {cfg.model.num_layers} layers, hidden "
            f"{cfg.model.hidden_size}, {cfg.model.num_attention_heads} heads, vocab {cfg.model.vocab_size}"
            + ("" if c.seq_length_given else f", sequence length {train.seq_length}")
            + (f"; tokenizer {data.tokenizer_type} from the checkpoint" if data is not cfg.data or
               data.tokenizer_type else ""))
    return cfg, found


def own_checkpoint_beside(root: str, step: int | None) -> bool:
    """Whether the Megatron-LM save folder `root` also holds an mlm_jax checkpoint to resume (a run
    started from it with --save there too, Megatron's --save = --load habit): the one --ckpt-step
    names, or ours newer than the Megatron iteration."""
    from mlm_jax.checkpoint.megatron import resolve_iteration

    complete = scan(root)[0]
    if not complete:
        return False
    if step is not None:
        return step in complete
    return complete[-1] >= (resolve_iteration(root)[1] or 0)


def megatron_found(path: str, step: int | None, tensor_parallel: int, optimizer: bool = False) -> Found:
    """A Megatron-LM checkpoint (save root or iteration folder) read whole, as the `Found` that
    `restore.restore_train_state` continues from: its weights (vocab padded for `tensor_parallel`),
    config from its args, iteration and consumed samples; with `optimizer`, its Adam state and
    LR-scheduler position too (a fully reshardable optimizer state; else an error naming why)."""
    from mlm_jax.checkpoint.megatron import MegatronCheckpointError, read_checkpoint
    from mlm_jax.checkpoint.megatron import optimizer as megatron_optimizer

    ck = read_checkpoint(path, tensor_parallel=tensor_parallel, step=step, flag="--load")
    adam = None
    if optimizer:
        try:
            adam = megatron_optimizer.read_adam_state(ck)
        except MegatronCheckpointError as e:
            raise CheckpointError(
                f"--load {path}: a Megatron-LM checkpoint whose optimizer state mlm_jax cannot read: {e}; add "
                "--no-load-optim to continue at its iteration with a fresh optimizer (Megatron's --no-load-optim), "
                "or --finetune to start from its weights at iteration 0") from e
        if getattr(ck.args, "bf16", False) or getattr(ck.args, "fp16", False):
            if adam.master is not None:  # the fp32 masters are the weights the optimizer continues
                ck.params = adam.master
        else:
            megatron_optimizer.check_master(ck, adam.master)
    record, _ = tokenizer_record(ck.tokenizer, in_place=True)
    data = Config().data
    if record is not None:
        data = dataclasses.replace(data, tokenizer_type=record["tokenizer_type"])
    train = Config().train  # the sequence length it trained at (--use-checkpoint-args takes it)
    seq = getattr(ck.args, "seq_length", None)
    if isinstance(seq, int) and not isinstance(seq, bool) and seq > 0:
        train = dataclasses.replace(train, seq_length=seq)
    iteration = ck.iteration or 0  # a release checkpoint: weights at iteration 0
    meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": ck.consumed_samples,
            "opt_step": adam.step if adam else iteration, "has_optimizer": adam is not None, "rng": None, "tokenizer": record, "layout": None,
            "config": config_to_dict(Config(model=ck.config, data=data, train=train)),
            "megatron": {"source": os.path.abspath(ck.path), "format": ck.format, "iteration": ck.iteration,
                         "schedule_samples": ck.schedule_samples}}
    if adam is not None and ck.schedule_samples is not None:
        meta["schedule_samples"] = ck.schedule_samples  # the scheduler's num_steps: samples
    return Found(os.path.abspath(ck.path), iteration, meta, ck.params, adam)
