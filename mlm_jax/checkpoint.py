"""Checkpoints: Orbax, asynchronous, complete-or-absent, restorable onto any layout.

A save folder (`--save DIR`) holds one sub-folder per saved iteration:

    DIR/<iteration>/
        params/              model parameters, fp32, in the *plain* layout: stacked layers
                             [layers, ...] in layer order, vocab rows padded (zeros) to the saving
                             run's padded vocab. Layout-free: no mesh, no pipeline order.
        opt_state/           the optimizer state, same layout (absent: --no-save-optim, imports)
        meta/metadata        JSON: iteration, consumed samples, optimizer step, RNG, the full
                             config, the tokenizer record, and the layout it was saved from
        tokenizer/           the tokenizer's files (vocab.json + merges.txt, tokenizer.model, ...)
        _CHECKPOINT_METADATA Orbax's commit record
    DIR/<iteration>.orbax-checkpoint-tmp/   a save in flight, or one a crash interrupted

Orbax writes every save into the `.orbax-checkpoint-tmp` folder and renames it into place only
after every host has written every item, so a folder named by a bare number is complete; an
interrupted save is never loaded (`find_checkpoints` skips it and says so) and the next save
manager removes it.

Restoring builds an abstract target (shape, dtype, sharding on *this* run's mesh) for every leaf
and lets Orbax read each device's slice: any tensor / data / pipeline size, ZeRO on or off, any
host count, with no conversion step. The vocab padding may differ between layouts (it grows
with the tensor-parallel size); padding rows are zeros, so they are padded or cut on restore.
Pipelined runs store their layers permuted/padded (mlm_jax/pipeline/layout.py); they are
converted to the plain layout on save and back on restore.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any

from mlm_jax.config import Config, ConfigError, finalize

FORMAT = "mlm_jax"
VERSION = 1
PARAMS, OPT_STATE, META, TOKENIZER = "params", "opt_state", "meta", "tokenizer"
TMP_MARK = ".orbax-checkpoint-tmp"
ORBAX_COMMIT = "_CHECKPOINT_METADATA"

# Model fields that decide parameter shapes: a checkpoint and the flags must agree on them.
# (field or property, flag that sets it)
SHAPE_FIELDS = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("query_groups", "--num-query-groups"),
    ("head_dim", "--kv-channels"),
    ("vocab_size", "--vocab-size (or the tokenizer's vocab)"),
    ("position_embedding_type", "--position-embedding-type"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("normalization", "--normalization"),
    ("swiglu", "--swiglu"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("add_bias_linear", "--disable-bias-linear (add_bias_linear)"),
)
# What --use-checkpoint-args takes from the checkpoint: the model's architecture.
ARCH_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "normalization", "norm_epsilon", "swiglu",
    "openai_gelu", "untie_embeddings_and_output_weights", "add_bias_linear",
)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded or saved as asked; the message names path and values."""


# --------------------------------------------------------------------------- config <-> JSON


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> Config:
    """The inverse of `config_to_dict`; fields this version does not know are ignored."""
    sections = {}
    for f in dataclasses.fields(Config):
        cls = f.default_factory
        known = {x.name for x in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v
                  for k, v in (d.get(f.name) or {}).items() if k in known}
        sections[f.name] = cls(**values)
    return Config(**sections)


def _shape_value(model, name):
    value = getattr(model, name)
    if name == "max_position_embeddings" and model.position_embedding_type != "learned_absolute":
        return None  # no table: the value does not shape anything
    return value


def check_model_matches(saved, model, where: str) -> None:
    """Raise naming every shape-deciding field where the checkpoint's model differs."""
    diffs = [(flag, _shape_value(saved, name), _shape_value(model, name))
             for name, flag in SHAPE_FIELDS if _shape_value(saved, name) != _shape_value(model, name)]
    if diffs:
        lines = "; ".join(f"{flag}: checkpoint {a!r}, this run {b!r}" for flag, a, b in diffs)
        raise CheckpointError(
            f"{where}: the checkpoint's model differs from this run's: {lines} "
            "(pass matching flags, or --use-checkpoint-args to take the model from the checkpoint)")


# --------------------------------------------------------------------------- finding checkpoints


@dataclasses.dataclass(frozen=True)
class Found:
    """A complete checkpoint: its folder, iteration and metadata."""

    path: str
    iteration: int
    meta: dict

    @property
    def config(self) -> Config:
        return config_from_dict(self.meta["config"])


def is_checkpoint(path: str) -> bool:
    """A complete mlm_jax checkpoint folder (committed by Orbax, with our metadata and params)."""
    return (os.path.isfile(os.path.join(path, ORBAX_COMMIT))
            and os.path.isfile(os.path.join(path, META, "metadata"))
            and os.path.isdir(os.path.join(path, PARAMS)))


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(path))


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


def read_meta(path: str) -> dict:
    with open(os.path.join(path, META, "metadata")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an mlm_jax checkpoint (metadata format {meta.get('format')!r})")
    return meta


def find_checkpoint(path: str, step: int | None = None, flag: str = "--load",
                    log=print) -> Found | None:
    """The checkpoint `path` names: a checkpoint folder itself, or a save folder's latest complete
    (or `step`) checkpoint. None when the folder holds none; errors name the path and the reason."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path}: no such folder")
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


# --------------------------------------------------------------------------- tokenizer files


def tokenizer_record(tokenizer) -> tuple[dict | None, dict[str, bytes]]:
    """(JSON record naming the files by flag, {file name: bytes}) to rebuild `tokenizer`."""
    if tokenizer is None:
        return None, {}
    kind = tokenizer.tokenizer_type
    record = {"tokenizer_type": kind, "vocab_size": int(tokenizer.vocab_size), "eod": int(tokenizer.eod)}
    files = {}
    for path in tokenizer.files():
        with open(path, "rb") as f:
            files[os.path.basename(path)] = f.read()
    if kind == "GPT2BPETokenizer":
        record["vocab_file"] = os.path.basename(tokenizer.vocab_file)
        record["merge_file"] = os.path.basename(tokenizer.merge_file)
    elif kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        record["tokenizer_model"] = os.path.basename(tokenizer.model_file)
    elif kind == "HuggingFaceTokenizer":
        record["tokenizer_model"] = os.path.basename(tokenizer.tokenizer_file)
    return record, files


def tokenizer_flags(found_path: str, record: dict | None) -> dict:
    """DataConfig fields that rebuild the checkpoint's tokenizer from its tokenizer/ folder."""
    if not record or record["tokenizer_type"] == "NullTokenizer":
        return {}
    folder = os.path.join(found_path, TOKENIZER)
    out = {"tokenizer_type": record["tokenizer_type"]}
    for key in ("tokenizer_model", "vocab_file", "merge_file"):
        if record.get(key):
            out[key] = os.path.join(folder, record[key])
    return out


def load_tokenizer(found_path: str, record: dict | None):
    """The checkpoint's tokenizer, or None (mock data without one)."""
    from mlm_jax.data.tokenizers import make_tokenizer

    if not record:
        return None
    if record["tokenizer_type"] == "NullTokenizer":
        return make_tokenizer("NullTokenizer", vocab_size=record["vocab_size"] - 1)
    flags = tokenizer_flags(found_path, record)
    return make_tokenizer(flags.pop("tokenizer_type"), **flags)


def _configure_orbax() -> None:
    """Write arrays whose per-replica slice is under 1 MiB from one replica instead of splitting
    them across replicas. Orbax's replica-parallel default slices every replicated array per
    device with an eager op: one compile per (shape, slice), seconds for a model's hundred small
    tensors on the first save (16 s for 30 shapes on a 2-core CPU). Large arrays keep it."""
    global _CONFIGURED
    if _CONFIGURED:
        return
    import jax
    from orbax.checkpoint import type_handlers

    try:
        handler = type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=1 << 20)
    except TypeError:  # an Orbax without the option: keep its default
        handler = None
    if handler is not None:
        import logging

        absl = logging.getLogger("absl")  # Orbax warns that it is overriding its own default
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            type_handlers.register_type_handler(jax.Array, handler, override=True)
        finally:
            absl.setLevel(level)
    _CONFIGURED = True


_CONFIGURED = False


def _files_handler():
    """An Orbax item that writes a few small files (the tokenizer's) into the step folder, so
    they are committed atomically with the rest. Built lazily: orbax is imported on first use."""
    global _FILES
    _configure_orbax()
    if _FILES is not None:
        return _FILES
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.futures import future

    class FilesHandler(ocp.handlers.AsyncCheckpointHandler):
        async def _write(self, files, directory):
            import jax

            if jax.process_index() == 0:
                for name, data in files.items():
                    (directory / name).write_bytes(data)

        async def async_save(self, directory, args=None):
            return [future.CommitFutureAwaitingContractedSignals(
                self._write(args.files, directory), name="mlm_jax_files_save")]

        def save(self, directory, args=None):
            for name, data in args.files.items():
                (directory / name).write_bytes(data)

        def restore(self, directory, args=None):
            return {p.name: p.read_bytes() for p in directory.iterdir() if p.name != "commit_success.txt"}

    @ocp.args.register_with_handler(FilesHandler, for_save=True)
    @dataclasses.dataclass
    class FilesSave(ocp.args.CheckpointArgs):
        files: dict

    @ocp.args.register_with_handler(FilesHandler, for_restore=True)
    @dataclasses.dataclass
    class FilesRestore(ocp.args.CheckpointArgs):
        pass

    _FILES = FilesSave
    return _FILES


_FILES = None


# --------------------------------------------------------------------------- layouts


def _abstract(shapes, shardings):
    import jax

    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def _opt_shardings(tx, shapes, param_sharding, mesh):
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, shapes), param_sharding,
                                 transform_non_params=lambda _: NamedSharding(mesh, P()))


def plain_layout(pz):
    """(shapes, param shardings, opt shardings, pipeline or None) of the layout checkpoints hold.

    Without a pipeline, or with one whose stored order is the plain order, that is the run's own
    layout; otherwise the plain [layers, ...] tree, layers replicated over `pipe`, and the
    pipeline converts (its `to_plain` / `to_pipelined`)."""
    pipe = pz.pipeline
    if pipe is None or pipe.layout.is_identity:
        return pz.shapes, pz.param_sharding, pz.opt_sharding, None
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mlm_jax.parallelize import abstract_model
    from mlm_jax.pipeline.layout import map_layer_leaves

    _, shapes, _ = abstract_model(pz.cfg)
    p_sh = map_layer_leaves(lambda s: NamedSharding(s.mesh, P(None, *tuple(s.spec)[1:])), pz.param_sharding)
    return shapes, p_sh, _opt_shardings(pz.tx, shapes, p_sh, pz.mesh), pipe


def _layout_record(pz) -> dict:
    import jax

    return {"mesh": {k: int(v) for k, v in pz.mesh.shape.items()},
            "distributed_optimizer": bool(pz.cfg.parallel.use_distributed_optimizer),
            "processes": jax.process_count(), "platform": jax.devices()[0].platform}


def _describe(layout: dict | None) -> str:
    if not layout:
        return "?"
    m = layout["mesh"]
    return (" x ".join(f"{k}={v}" for k, v in m.items() if v > 1) or "1 device") + (
        ", ZeRO" if layout.get("distributed_optimizer") else "") + (
        f", {layout['processes']} processes" if layout.get("processes", 1) > 1 else "")


# --------------------------------------------------------------------------- restore


def restore_params(found: Found, shapes: dict, shardings: dict, padded_vocab: int):
    """The checkpoint's params onto `shardings` (a plain-layout tree), vocab padding adapted."""
    import orbax.checkpoint as ocp

    saved = found.config.model
    strict = (saved.padded_vocab_size or saved.vocab_size) == padded_vocab
    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    out = ckptr.restore(found.path, args=ocp.args.Composite(
        **{PARAMS: ocp.args.StandardRestore(_abstract(shapes, shardings), strict=strict)}))
    return out[PARAMS]


@dataclasses.dataclass(frozen=True)
class Start:
    """Where training starts: iteration, consumed samples and the dropout key's source."""

    iteration: int = 0
    consumed_samples: int = 0
    rng_key_data: Any = None  # uint32 key data from the checkpoint, or None: from --seed
    resumed_from: str | None = None
    valid_batches: int = 0  # validation batches already used (evaluations continue the stream)


def restore_train_state(cfg: Config, pz, found: Found, log=print) -> tuple[dict, Start]:
    """Train state ({params, opt_state, step}) on `pz`'s mesh and layout from `found`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec as P

    c = cfg.checkpoint
    t0 = time.perf_counter()
    meta = found.meta
    saved_cfg = found.config
    check_model_matches(saved_cfg.model, cfg.model, f"--load {found.path}")
    load_optim = c.load_optim and not c.finetune
    if load_optim and not meta.get("has_optimizer", False):
        raise CheckpointError(
            f"--load {found.path}: the checkpoint has no optimizer state (saved with --no-save-optim, "
            "or imported from Hugging Face); add --finetune (weights only, iteration 0) or --no-load-optim")
    shapes, p_sh, o_sh, pipe = plain_layout(pz)
    saved_padded = saved_cfg.model.padded_vocab_size or saved_cfg.model.vocab_size
    strict = saved_padded == cfg.model.vocab  # else pad/cut the zero padding rows
    items = {PARAMS: ocp.args.StandardRestore(_abstract(shapes, p_sh), strict=strict)}
    if load_optim:
        o_shapes = jax.eval_shape(pz.tx.init, shapes)
        items[OPT_STATE] = ocp.args.StandardRestore(_abstract(o_shapes, o_sh), strict=strict)
    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        restored = ckptr.restore(found.path, args=ocp.args.Composite(**items))
    except (ValueError, KeyError, TypeError) as e:
        if load_optim:
            raise CheckpointError(
                f"--load {found.path}: cannot restore the optimizer state onto this run's optimizer "
                f"({type(e).__name__}: {str(e)[:300]}); if the optimizer settings changed, add --no-load-optim"
            ) from e
        raise
    params = restored[PARAMS]
    opt_state = restored.get(OPT_STATE)
    if pipe is not None:  # plain -> the pipeline's stored order
        params = jax.jit(pipe.to_pipelined, out_shardings=pz.param_sharding)(params)
        if opt_state is not None:
            opt_state = jax.jit(pipe.to_pipelined, out_shardings=pz.opt_sharding)(opt_state)
    if opt_state is None:
        with jax.set_mesh(pz.mesh):
            opt_state = jax.jit(pz.tx.init, out_shardings=pz.opt_sharding)(params)
    opt_step = int(meta.get("opt_step", meta["iteration"])) if load_optim else 0
    step = jax.device_put(jnp.asarray(opt_step, jnp.int32), NamedSharding(pz.mesh, P()))
    state = {"params": params, "opt_state": opt_state, "step": step}

    if c.finetune:
        start = Start(0, 0, None, found.path)
    else:
        rng = meta.get("rng")
        key_data = (np.asarray(rng["key_data"], np.uint32)
                    if c.load_rng and rng and rng.get("key_data") is not None else None)
        start = Start(int(meta["iteration"]), int(meta.get("consumed_samples", 0)), key_data, found.path,
                      int(meta.get("valid_batches", 0)))
    what = ("weights only (--finetune), starting at iteration 0" if c.finetune else
            f"iteration {start.iteration}, {start.consumed_samples} consumed samples; optimizer state "
            f"{'restored' if load_optim else 'fresh (--no-load-optim)'}; dropout RNG "
            f"{'restored' if start.rng_key_data is not None else 'from --seed'}")
    log(f"> resumed from checkpoint {found.path}: {what}; saved on [{_describe(meta.get('layout'))}], "
        f"restored onto [{_describe(_layout_record(pz))}] in {time.perf_counter() - t0:.1f} s")
    return state, start


def resolve_load(cfg: Config, world: int, log=print) -> tuple[Config, Found | None]:
    """Find the `--load` checkpoint (before data and model are built) and apply
    --use-checkpoint-args. Returns the (possibly updated, finalized) config and the checkpoint."""
    c = cfg.checkpoint
    if not c.load:
        return cfg, None
    resume_pattern = c.save is not None and os.path.abspath(c.save) == os.path.abspath(c.load)
    if not os.path.isdir(c.load) and resume_pattern and not c.exit_on_missing_checkpoint:
        log(f"> --load {c.load}: no such folder yet; starting from scratch (it is also --save)")
        return cfg, None
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
        cfg = finalize(cfg.replace(model=model, data=data), world)
        log(f"> --use-checkpoint-args: model from {found.path}: {cfg.model.num_layers} layers, hidden "
            f"{cfg.model.hidden_size}, {cfg.model.num_attention_heads} heads, vocab {cfg.model.vocab_size}"
            + (f"; tokenizer {data.tokenizer_type} from the checkpoint" if data is not cfg.data or
               data.tokenizer_type else ""))
    return cfg, found


# --------------------------------------------------------------------------- save


def write_params_checkpoint(root: str, iteration: int, params: dict, cfg: Config,
                            tokenizer: dict | None = None, files: dict[str, bytes] | None = None,
                            extra: dict | None = None) -> str:
    """Write a weights-only checkpoint (no optimizer state, no RNG) synchronously, e.g. an
    imported model; `params` may be numpy. Returns the checkpoint folder."""
    import orbax.checkpoint as ocp

    meta = {"format": FORMAT, "version": VERSION, "iteration": int(iteration), "consumed_samples": 0,
            "opt_step": 0, "has_optimizer": False, "rng": None, "config": config_to_dict(cfg),
            "tokenizer": tokenizer, "layout": None, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **(extra or {})}
    root = os.path.abspath(root)
    if os.path.isdir(root) and scan(root)[0]:
        raise CheckpointError(f"--save {root} already holds checkpoints {scan(root)[0]}; choose an empty folder")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(root, options=options) as mngr:
        mngr.save(iteration, force=True, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardSave(params), META: ocp.args.JsonSave(meta),
            TOKENIZER: _files_handler()(files or {})}))
        mngr.wait_until_finished()
    return os.path.join(root, str(iteration))


def restore_host_params(found: Found) -> dict:
    """The checkpoint's params as numpy arrays on this host (its own shapes; for conversion)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from mlm_jax.parallelize import abstract_model

    saved = found.config
    if saved.model.padded_vocab_size is None:
        saved = saved.replace(model=dataclasses.replace(saved.model, padded_vocab_size=saved.model.vocab_size))
    _, shapes, _ = abstract_model(saved)
    # Read straight into numpy: no devices involved, so any process can convert any checkpoint
    # (a target without shardings would make Orbax rebuild the saving run's device mesh).
    target = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), shapes)
    restore_args = jax.tree.map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    out = ckptr.restore(found.path, args=ocp.args.Composite(**{
        PARAMS: ocp.args.PyTreeRestore(item=target, restore_args=restore_args)}))
    return jax.tree.map(np.asarray, out[PARAMS])


def _agree(flag: bool) -> bool:
    """True on every host when it is True on any (hosts must save and exit together)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag]))))


class Saver:
    """Saves during training: on the interval, on exit requests, at the end; asynchronously.

    `step_done(...)` after every iteration returns an exit reason (signal, --exit-interval,
    --exit-duration-in-mins) once a checkpoint for it has been saved, else None.
    """

    def __init__(self, cfg: Config, pz, tokenizer, run_dir: str, start: Start, log=print,
                 start_time: float | None = None, valid_loader=None):
        c = cfg.checkpoint
        self.valid_loader = valid_loader  # its position is saved: evaluations resume in order
        self.cfg, self.pz, self.log, self.c = cfg, pz, log, c
        self.dir = c.save or (os.path.join(run_dir, "checkpoints") if c.final_checkpoint else None)
        self.start = start
        self.start_time = time.time() if start_time is None else start_time
        self.tokenizer, self.files = tokenizer_record(tokenizer)
        self.mngr = None
        self.last_saved = None
        self.pending = None  # (iteration, path, t_start) of the save still being written
        self.saved_paths: list[str] = []
        self.signal_received = None
        self._old_handlers = {}
        if self.dir and os.path.isdir(self.dir):
            later = [s for s in scan(self.dir)[0] if s > start.iteration]
            if later:
                raise CheckpointError(
                    f"--save {self.dir} already holds checkpoints of iterations {later}, after this run's "
                    f"start (iteration {start.iteration}); they belong to another run. Resume from the "
                    "latest with --load, or save to another folder")
        if c.exit_signal_handler and threading.current_thread() is threading.main_thread():
            # SIGTERM only (Megatron's): what schedulers send before a kill; Ctrl-C still stops.
            self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal_received = signal.Signals(signum).name

    def _manager(self):
        if self.mngr is None:
            import orbax.checkpoint as ocp

            policy = (ocp.checkpoint_managers.LatestN(n=self.c.keep_last) if self.c.keep_last else None)
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.c.async_save, create=True,
                cleanup_tmp_directories=True, preservation_policy=policy)
            self.mngr = ocp.CheckpointManager(os.path.abspath(self.dir), options=options)
        return self.mngr

    def _report_finished(self, wait: bool) -> None:
        if self.pending is None:
            return
        if wait:
            self.mngr.wait_until_finished()
        elif self.mngr.is_saving_in_progress():
            return
        iteration, path, t_start = self.pending
        self.pending = None
        self.log(f"> checkpoint of iteration {iteration} committed to {path} "
                 f"({'written in' if wait else 'seen done'} {time.perf_counter() - t_start:.2f} s "
                 "after the save began)")

    def save(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> float:
        """Save now; returns the seconds training was blocked."""
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        mngr = self._manager()
        self._report_finished(wait=True)  # one save in flight at a time
        if iteration in mngr.all_steps():
            mngr.delete(iteration)
        params, opt_state = state["params"], state["opt_state"]
        _, p_sh, o_sh, pipe = plain_layout(self.pz)
        if pipe is not None:
            params = jax.jit(pipe.to_plain, out_shardings=p_sh)(params)
            opt_state = jax.jit(pipe.to_plain, out_shardings=o_sh)(opt_state)
        meta = {
            "format": FORMAT, "version": VERSION, "iteration": int(iteration),
            "consumed_samples": int(consumed_samples), "opt_step": int(jax.device_get(state["step"])),
            "valid_batches": int(self.valid_loader.iteration) if self.valid_loader is not None else 0,
            "has_optimizer": bool(self.c.save_optim),
            "rng": ({"seed": self.cfg.train.seed, "impl": "threefry2x32",
                     "key_data": [int(x) for x in np.asarray(rng_key_data).reshape(-1)]}
                    if self.c.save_rng and rng_key_data is not None else None),
            "config": config_to_dict(self.cfg), "tokenizer": self.tokenizer,
            "layout": _layout_record(self.pz), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        items = {PARAMS: ocp.args.StandardSave(params), META: ocp.args.JsonSave(meta),
                 TOKENIZER: _files_handler()(self.files)}
        if self.c.save_optim:
            items[OPT_STATE] = ocp.args.StandardSave(opt_state)
        mngr.save(iteration, args=ocp.args.Composite(**items), force=True)
        blocked = time.perf_counter() - t0
        path = os.path.join(self.dir, str(iteration))
        self.last_saved = iteration
        self.saved_paths.append(path)
        self.pending = (iteration, path, t0)
        self.log(f"> saving checkpoint of iteration {iteration} to {path}: training blocked "
                 f"{blocked:.2f} s" + ("; writing in the background" if self.c.async_save else ""))
        if not self.c.async_save:
            self._report_finished(wait=True)
        return blocked

    def step_done(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> str | None:
        """After iteration `iteration`: save on the interval; on an exit request save and return why."""
        c = self.c
        if self.pending is not None:
            self._report_finished(wait=False)
        if self.dir and c.save_interval and iteration % c.save_interval == 0:
            self.save(iteration, state, consumed_samples, rng_key_data)
        reason = None
        if c.exit_signal_handler and _agree(self.signal_received is not None):
            reason = f"received {self.signal_received or 'a signal (on another host)'}"
        elif c.exit_interval and iteration % c.exit_interval == 0:
            reason = f"--exit-interval {c.exit_interval}"
        elif c.exit_duration_in_mins is not None and _agree(
                (time.time() - self.start_time) / 60.0 > c.exit_duration_in_mins):
            reason = f"--exit-duration-in-mins {c.exit_duration_in_mins:g}"
        if reason and self.dir and self.last_saved != iteration:
            self.save(iteration, state, consumed_samples, rng_key_data)
        return reason

    def finish(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> None:
        """The end-of-training checkpoint (unless this iteration was just saved)."""
        if (self.dir and self.c.final_checkpoint and self.last_saved != iteration
                and iteration > self.start.iteration):
            self.save(iteration, state, consumed_samples, rng_key_data)

    def close(self) -> None:
        """Wait for the write in flight (a run ends only with its checkpoints committed)."""
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}
        if self.mngr is not None:
            self._report_finished(wait=True)
            self.mngr.close()
            self.mngr = None
