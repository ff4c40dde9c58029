"""Pipeline parallelism. Schedules are data: `schedules` holds Megatron's per-stage orders for
GPipe, 1F1B and interleaved 1F1B as one-action-per-tick tables (the asynchronous reference);
`lockstep` their two-slot form (a forward slot and a backward slot per tick, by index
arithmetic), which the runtime executes at the asynchronous schedule's cost. Both pure Python.

`layout`: which layers each stage holds and how the stacked layer params are stored (pure
Python). `runtime`: `Pipeline`, one shard_map over `pipe` executing a two-slot table; imported
lazily so that the tables and the layout stay importable without jax.
"""

from mlm_jax.pipeline.schedules import (
    BACKWARD,
    FORWARD,
    IDLE,
    KIND_CODES,
    SCHEDULES,
    Action,
    ScheduleError,
    Table,
    build_schedule,
    gpipe,
    ideal_idle_fraction,
    ideal_ticks,
    idle_fraction,
    interleaved_1f1b,
    max_in_flight,
    one_f_one_b,
    render,
    to_arrays,
    validate_schedule,
)
from mlm_jax.pipeline.layout import PipelineLayout, PipelinePlanError, plan_pipeline

_RUNTIME = ("Pipeline", "Program", "build_program")


def __getattr__(name):
    if name in _RUNTIME:
        from mlm_jax.pipeline import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'mlm_jax.pipeline' has no attribute {name!r}")

__all__ = [
    "Action",
    "Pipeline",
    "PipelineLayout",
    "PipelinePlanError",
    "Program",
    "build_program",
    "plan_pipeline",
    "BACKWARD",
    "FORWARD",
    "IDLE",
    "KIND_CODES",
    "SCHEDULES",
    "ScheduleError",
    "Table",
    "build_schedule",
    "gpipe",
    "ideal_idle_fraction",
    "ideal_ticks",
    "idle_fraction",
    "interleaved_1f1b",
    "max_in_flight",
    "one_f_one_b",
    "render",
    "to_arrays",
    "validate_schedule",
]
