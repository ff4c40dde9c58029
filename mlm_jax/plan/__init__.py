"""Deviceless GPU compiles: the train step of `mlm_jax.train` compiled for NVIDIA GPUs on a
machine without one (`python -m mlm_jax.plan`), and what the compiled program shows; the analytic
memory / communication / time model and the layout search (`--search`, pure Python).

The compile pieces import jax; they load on first use, so that `mlm_jax.plan.analytic` and
`mlm_jax.plan.search` stay importable (and fast) without it."""

import importlib

_LAZY = {"Compiled": "compile", "compile_step": "compile", "Program": "gpu_hlo", "read": "gpu_hlo",
         "GPUS": "targets", "Gpu": "targets", "devices": "targets", "gpu": "targets", "plugin_missing": "targets"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"mlm_jax.plan.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'mlm_jax.plan' has no attribute {name!r}")
