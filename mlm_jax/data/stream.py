"""Training batches for a parallelized model in one call: what a notebook (or a short script)
needs to step `train_step` without re-assembling `train.py`'s data plumbing.

    batches = train_batches(pz)                      # pz = mlm_jax.parallelize(cfg, mesh)
    state, metrics = pz.train_step(state, next(batches), key)

The data are `cfg.data`'s (mock data, the default corpus, or --data-path prefixes), sampled as
the CLI samples them (Megatron's order, resumable by iteration), laid out as the step's
[microbatch, batch/data, seq] global arrays.
"""

from __future__ import annotations

from typing import Iterator


def train_batches(pz, split: str = "train", start_iteration: int = 0, prefetch: int = 0) -> Iterator[dict]:
    """Global batches (dicts of sharded jax.Arrays) of `split` for `pz`, from `start_iteration`.

    `pz` is a `mlm_jax.Parallel`. Its config's vocab must be the data's: with a
    tokenizer whose vocab differs from `cfg.model.vocab_size`, this raises naming both.
    """
    from mlm_jax.data.batch import batch_fn
    from mlm_jax.data.builder import build_datasets, megatron_num_samples
    from mlm_jax.data.loader import BatchLoader

    cfg, t = pz.cfg, pz.cfg.train
    sizes = megatron_num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)
    data = build_datasets(cfg.data, t.seq_length, t.seed, sizes, vocab_size=cfg.model.vocab_size)
    tok = data.tokenizer
    if tok is not None and tok.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"the data's tokenizer has {tok.vocab_size} tokens but the model's vocab_size "
                         f"is {cfg.model.vocab_size}; build the config with vocab_size={tok.vocab_size}")
    dataset = {"train": data.train, "valid": data.valid, "test": data.test}[split]
    eod = tok.eod if tok is not None else cfg.model.vocab_size - 1
    loader = BatchLoader(dataset, pz.layout.global_batch_size, pz.batch_sharding(), pz.layout.batch_shape(),
                         batch_fn(cfg.data, eod), start_iteration=start_iteration, prefetch=prefetch)
    for batch, _ in loader:
        yield batch
