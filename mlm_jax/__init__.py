"""mlm_jax: Megatron-LM's training features on JAX.

`import mlm_jax` stays light (no jax import): data preprocessing workers import the package.
`mlm_jax.load(path)` (mlm_jax/loading.py) imports jax when first called.
"""


def __getattr__(name):
    if name in ("load", "LoadedModel"):
        from mlm_jax import loading

        return getattr(loading, name)
    raise AttributeError(f"module 'mlm_jax' has no attribute {name!r}")


__all__ = ["load", "LoadedModel"]
