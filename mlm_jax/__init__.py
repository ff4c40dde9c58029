"""mlm_jax: Megatron-LM's training features on JAX.

The public face, one import for a notebook (see docs/getting-started/notebook.md):

    import mlm_jax as mj
    mj.fake_devices(8)                       # first: 8 CPU devices on one machine
    cfg = mj.finalize(mj.Config(model=mj.tiny_gpt(), ...), 8)
    pz = mj.parallelize(cfg, mj.make_mesh(cfg.parallel))
    batches = mj.train_batches(pz)

`import mlm_jax` stays light (no jax import): data preprocessing workers import the package, and
each name below is imported from its module when first used. The one exception: where jax's CUDA
plugin is installed on a machine without a GPU (deviceless compiles), jax is imported here with
stderr silenced, which keeps the plugin's driver-not-found lines out of every command's output
(`platform.quiet_cuda_plugin`).
"""

import importlib

from mlm_jax.platform import quiet_cuda_plugin as _quiet

_quiet()

# name -> the module that defines it
_EXPORTS = {
    **{name: "mlm_jax.config" for name in (
        "Config", "ModelConfig", "ParallelConfig", "OptimConfig", "DataConfig", "TrainConfig",
        "CheckpointConfig")},
    "finalize": "mlm_jax.validation",
    "tiny_gpt": "mlm_jax.models.presets",
    "make_mesh": "mlm_jax.sharding.mesh",
    "parallelize": "mlm_jax.build",
    "Parallel": "mlm_jax.build",
    "train_batches": "mlm_jax.data.stream",
    "fake_devices": "mlm_jax.testing",
    "load": "mlm_jax.loading",
    "LoadedModel": "mlm_jax.loading",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlm_jax' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = sorted(_EXPORTS)
