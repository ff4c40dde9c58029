"""mlm_jax: Megatron-LM's training features on JAX.

`import mlm_jax` stays light (no jax import): data preprocessing workers import the package.
`mlm_jax.load(path)` (mlm_jax/loading.py) imports jax when first called. The one exception:
where jax's CUDA plugin is installed on a machine without a GPU (deviceless compiles), jax is
imported here with stderr silenced, which keeps the plugin's driver-not-found lines out of every
command's output (`platform.quiet_cuda_plugin`).
"""

from mlm_jax.platform import quiet_cuda_plugin as _quiet

_quiet()


def __getattr__(name):
    if name in ("load", "LoadedModel"):
        from mlm_jax import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'mlm_jax' has no attribute {name!r}")


__all__ = ["load", "LoadedModel"]
