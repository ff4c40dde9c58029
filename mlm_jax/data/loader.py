"""Global batches as sharded jax.Arrays, each host reading only its own rows, prefetched.

The batch at iteration k is samples `[k * gbs, (k + 1) * gbs)` of the dataset, laid out as
`np.arange(k * gbs, (k + 1) * gbs).reshape(shape[:-1])`: with shape
`(num_microbatches, micro * dp, seq)` and the batch dim sharded over `data`, data-parallel
rank r of microbatch m gets samples `k*gbs + m*micro*dp + [r*micro, (r+1)*micro)`, exactly
Megatron's `MegatronPretrainingSampler` order. So the data order is a pure function of
(dataset, iteration): it does not depend on the data-parallel size or the number of hosts,
and resuming needs only `start_iteration`. With a batch-size ramp-up (`plan`), batch k starts at
the samples consumed before it instead of k * gbs, in the same layout (Megatron's sampler
starts each batch at `consumed_samples` too).

Each process reads only the rows its addressable devices hold
(`sharding.addressable_devices_indices_map`) and assembles the global arrays with
`jax.make_array_from_callback`. A background thread keeps `prefetch` batches ready;
`next()` returns `(batch, data_wait_seconds)`, the time the caller actually waited.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Callable

import jax
import numpy as np

_DONE = object()


class _Layout:
    """Where the rows of one batch shape live: which of them this process holds (sorted), their
    positions in its local array, and the sequence order of context parallelism."""

    def __init__(self, sharding: jax.sharding.Sharding, shape: tuple[int, ...]):
        self.shape = shape
        self.grid = np.arange(math.prod(shape[:-1])).reshape(shape[:-1])  # [*batch dims]
        self.device_index = sharding.addressable_devices_indices_map(shape)
        held = np.unique(np.concatenate([self.grid[idx[:-1]].reshape(-1) for idx in self.device_index.values()]))
        self.local_rows = held  # offsets within the batch
        self.pos = np.full(self.grid.size, -1, dtype=np.int64)
        self.pos[held] = np.arange(held.size)
        # Context parallelism: the sequence is stored in the load-balanced chunk order, so the
        # slice a context rank's devices ask for is exactly its two chunks.
        from mlm_jax.parallel.chunks import sharding_seq_order

        self.seq_order = sharding_seq_order(sharding, shape)


class BatchLoader:
    """Iterator of `(dict of global jax.Array, data_wait_seconds)`, one per iteration.

    Args:
        dataset: `len()` and `dataset[i] -> int [seq_length + 1]`.
        global_batch_size: samples per iteration; must equal `prod(shape[:-1])`.
        sharding: a `jax.sharding.Sharding` for `shape`, used for every key.
        shape: the global shape of every key, e.g. `(num_microbatches, micro * dp, seq)`.
        make_batch_fn: `[n, seq+1] samples -> dict of [n, seq] arrays` (`batch.make_batch`).
        start_iteration: the first iteration served (resume = the iteration count).
        prefetch: batches built ahead by the background thread (0: build on demand).
        on_read: called as `on_read(iteration, sample_ids)` with the ids this process read.
        end_iteration: stop before this iteration (default: when the dataset runs out).
        plan: iteration -> (first sample, shape) for batches that change size (a batch-size
            ramp-up: `mlm_jax.batch_schedule`); batch k is then samples [first, first + prod(shape[:-1]))
            in the same layout. Default: iteration k is samples [k * gbs, (k + 1) * gbs) of `shape`.
    """

    def __init__(
        self,
        dataset,
        global_batch_size: int,
        sharding: jax.sharding.Sharding,
        shape: tuple[int, ...],
        make_batch_fn: Callable[[np.ndarray], dict[str, np.ndarray]],
        start_iteration: int = 0,
        prefetch: int = 2,
        on_read: Callable[[int, np.ndarray], None] | None = None,
        end_iteration: int | None = None,
        plan: Callable[[int], tuple[int, tuple[int, ...]]] | None = None,
    ):
        self.dataset = dataset
        self.gbs = int(global_batch_size)
        self.shape = tuple(int(x) for x in shape)
        if math.prod(self.shape[:-1]) != self.gbs:
            raise ValueError(
                f"batch shape {self.shape} holds {math.prod(self.shape[:-1])} samples per iteration, "
                f"but the global batch size is {self.gbs}"
            )
        self.sharding = sharding
        self.make_batch_fn = make_batch_fn
        self.on_read = on_read
        if plan is None:  # a fixed batch: whole batches of the dataset
            available = len(dataset) // self.gbs
            self.plan = lambda k: (k * self.gbs, self.shape)
            self.end_iteration = available if end_iteration is None else min(int(end_iteration), available)
        else:
            self.plan = plan
            self.end_iteration = self._available(int(start_iteration), end_iteration)
        self.iteration = int(start_iteration)
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        self.local_rows = self._layout(self.shape).local_rows  # of `shape`'s batches

        self._prefetch = int(prefetch)
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._prefetch > 0:
            self._queue = queue.Queue(maxsize=self._prefetch)
            self._thread = threading.Thread(target=self._run, args=(self.iteration,), daemon=True,
                                            name="BatchLoader")
            self._thread.start()

    def _available(self, start: int, end: int | None) -> int:
        """The first iteration from `start` whose planned batch the dataset cannot fill (at most
        `end`). Planned batches follow each other, so their ends grow: bisect when `end` is known."""
        def fits(k: int) -> bool:
            first, shape = self.plan(k)
            return first + math.prod(shape[:-1]) <= len(self.dataset)

        if end is None:
            k = start
            while fits(k):
                k += 1
            return k
        lo, hi = start, max(start, int(end))
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if fits(mid) else (lo, mid)
        return lo

    def _layout(self, shape: tuple[int, ...]) -> _Layout:
        if shape not in self._layouts:
            self._layouts[shape] = _Layout(self.sharding, shape)
        return self._layouts[shape]

    # -- building one batch

    def read_samples(self, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, [n, seq+1] samples) this process needs for `iteration`."""
        first, shape = self.plan(iteration)
        ids = first + self._layout(tuple(shape)).local_rows
        samples = np.stack([np.asarray(self.dataset[int(i)]) for i in ids])  # [n, seq+1]
        if samples.shape[1] != self.shape[-1] + 1:
            raise ValueError(
                f"dataset samples have {samples.shape[1]} tokens; batch shape {self.shape} needs "
                f"seq_length + 1 = {self.shape[-1] + 1}"
            )
        return ids, samples

    def _build(self, iteration: int) -> dict[str, jax.Array]:
        ids, samples = self.read_samples(iteration)
        if self.on_read is not None:
            self.on_read(iteration, ids)
        layout = self._layout(tuple(self.plan(iteration)[1]))
        local = self.make_batch_fn(samples)  # key -> [n, seq]
        if layout.seq_order is not None:
            local = {k: v[..., layout.seq_order] for k, v in local.items()}  # [n, seq], chunk order
        out = {}
        for key, arr in local.items():
            def piece(index, arr=arr):
                rows = layout.pos[layout.grid[index[:-1]]]  # [*block batch dims]
                return arr[rows][..., index[-1]]
            out[key] = jax.make_array_from_callback(layout.shape, self.sharding, piece)
        return out

    def _run(self, start: int) -> None:
        k = start
        try:
            while not self._stop.is_set():
                item = _DONE if k >= self.end_iteration else (k, self._build(k))
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if item is _DONE:
                    return
                k += 1
        except BaseException as e:  # surfaced to the consumer by next()
            self._queue.put(e)

    # -- iteration

    def __iter__(self):
        return self

    def __next__(self) -> tuple[dict[str, jax.Array], float]:
        t0 = time.perf_counter()
        if self._queue is None:
            if self.iteration >= self.end_iteration:
                raise StopIteration
            batch = self._build(self.iteration)
        else:
            item = self._queue.get()
            if item is _DONE:
                self._queue.put(_DONE)
                raise StopIteration
            if isinstance(item, BaseException):
                raise item
            k, batch = item
            assert k == self.iteration, (k, self.iteration)
        self.iteration += 1
        return batch, time.perf_counter() - t0

    next = __next__

    def close(self) -> None:
        """Stop the prefetch thread (the loader cannot be used afterwards)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.05)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
