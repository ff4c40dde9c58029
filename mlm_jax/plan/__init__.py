"""Deviceless GPU compiles: the train step of `mlm_jax.train` compiled for NVIDIA GPUs on a
machine without one (`python -m mlm_jax.plan`), and what the compiled program shows."""

from mlm_jax.plan.compile import Compiled, compile_step
from mlm_jax.plan.gpu_hlo import Program, read
from mlm_jax.plan.targets import GPUS, Gpu, devices, gpu, plugin_missing

__all__ = ["Compiled", "GPUS", "Gpu", "Program", "compile_step", "devices", "gpu", "plugin_missing", "read"]
