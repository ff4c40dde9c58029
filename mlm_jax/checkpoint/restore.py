"""Restoring: abstract targets on this run's mesh and layout, read by Orbax slice by slice;
the train state with its start position, or a checkpoint's params on the host."""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import time
from typing import Any

from mlm_jax.config import Config
from mlm_jax.checkpoint.format import (OPT_STATE, PARAMS, CheckpointError, check_model_matches,
                                       quiet_orbax, saved_version, upgrade, as_saved)
from mlm_jax.checkpoint.find import Found, previous_hint


# --------------------------------------------------------------------------- layouts


def _abstract(shapes, shardings):
    import jax

    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def plain_layout(pz):
    """(shapes, param shardings, opt shardings, pipeline or None) of the layout checkpoints hold.

    Without a pipeline, or with one whose stored order is the plain order, that is the run's own
    layout; otherwise the plain [layers, ...] tree, layers replicated over `pipe`, and the
    pipeline converts (its `to_plain` / `to_pipelined`)."""
    pipe = pz.pipeline
    if pipe is None or pipe.layout.is_identity:
        return pz.shapes, pz.param_sharding, pz.opt_sharding, None
    from jax.sharding import NamedSharding, PartitionSpec as P

    from mlm_jax.models.build import abstract_model
    from mlm_jax.optim import optimizer_shardings
    from mlm_jax.pipeline.layout import map_layer_leaves

    _, shapes, _ = abstract_model(pz.cfg)
    p_sh = map_layer_leaves(lambda s: NamedSharding(s.mesh, P(None, *tuple(s.spec)[1:])), pz.param_sharding)
    return shapes, p_sh, optimizer_shardings(pz.tx, shapes, p_sh, pz.mesh), pipe


def layout_record(pz) -> dict:
    import jax

    return {"mesh": {k: int(v) for k, v in pz.mesh.shape.items()},
            "distributed_optimizer": bool(pz.cfg.parallel.use_distributed_optimizer),
            "sharding_strategy": pz.cfg.parallel.sharding_strategy,
            "processes": jax.process_count(), "platform": jax.devices()[0].platform}


def describe_layout(layout: dict | None) -> str:
    if not layout:
        return "?"
    m = layout["mesh"]
    return (" x ".join(f"{k}={v}" for k, v in m.items() if v > 1) or "1 device") + (
        _strategy(layout)) + (
        f", {layout['processes']} processes" if layout.get("processes", 1) > 1 else "")


def _strategy(layout: dict) -> str:
    """', ZeRO' (the distributed optimizer), ', FSDP optim_grads(_params)', or nothing."""
    strategy = layout.get("sharding_strategy")
    if strategy in ("optim_grads", "optim_grads_params"):
        return f", FSDP {strategy}"
    return ", ZeRO" if layout.get("distributed_optimizer") else ""


# --------------------------------------------------------------------------- restore


def restore_params(found: Found, shapes: dict, shardings: dict, padded_vocab: int):
    """The checkpoint's params onto `shardings` (a plain-layout tree), vocab padding adapted and
    delayed fp8 scaling's amax histories fitted to `shapes` (`fit_histories`)."""
    import orbax.checkpoint as ocp

    saved = found.config.model
    strict = (saved.padded_vocab_size or saved.vocab_size) == padded_vocab
    version = saved_version(found.meta)
    wanted = _abstract(shapes, shardings)
    length = history_length(saved)
    target = as_saved(with_history_length(wanted, length), version)
    out = read_items(found, {PARAMS: ocp.args.StandardRestore(target, strict=strict)})
    return fit_histories(upgrade(out[PARAMS], version), wanted)


def history_length(m) -> int:
    """The amax history length of a model's delayed fp8 scaling (0: it keeps none)."""
    from mlm_jax.models import fp8

    return m.fp8_amax_history_len if fp8.delayed(m) else 0


def _map_dicts(fn, tree):
    """`fn` applied to every dict of a pytree of dicts, tuples and named tuples (params, or an
    optimizer state holding params-like trees), innermost first."""
    if isinstance(tree, dict):
        return fn({k: _map_dicts(fn, v) for k, v in tree.items()})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map_dicts(fn, v) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_dicts(fn, v) for v in tree)
    return tree


# Where a projection's weights sit, the histories beside them (models/attention.py, models/mla.py,
# models/mlp.py): weight key, its trailing (non-stacked) dims, the history keys.
_PROJECTIONS = (("wqkv", 4, ("qkv", "out")), ("wkv_up", 3, ("q", "kv_down", "kv_up", "out")), ("wq_down", 2, ("q_down",)),
                ("w1", None, ("fc1", "fc2")))


def with_history_length(tree, length: int):
    """An abstract params-like `tree` (ShapeDtypeStructs) with the amax histories a checkpoint of
    history `length` holds (0: none): the restore target of a checkpoint saved with another
    fp8 recipe or history than the run's."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from mlm_jax.models import fp8

    def adapt(d):
        out = {k: v for k, v in d.items() if not str(k).startswith(fp8.HISTORY)}
        if not length:
            return out
        for weight, dims, names in _PROJECTIONS:
            w = d.get(weight)
            if not isinstance(w, jax.ShapeDtypeStruct) or (weight == "w1" and ("w2" not in d or "router" in d)):
                continue
            dims = dims or (3 if w.ndim >= 3 and d["w2"].ndim < w.ndim else 2)  # SwiGLU's [d, 2, f]
            rep = NamedSharding(w.sharding.mesh, PartitionSpec()) if w.sharding is not None else None
            for name in names:
                out[f"{fp8.HISTORY}_{name}"] = jax.ShapeDtypeStruct((*w.shape[:w.ndim - dims], 3, length), w.dtype,
                                                                    sharding=rep)
        return out

    return _map_dicts(adapt, tree)


def fit_histories(restored, wanted):
    """`restored` (read with `with_history_length`'s target) laid out as `wanted` (abstract): each
    amax history cut or zero-padded to the run's length (newest entries kept), a missing one
    zeros (none recorded: the first step scales by the current amaxes), an extra one dropped."""
    import jax
    import jax.numpy as jnp

    from mlm_jax.models import fp8

    def fit(got, want):
        if isinstance(want, dict):
            return {k: (_history(got.get(k), v) if str(k).startswith(fp8.HISTORY) else fit(got[k], v))
                    for k, v in want.items()}
        if isinstance(want, tuple) and hasattr(want, "_fields"):
            return type(want)(*(fit(g, w) for g, w in zip(got, want)))
        if isinstance(want, (tuple, list)):
            return type(want)(fit(g, w) for g, w in zip(got, want))
        return got

    def _history(got, want):
        def make(g):
            out = jnp.zeros(want.shape, want.dtype)
            if g is not None:
                n = min(g.shape[-1], want.shape[-1])
                out = out.at[..., :n].set(g[..., :n].astype(want.dtype))
            return out

        if got is not None and got.shape == want.shape:
            return got
        return jax.jit(make, out_shardings=want.sharding)(got)

    return fit(restored, wanted)


_READ_ERROR = re.compile(r'Error reading "([^"]+)" in OCDBT database at local file "([^"]*)": (.*)')


def damaged_error(found: Found, exc: BaseException) -> CheckpointError | None:
    """A CheckpointError naming the checkpoint, the unreadable array and the previous complete
    checkpoint, when `exc` (or its cause) is TensorStore failing to read an array file; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        match = _READ_ERROR.search(str(exc))
        if match:
            array = match.group(1).split("/")[0]
            item = os.path.basename(match.group(2).rstrip("/"))
            reason = match.group(3).splitlines()[0][:200]
            return CheckpointError(
                f"--load {found.path}: the checkpoint is damaged: cannot read array {array!r} of "
                f"{item}/ ({reason}); {previous_hint(found.path)}")
        exc = exc.__cause__ or exc.__context__
    return None


def read_items(found: Found, items: dict, optimizer: bool = False) -> dict:
    """Orbax's restore of `items` from `found`, with its failures as one named error: a damaged
    array file names the array (one that reads but differs from its checksum written at save
    too); an optimizer state that does not fit names --no-load-optim."""
    import orbax.checkpoint as ocp

    ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    with quiet_orbax():
        try:
            restored = ckptr.restore(found.path, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - translated below, or re-raised as is
            error = e
        else:
            check_fingerprints(found, {name: restored[name] for name in items if name in (PARAMS, OPT_STATE)})
            return restored
        # The failed read's abandoned coroutines and futures report themselves when collected:
        # collect them now, while their reports are silenced (a notebook has no exit to hide them).
        gc.collect()
    _raise_read_error(found, error, optimizer)


def check_fingerprints(found: Found, restored: dict) -> None:
    """A CheckpointError naming the first restored array that differs from its checksum written
    at save (`checkpoint/fingerprint.py`; checkpoints saved before them have none to check)."""
    recorded = found.meta.get("fingerprints")
    if not recorded or not restored:
        return
    from mlm_jax.checkpoint.fingerprint import mismatched

    bad = mismatched(restored, recorded)
    if bad:
        name = "/".join(re.findall(r"[\w.-]+", bad[0]))  # ['params']['layers']['wo'] -> params/layers/wo
        raise CheckpointError(
            f"--load {found.path}: the checkpoint is damaged: array {name} differs from the checksum written "
            f"when it was saved" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
            + f"; {previous_hint(found.path)}")


def _raise_read_error(found: Found, e: Exception, optimizer: bool):
    """Raise `e`, Orbax's failure to read `found`, as the named error it stands for."""
    damaged = damaged_error(found, e)
    if damaged is not None:
        raise damaged from e
    if isinstance(e, OSError):  # a file of the checkpoint is missing or unreadable
        raise CheckpointError(
            f"--load {found.path}: the checkpoint is damaged ({' '.join(str(e).split())[:300]}); "
            f"{previous_hint(found.path)}") from e
    if optimizer and isinstance(e, (ValueError, KeyError, TypeError)):
        raise CheckpointError(
            f"--load {found.path}: cannot restore the optimizer state onto this run's optimizer "
            f"({type(e).__name__}: {str(e)[:300]}); if the optimizer settings changed, add --no-load-optim"
        ) from e
    raise e


@dataclasses.dataclass(frozen=True)
class Start:
    """Where training starts: iteration, consumed samples and the dropout key's source."""

    iteration: int = 0
    consumed_samples: int = 0
    rng_key_data: Any = None  # uint32 key data from the checkpoint, or None: from --seed
    resumed_from: str | None = None
    valid_batches: int = 0  # validation batches already used (evaluations continue the stream)


def schedule_samples(meta: dict, saved_cfg: Config) -> int:
    """The LR scheduler's sample count a checkpoint resumes (`state["schedule_samples"]`):
    recorded since the batch-size schedules; older checkpoints ran a constant batch, so their
    optimizer steps x their global batch size."""
    if "schedule_samples" in meta:
        return int(meta["schedule_samples"])
    return int(meta.get("opt_step", meta["iteration"])) * int(saved_cfg.train.global_batch_size or 0)


def restore_train_state(cfg: Config, pz, found: Found, log=print) -> tuple[dict, Start]:
    """Train state ({params, opt_state, step, schedule_samples}) on `pz`'s mesh and layout from `found`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding

    from mlm_jax.sharding.specs import replicated

    c = cfg.checkpoint
    t0 = time.perf_counter()
    meta = found.meta
    saved_cfg = found.config
    check_model_matches(saved_cfg.model, cfg.model, f"--load {found.path}")
    load_optim = c.load_optim and not c.finetune
    if load_optim and not meta.get("has_optimizer", False):
        raise CheckpointError(
            f"--load {found.path}: the checkpoint has no optimizer state (saved with --no-save-optim, "
            "or imported from Hugging Face or Megatron-LM); add --finetune (weights only, iteration 0) or --no-load-optim")
    shapes, p_sh, o_sh, pipe = plain_layout(pz)
    saved_padded = saved_cfg.model.padded_vocab_size or saved_cfg.model.vocab_size
    strict = saved_padded == cfg.model.vocab  # else pad/cut the zero padding rows
    version = saved_version(meta)
    if found.params is not None:  # read whole already (a Megatron-LM checkpoint: no amax histories)
        bare = with_history_length(shapes, 0), with_history_length(p_sh, 0)
        params, opt_state = fit_histories(place_host_params(found, *bare), _abstract(shapes, p_sh)), None
        if load_optim and found.optimizer is not None:
            opt_state = place_host_adam(found, pz.tx, params, shapes, p_sh, o_sh, pz.mesh)
    else:
        # Delayed fp8 scaling's amax histories as the checkpoint holds them (another recipe or
        # history length: `fit_histories` makes them the run's).
        length = history_length(saved_cfg.model)
        wanted = _abstract(shapes, p_sh)
        items = {PARAMS: ocp.args.StandardRestore(as_saved(with_history_length(wanted, length), version),
                                                  strict=strict)}
        if load_optim:
            o_wanted = _abstract(jax.eval_shape(pz.tx.init, shapes), o_sh)
            items[OPT_STATE] = ocp.args.StandardRestore(as_saved(with_history_length(o_wanted, length), version),
                                                        strict=strict)
        restored = read_items(found, items, optimizer=load_optim)
        params = fit_histories(upgrade(restored[PARAMS], version), wanted)
        opt_state = restored.get(OPT_STATE)
    if opt_state is not None:
        opt_state = upgrade(opt_state, version)
        if found.params is None:
            opt_state = fit_histories(opt_state, o_wanted)
    if pipe is not None:  # plain -> the pipeline's stored order
        params = jax.jit(pipe.to_pipelined, out_shardings=pz.param_sharding)(params)
        if opt_state is not None:
            opt_state = jax.jit(pipe.to_pipelined, out_shardings=pz.opt_sharding)(opt_state)
    if opt_state is None:
        with jax.set_mesh(pz.mesh):
            opt_state = jax.jit(pz.tx.init, out_shardings=pz.opt_sharding)(params)
    opt_step = int(meta.get("opt_step", meta["iteration"])) if load_optim else 0
    rep = NamedSharding(pz.mesh, replicated())
    step = jax.device_put(jnp.asarray(opt_step, jnp.int32), rep)
    samples = jax.device_put(jnp.asarray(schedule_samples(meta, saved_cfg) if load_optim else 0, jnp.int32), rep)
    state = {"params": params, "opt_state": opt_state, "step": step, "schedule_samples": samples,
             **_scaler_state(cfg, pz, meta, load_optim)}

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
    log(f"> resumed from checkpoint {found.path}: {what}; saved on [{describe_layout(meta.get('layout'))}], "
        f"restored onto [{describe_layout(layout_record(pz))}] in {time.perf_counter() - t0:.1f} s")
    return state, start



def place_host_adam(found: Found, tx, params: dict, shapes: dict, p_sh: dict, o_sh, mesh):
    """`tx`'s state (plain layout, on `o_sh`) holding a Megatron-LM checkpoint's Adam state
    (`found.optimizer`): Adam's moments placed like their parameters (vocab padding as the
    weights'), and every update counter (Adam's bias corrections read it) at Adam's step."""
    import jax
    import jax.numpy as jnp
    import optax

    adam = found.optimizer
    bare, wanted = (with_history_length(shapes, 0), with_history_length(p_sh, 0)), _abstract(shapes, p_sh)
    mu, nu = (fit_histories(place_host_params(found, *bare, moments), wanted) for moments in (adam.mu, adam.nu))
    with jax.set_mesh(mesh):
        state = jax.jit(tx.init, out_shardings=o_sh)(params)
    placed = []

    def fill(node):
        if isinstance(node, optax.ScaleByAdamState):
            placed.append(node)
            return node._replace(count=_count(node.count, adam.step), mu=mu, nu=nu)
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return node._replace(**{f: (_count(v, adam.step) if f == "count" else fill(v))
                                    for f, v in zip(node._fields, node)})
        if isinstance(node, (tuple, list)):
            return type(node)(fill(v) for v in node)
        return node

    def _count(old, step):
        return jax.device_put(jnp.asarray(step, old.dtype), old.sharding)

    state = fill(state)
    if len(placed) != 1:
        raise CheckpointError(f"--load {found.path}: this run's optimizer has {len(placed)} Adam states; "
                              "a Megatron-LM Adam state fills exactly one (add --no-load-optim)")
    return jax.device_put(state, o_sh)  # the moments as the optimizer state lies (ZeRO: over data)


def place_host_params(found: Found, shapes: dict, shardings: dict, tree: dict | None = None):
    """`found.params` (or `tree`, a params-like tree: e.g. Adam's moments; host arrays in the plain
    layout) onto `shardings`; the vocab's zero padding rows (embedding rows, untied head columns)
    cut or added to the run's padded size."""
    import jax
    import numpy as np

    def fit(path, x, shape):
        x = np.asarray(x)
        name = jax.tree_util.keystr(path[:1])
        for dim in ({"['embed']": (0,), "['lm_head']": (1,)}.get(name, ())):
            if x.shape[dim] > shape.shape[dim]:
                x = x.take(np.arange(shape.shape[dim]), axis=dim)
            elif x.shape[dim] < shape.shape[dim]:
                pad = [(0, 0)] * x.ndim
                pad[dim] = (0, shape.shape[dim] - x.shape[dim])
                x = np.pad(x, pad)
        if x.shape != shape.shape:
            raise CheckpointError(f"--load {found.path}: {jax.tree_util.keystr(path)} has shape {x.shape}, "
                                  f"the model's is {shape.shape}")
        return x.astype(shape.dtype)

    host = jax.tree_util.tree_map_with_path(fit, found.params if tree is None else tree, shapes)
    return jax.tree.map(lambda x, s: jax.device_put(x, s), host, shardings)


def _scaler_state(cfg: Config, pz, meta: dict, load_optim: bool) -> dict:
    """{"loss_scale": the saved loss scaler} for a loss-scaled run; the initial scale when the
    checkpoint has none (saved without fp16, or before it existed), the optimizer state is
    not loaded (Megatron keeps the scaler with the optimizer's) or the scale is static
    (--loss-scale: this run's value). {} for other runs."""
    import jax
    from jax.sharding import NamedSharding

    from mlm_jax import loss_scale as ls
    from mlm_jax.sharding.specs import replicated

    scaler = ls.Scaler.of(cfg)
    if scaler is None:
        return {}
    record = meta.get("loss_scale") if load_optim and scaler.static is None else None
    state = ls.from_record(record) if record else scaler.init()
    return {ls.KEY: jax.device_put(state, NamedSharding(pz.mesh, replicated()))}


def restore_host_params(found: Found) -> dict:
    """The checkpoint's params as numpy arrays on this host (its own shapes; for conversion)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from mlm_jax.models.build import abstract_model

    saved = found.config
    if saved.model.padded_vocab_size is None:
        saved = saved.replace(model=dataclasses.replace(saved.model, padded_vocab_size=saved.model.vocab_size))
    _, shapes, _ = abstract_model(saved)
    # Read straight into numpy: no devices involved, so any process can convert any checkpoint
    # (a target without shardings would make Orbax rebuild the saving run's device mesh).
    version = saved_version(found.meta)
    shapes = as_saved(shapes, version)
    target = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), shapes)
    restore_args = jax.tree.map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    out = read_items(found, {PARAMS: ocp.args.PyTreeRestore(item=target, restore_args=restore_args)})
    return upgrade(jax.tree.map(np.asarray, out[PARAMS]), version)
