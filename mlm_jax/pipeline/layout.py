"""Which layers live on which pipeline stage, and how the stacked layer params are stored.

Pure Python and numpy (no devices); `mlm_jax.validation.validate_pipeline` calls `plan_pipeline`
so that every invalid combination fails before anything is compiled, with the numbers named.

Stage and chunk vocabulary (the same as `schedules`): P stages, V model chunks per stage; chunk
c of stage s is virtual stage v = c*P + s, and virtual stage v runs layers
[first_layer(v), first_layer(v) + layers_per_vstage[v]).

Storage. The unpipelined model stores each layer param as [layers, ...]. The pipelined model
stores it as [P * V * Lmax, ...] with dim 0 sharded over `pipe`: stage s owns the contiguous
rows [s*V*Lmax, (s+1)*V*Lmax), row (s*V + c)*Lmax + l holds layer first_layer(c*P + s) + l, and
rows past a virtual stage's layer count (uneven splits only) are zero padding. Hence:
  - even split, V = 1: the pipelined tree *is* the plain tree (same shapes, same order), only
    sharded over `pipe`; checkpoints are interchangeable with pp = 1 as they are;
  - interleaved (V > 1): same shapes, layers permuted;
  - uneven (--decoder-first/last-pipeline-num-layers): padded to Lmax rows per stage.
`to_pipelined` / `to_plain` convert any tree holding layer leaves (params, grads, optimizer
moments: every leaf under a "layers" dict key) between the two; they are exact inverses on
the real layers.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mlm_jax.config import Config, num_microbatches
from mlm_jax.errors import ConfigError

SCHEDULE_DEFAULT_FLAT = "1f1b"
SCHEDULE_DEFAULT_VIRTUAL = "interleaved"


class PipelinePlanError(ValueError):
    """A pipeline configuration that cannot run; the message names the numbers."""


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """The layer split: P stages, V chunks per stage, layers per virtual stage (v order)."""

    num_stages: int
    num_chunks: int
    layers_per_vstage: tuple[int, ...]

    def __post_init__(self):
        if len(self.layers_per_vstage) != self.num_stages * self.num_chunks:
            raise ValueError(
                f"layers_per_vstage has {len(self.layers_per_vstage)} entries, expected "
                f"P*V = {self.num_stages}*{self.num_chunks}"
            )

    @property
    def num_vstages(self) -> int:
        return self.num_stages * self.num_chunks

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_vstage)

    @property
    def max_layers(self) -> int:
        """Lmax: stored layer rows per (stage, chunk)."""
        return max(self.layers_per_vstage)

    @property
    def is_padded(self) -> bool:
        return min(self.layers_per_vstage) != self.max_layers

    @property
    def stored_layers(self) -> int:
        """Rows of the stored layer dim: P * V * Lmax (= num_layers unless padded)."""
        return self.num_vstages * self.max_layers

    def first_layer(self, v: int) -> int:
        return sum(self.layers_per_vstage[:v])

    def stage_layers(self, stage: int) -> list[int]:
        """The plain layer indices stage `stage` holds, chunk by chunk."""
        P = self.num_stages
        return [
            self.first_layer(c * P + stage) + l
            for c in range(self.num_chunks)
            for l in range(self.layers_per_vstage[c * P + stage])
        ]

    @functools.cached_property
    def plain_index(self) -> np.ndarray:
        """[P*V*Lmax] int: the plain layer index stored at each row, -1 for padding."""
        P, V, Lmax = self.num_stages, self.num_chunks, self.max_layers
        index = np.full(self.stored_layers, -1, np.int64)
        for s in range(P):
            for c in range(V):
                v = c * P + s
                row = (s * V + c) * Lmax
                n = self.layers_per_vstage[v]
                index[row:row + n] = self.first_layer(v) + np.arange(n)
        return index

    @functools.cached_property
    def stored_index(self) -> np.ndarray:
        """[num_layers] int: the stored row of each plain layer (the inverse of plain_index)."""
        inverse = np.empty(self.num_layers, np.int64)
        rows = np.nonzero(self.plain_index >= 0)[0]
        inverse[self.plain_index[rows]] = rows
        return inverse

    @property
    def is_identity(self) -> bool:
        return not self.is_padded and bool(np.all(self.plain_index == np.arange(self.num_layers)))

    def to_pipelined(self, tree):
        """Plain [layers, ...] layer leaves -> stored [P*V*Lmax, ...] (jnp or numpy leaves)."""
        if self.is_identity:
            return tree
        index = np.maximum(self.plain_index, 0)
        keep = self.plain_index >= 0

        def leaf(x):
            xp = _namespace(x)
            rows = xp.take(x, index, axis=0)
            if self.is_padded:
                mask = keep.reshape((-1,) + (1,) * (x.ndim - 1))
                rows = xp.where(mask, rows, xp.zeros_like(rows))
            return rows

        return map_layer_leaves(leaf, tree)

    def to_plain(self, tree):
        """Stored [P*V*Lmax, ...] layer leaves -> plain [layers, ...] (drops the padding)."""
        if self.is_identity:
            return tree
        return map_layer_leaves(lambda x: _namespace(x).take(x, self.stored_index, axis=0), tree)


def _namespace(x):
    """numpy for numpy leaves (checkpoint conversion on the host), jax.numpy otherwise."""
    if isinstance(x, np.ndarray):
        return np
    import jax.numpy as jnp

    return jnp


def map_layer_leaves(fn, tree):
    """Apply `fn` to every leaf under a "layers" dict key; other leaves pass through."""
    import jax

    def visit(path, x):
        under_layers = any(getattr(k, "key", None) == "layers" for k in path)
        return fn(x) if under_layers else x

    return jax.tree_util.tree_map_with_path(visit, tree)


def split_layers(num_layers: int, num_stages: int, first: int | None, last: int | None) -> list[int]:
    """Layers per stage: even, or Megatron's uneven split (first/last stage given, the rest
    divided evenly over the remaining stages)."""
    P = num_stages
    if first is None and last is None:
        if num_layers % P:
            raise PipelinePlanError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {P}; "
                f"make it a multiple of {P} or set --decoder-first-pipeline-num-layers / "
                f"--decoder-last-pipeline-num-layers"
            )
        return [num_layers // P] * P
    for flag, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise PipelinePlanError(f"{flag} must be >= 1, got {value}")
    middle_stages = P - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    given = " + ".join(
        f"{flag} {v}" for flag, v in (("first", first), ("last", last)) if v is not None
    )
    if rest < middle_stages or (middle_stages == 0 and rest != 0):
        raise PipelinePlanError(
            f"--num-layers {num_layers} does not fit the uneven split: {given} leaves {rest} layers "
            f"for the other {middle_stages} of {P} stages (each needs at least one, and none may "
            f"be left over)"
        )
    if middle_stages and rest % middle_stages:
        raise PipelinePlanError(
            f"--num-layers {num_layers} minus {given} leaves {rest} layers, not divisible by the "
            f"{middle_stages} remaining pipeline stages"
        )
    each = rest // middle_stages if middle_stages else 0
    split = [each] * P
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split


def plan_pipeline(
    *,
    num_layers: int,
    pipeline_size: int,
    schedule: str | None,
    virtual_stages: int | None,
    layers_per_virtual_stage: int | None,
    first_stage_layers: int | None,
    last_stage_layers: int | None,
    num_microbatches: int | None,
) -> tuple[str, PipelineLayout]:
    """(schedule name, layout) for Megatron's pipeline flags, or PipelinePlanError naming the
    numbers. `num_microbatches` None skips the microbatch rules (checked when known)."""
    P = pipeline_size
    virtual_given = virtual_stages is not None or layers_per_virtual_stage is not None
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if P < 1:
        raise PipelinePlanError(f"--pipeline-model-parallel-size must be >= 1, got {P}")
    if schedule is not None and schedule not in ("gpipe", "1f1b", "interleaved"):
        raise PipelinePlanError(
            f"--pipeline-schedule {schedule!r} is unknown; choose gpipe, 1f1b or interleaved"
        )
    if P == 1:
        _check_no_pipeline_flags(schedule, virtual_given, uneven)
        return schedule or SCHEDULE_DEFAULT_FLAT, PipelineLayout(1, 1, (num_layers,))

    V = _virtual_stage_count(num_layers, P, virtual_stages, layers_per_virtual_stage)
    name = schedule or (SCHEDULE_DEFAULT_VIRTUAL if V > 1 else SCHEDULE_DEFAULT_FLAT)
    _check_schedule_fits(name, V, uneven)
    if V > 1:
        if num_layers % (P * V):
            raise PipelinePlanError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {P} "
                f"x {V} virtual stages per rank = {P * V}"
            )
        per_stage = [num_layers // (P * V)] * (P * V)
    else:
        per_stage = split_layers(num_layers, P, first_stage_layers, last_stage_layers)
    if num_microbatches is not None:
        _check_microbatches(name, num_microbatches, P)
    return name, PipelineLayout(P, V, tuple(per_stage))


def _check_no_pipeline_flags(schedule: str | None, virtual_given: bool, uneven: bool) -> None:
    """Pipeline size 1: virtual stages, an uneven split and the interleaved schedule are refused."""
    if virtual_given:
        raise PipelinePlanError(
            "--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage "
            "need --pipeline-model-parallel-size > 1, got 1"
        )
    if uneven:
        raise PipelinePlanError(
            "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1, got 1"
        )
    if schedule == "interleaved":
        raise PipelinePlanError(
            "--pipeline-schedule interleaved needs --pipeline-model-parallel-size > 1, got 1"
        )


def _virtual_stage_count(
    num_layers: int, P: int, virtual_stages: int | None, layers_per_virtual_stage: int | None
) -> int:
    """V, the model chunks per pipeline rank, from whichever one of the two flags is given."""
    if virtual_stages is not None and layers_per_virtual_stage is not None:
        raise PipelinePlanError(
            f"set only one of --num-virtual-stages-per-pipeline-rank ({virtual_stages}) and "
            f"--num-layers-per-virtual-pipeline-stage ({layers_per_virtual_stage})"
        )
    V = 1
    if virtual_stages is not None:
        if virtual_stages < 1:
            raise PipelinePlanError(
                f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {virtual_stages}"
            )
        V = virtual_stages
    if layers_per_virtual_stage is not None:
        n = layers_per_virtual_stage
        if n < 1:
            raise PipelinePlanError(f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {n}")
        if num_layers % (P * n):
            raise PipelinePlanError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {P} "
                f"x --num-layers-per-virtual-pipeline-stage {n} = {P * n}"
            )
        V = num_layers // (P * n)
    return V


def _check_schedule_fits(name: str, V: int, uneven: bool) -> None:
    """Interleaved exactly when there are virtual stages; no uneven split with virtual stages."""
    if name == "interleaved" and V < 2:
        raise PipelinePlanError(
            f"--pipeline-schedule interleaved needs at least 2 virtual stages per pipeline rank, "
            f"got {V}; set --num-virtual-stages-per-pipeline-rank or "
            f"--num-layers-per-virtual-pipeline-stage"
        )
    if name != "interleaved" and V > 1:
        raise PipelinePlanError(
            f"--pipeline-schedule {name} runs one model chunk per pipeline rank, but {V} virtual "
            f"stages per rank were asked for; use --pipeline-schedule interleaved"
        )
    if uneven and V > 1:
        raise PipelinePlanError(
            "--decoder-first/last-pipeline-num-layers with virtual pipeline stages is not "
            f"supported (V={V}); use an even split or --pipeline-schedule 1f1b/gpipe"
        )


def _check_microbatches(name: str, m: int, P: int) -> None:
    """At least one microbatch; the interleaved schedule needs a multiple of P, at least P."""
    if m < 1:
        raise PipelinePlanError(f"the pipeline needs at least one microbatch, got {m}")
    if name == "interleaved" and m < P:
        raise PipelinePlanError(
            f"too few microbatches for the interleaved schedule: {m} (= global batch / "
            f"(micro batch x data-parallel size)) < --pipeline-model-parallel-size {P}"
        )
    if name == "interleaved" and m % P:
        raise PipelinePlanError(
            f"the interleaved schedule needs the number of microbatches ({m} = global batch / "
            f"(micro batch x data-parallel size)) to be a multiple of "
            f"--pipeline-model-parallel-size {P}"
        )


def pipeline_plan(cfg: Config, world_size: int | None = None):
    """(schedule name, layer layout) of a config; ConfigError naming the numbers if invalid."""
    p = cfg.parallel
    m = None if world_size is None else num_microbatches(cfg, world_size)
    try:
        return plan_pipeline(
            num_layers=cfg.model.num_layers,
            pipeline_size=p.pipeline_model_parallel_size,
            schedule=p.pipeline_schedule,
            virtual_stages=p.virtual_pipeline_model_parallel_size,
            layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage,
            first_stage_layers=p.decoder_first_pipeline_num_layers,
            last_stage_layers=p.decoder_last_pipeline_num_layers,
            num_microbatches=m,
        )
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None
