"""Shared pieces of the equivalence tests: a tiny config, a fixed batch, cached compiled runs."""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np

from mlm_jax.config import Config, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from mlm_jax.parallel.chunks import sharding_seq_order
from mlm_jax.build import parallelize
from mlm_jax.sharding import make_mesh, trace
from mlm_jax.validation import finalize

VOCAB = 500  # padded to 512 for tp <= 4 but to 1024 for tp = 8: padding must not matter
SEQ = 32
GLOBAL_BATCH = 16


def tiny_config(parallel: ParallelConfig, micro_batch: int, data: DataConfig | None = None,
                **model) -> Config:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=VOCAB,
                max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    return Config(
        model=ModelConfig(**{**base, **model}),
        parallel=parallel,
        optim=OptimConfig(lr=1e-3, lr_warmup_iters=0, lr_decay_style="constant"),
        train=TrainConfig(micro_batch_size=micro_batch, global_batch_size=GLOBAL_BATCH,
                          seq_length=SEQ, train_iters=5),
        **({} if data is None else {"data": data}),
    )


@contextlib.contextmanager
def layer_loop():
    """Trace the layers as a scanned loop, as a GPU does (a CPU runs up to 8 layers unrolled,
    `recompute._UNROLLED_LAYERS`): for the checks of what each layer's loop body holds. JAX keeps
    a jitted function's trace, so the steps traced in here must be `build(..., fresh=True)`'s."""
    from mlm_jax.models import recompute

    kept, recompute._UNROLLED_LAYERS = recompute._UNROLLED_LAYERS, {}
    try:
        yield
    finally:
        recompute._UNROLLED_LAYERS = kept


def fixed_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """A global batch of [GLOBAL_BATCH, SEQ] arrays, with some loss-masked tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (GLOBAL_BATCH, SEQ + 1))
    mask = (rng.random((GLOBAL_BATCH, SEQ)) > 0.1).astype(np.float32)
    return {
        "tokens": tokens[:, :-1].astype(np.int32),
        "labels": tokens[:, 1:].astype(np.int32),
        "loss_mask": mask,
        "position_ids": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (GLOBAL_BATCH, SEQ)).copy(),
    }


def place(pz, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Lay a [global batch, seq] batch out as [microbatch, micro * dp, seq] on the mesh; with
    context parallelism the sequence in the load-balanced chunk order, as the data loader
    delivers it (the same function decides)."""
    shape = pz.batch_shape()
    order = sharding_seq_order(pz.batch_sharding(), shape)
    return {k: jax.device_put((v if order is None else v[..., order]).reshape(shape), pz.batch_sharding())
            for k, v in batch.items()}


def build(parallel: ParallelConfig, micro_batch: int, devices=None, model_class=None, data=None,
          fresh: bool = False, **model):
    """The parallelized tiny model of one layout, built once per session: configs are frozen and
    hashable, so every test (and every file) asking for the same layout shares one set of compiled
    programs. `fresh`: a new one, whose steps JAX has not traced yet (see `layer_loop`)."""
    devices = tuple(jax.devices() if devices is None else devices)
    make = _build.__wrapped__ if fresh else _build
    return make(parallel, micro_batch, devices, model_class, data, tuple(sorted(model.items())))


@functools.cache
def _build(parallel, micro_batch, devices, model_class, data, model):
    cfg = finalize(tiny_config(parallel, micro_batch, data, **dict(model)), len(devices))
    extra = {} if model_class is None else {"model_class": model_class}
    return parallelize(cfg, make_mesh(cfg.parallel, list(devices)), **extra)


@functools.cache
def grads_for(parallel: ParallelConfig, micro_batch: int, single_device: bool = False,
              model: tuple = (), route_groups: int = 1):
    """(loss, grads as numpy, in the plain layer order) of the fixed batch at the seed-0 init, for
    one layout (cached). An interleaved pipeline stores its layers permuted: `plain` undoes it.
    `route_groups` (one device): a MoE router gives that many equal blocks of each microbatch's
    rows a capacity of their own, as a layout with that many ranks of batch rows does."""
    devices = jax.devices()[:1] if single_device else None
    with trace.using(route_groups=route_groups):
        pz = build(parallel, micro_batch, devices, fresh=route_groups > 1, **dict(model))
        state = pz.init(0)
        loss, grads = pz.loss_and_grads(state["params"], place(pz, fixed_batch()), jax.random.key(0))
    return float(loss), jax.tree.map(np.asarray, pz.plain(grads))


@functools.cache
def train_for(parallel: ParallelConfig, micro_batch: int, single_device: bool = False, steps: int = 5):
    """(losses, params as numpy) after `steps` AdamW steps on fixed batches (cached)."""
    pz = build(parallel, micro_batch, jax.devices()[:1] if single_device else None)
    state = pz.init(0)
    losses = []
    for i in range(steps):
        state, metrics = pz.train_step(state, place(pz, fixed_batch(i)), jax.random.key(i))
        losses.append(float(metrics["lm_loss"]))
    return losses, jax.tree.map(np.asarray, state["params"])


def unpad(tree: dict) -> dict:
    """Cut the vocab padding off the embedding (rows) and LM head (columns)."""
    out = dict(tree)
    out["embed"] = tree["embed"][:VOCAB]
    if "lm_head" in tree:
        out["lm_head"] = tree["lm_head"][:, :VOCAB]
    return out


# Document masks: every flag of Megatron's get_ltor_masks_and_position_ids at once.
DOCUMENTS = DataConfig(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
EOD = VOCAB - 1


def document_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """A global batch of [GLOBAL_BATCH, SEQ] arrays cut into documents by EOD tokens (about one
    in six), with segment ids, reset position ids and the EOD loss mask (data/batch.py)."""
    from mlm_jax.data.batch import make_batch

    rng = np.random.default_rng(seed + 100)
    samples = rng.integers(0, VOCAB - 1, (GLOBAL_BATCH, SEQ + 1))
    samples[rng.random(samples.shape) < 0.15] = EOD
    return make_batch(samples, EOD, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)


@functools.cache
def document_grads_for(parallel: ParallelConfig, micro_batch: int, single_device: bool = False,
                       model: tuple = ()):
    """`grads_for` with document masks (DOCUMENTS flags, `document_batch`)."""
    pz = build(parallel, micro_batch, jax.devices()[:1] if single_device else None, data=DOCUMENTS,
               **dict(model))
    state = pz.init(0)
    loss, grads = pz.loss_and_grads(state["params"], place(pz, document_batch()), jax.random.key(0))
    return float(loss), jax.tree.map(np.asarray, pz.plain(grads))


def count_eqns(jaxpr, test) -> int:
    """Equations `test(eqn)` holds for, in a jaxpr and every jaxpr nested in its equations (scans,
    remat, custom VJPs, jit)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += bool(test(eqn))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                count += count_eqns(inner, test) if hasattr(inner, "eqns") else 0
    return count
