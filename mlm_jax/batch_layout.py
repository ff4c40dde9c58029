"""How a run's global batch is laid out for the step: [microbatches, micro x dp, seq].

One `BatchLayout` per run, built once from (finalized config, mesh) by `batch_layout`; the
loaders, the batch-size schedule and the train loop read it instead of recomputing the sizes.
The data-parallel size is the mesh's: its devices over tensor x pipeline x context (Megatron's
rule, the size of the mesh axes data x expert that a batch's rows are split over), so a mesh over
some of the devices gets its own size, never the process's device count. Data-parallel rank r
holds rows [r * micro, (r + 1) * micro) of each microbatch (see `mlm_jax/data/loader.py`).
Pure Python: the mesh is only read.
"""

from __future__ import annotations

import dataclasses

from mlm_jax.config import Config, data_parallel_size


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The sizes of a run's batches (module docstring)."""

    data_parallel_size: int  # ranks that take different rows (mesh axes data x expert)
    micro_batch_size: int  # rows per rank per microbatch (--micro-batch-size)
    global_batch_size: int  # rows per step (--global-batch-size; micro x dp when not given)
    seq_length: int

    @property
    def rows(self) -> int:
        """Rows of one microbatch across the data-parallel ranks: micro x dp."""
        return self.micro_batch_size * self.data_parallel_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches of a --global-batch-size step."""
        return self.microbatches()

    def microbatches(self, global_batch_size: int | None = None) -> int:
        """Microbatches of a step of `global_batch_size` rows (default: --global-batch-size)."""
        return self.batch_shape(global_batch_size)[0]

    def batch_shape(self, global_batch_size: int | None = None) -> tuple[int, int, int]:
        """[microbatches, micro * dp, seq] of a global batch (default: --global-batch-size); a
        batch-size schedule's sizes are multiples of micro x dp too."""
        size = self.global_batch_size if global_batch_size is None else global_batch_size
        if size % self.rows:
            raise ValueError(f"global batch {size} is not a multiple of micro batch x data-parallel size {self.rows}")
        return (size // self.rows, self.rows, self.seq_length)


def batch_layout(cfg: Config, mesh) -> BatchLayout:
    """The layout of a finalized `cfg`'s batches on `mesh` (a jax Mesh made from `cfg.parallel`)."""
    t = cfg.train
    return BatchLayout(data_parallel_size(cfg.parallel, mesh.size), t.micro_batch_size, t.global_batch_size,
                       t.seq_length)
