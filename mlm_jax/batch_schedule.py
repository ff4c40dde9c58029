"""The global batch size as a function of consumed samples: Megatron's microbatch calculators.

Three schedules, each with Megatron-LM's formula and checks (no jax here):
  constant   `--global-batch-size` every iteration;
  ramp-up    `--rampup-batch-size START INCR SAMPLES` (Megatron's RampupBatchsizeNumMicroBatches-
             Calculator, deprecated there in favour of the step schedule but kept by its scripts):
             the batch grows from START by INCR over (GBS - START) / INCR equal intervals of
             SAMPLES / increments samples each, then stays at --global-batch-size;
  step       `--step-batch-size-schedule "THRESHOLD:BS ..."` (Megatron's StepBatchsize calculator):
             the batch of the last entry whose threshold <= consumed samples. Megatron passes
             --seq-length to it, so thresholds count TOKENS (suffixes K M B T) and become samples
             by integer division by the sequence length.

An iteration's batch is chosen from the samples consumed before it (`batch_size(consumed)`),
so the whole run -- batch sizes, consumed samples, the number of iterations that
`--train-samples` gives -- is a pure function of the schedule, and resuming from a
checkpoint's consumed-sample count continues it exactly. Every batch size a run reaches must
divide by micro batch x data-parallel size (Megatron checks the current one each iteration;
`check_sizes` checks them all before anything compiles).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from mlm_jax.errors import ConfigError


class ScheduleError(ConfigError):
    """A batch-size schedule that cannot run; the message names the flag and Megatron's reason."""


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str, flag: str = "--step-batch-size-schedule") -> int:
    """`250B` -> 250_000_000_000 (Megatron's K/M/B/T suffixes; `2.4B` allowed, truncated)."""
    raw = text.strip().upper()
    scale = _SUFFIXES.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in _SUFFIXES else raw
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ScheduleError(f"{flag}: {text!r} is not a number (suffixes K, M, B, T allowed)") from None


def parse_step_schedule(text: str, seq_length: int | None) -> tuple[tuple[int, int], ...]:
    """Megatron's "THRESHOLD:BS THRESHOLD:BS ..." (spaces or commas) -> ((threshold samples, batch), ...)
    sorted by threshold; thresholds are tokens (divided by `seq_length`) when it is given."""
    flag = "--step-batch-size-schedule"
    entries = text.strip().replace(",", " ").split()
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ScheduleError(f'{flag}: invalid schedule entry "{entry}"; expected format "THRESHOLD:BATCH_SIZE"')
        threshold, size = (parse_count(part, flag) for part in entry.split(":", 1))
        schedule.append((threshold // seq_length if seq_length else threshold, size))
    schedule.sort(key=lambda entry: entry[0])
    if not schedule:
        raise ScheduleError(f"{flag}: schedule must have at least one entry")
    if schedule[0][0] != 0:
        raise ScheduleError(f"{flag}: first schedule entry must have threshold 0, got {schedule[0][0]}")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ScheduleError(f"{flag}: schedule thresholds must be strictly increasing, got {before} "
                                f"before {after} (in samples)")
    for _, size in schedule:
        if size <= 0:
            raise ScheduleError(f"{flag}: batch size must be positive, got {size}")
    return tuple(schedule)


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """Global batch size per iteration from consumed samples (module docstring)."""

    global_batch_size: int  # constant / ramp-up: --global-batch-size; step: Megatron's micro x dp
    micro_batch_size: int
    data_parallel_size: int
    rampup: tuple[int, int, int] | None = None  # (start, increment, samples)
    steps: tuple[tuple[int, int], ...] | None = None  # ((threshold samples, batch), ...)

    def __post_init__(self):
        if self.rampup is not None:
            self._check_rampup()

    @property
    def varies(self) -> bool:
        return self.rampup is not None or self.steps is not None

    def _check_rampup(self) -> None:
        """Megatron's assertions on --rampup-batch-size, with its reasons."""
        flag, gbs = "--rampup-batch-size", self.global_batch_size
        start, incr, samples = self.rampup
        for name, value, ok in [("start batch size", start, start > 0),
                                ("batch size increment", incr, incr > 0),
                                ("ramp-up samples", samples, samples >= 0)]:
            if not ok:
                rule = "non-negative" if name == "ramp-up samples" else "positive"
                raise ScheduleError(f"{flag}: {name} should be {rule}, got {value}")
        diff = gbs - start
        if diff < 0:
            raise ScheduleError(f"{flag}: expected global batch size to be greater than or equal to start "
                                f"batch size, got --global-batch-size {gbs} and start {start}")
        if diff % incr:
            raise ScheduleError(f"{flag}: expected global batch size interval ({diff}) to be divisible by "
                                f"global batch size increment ({incr})")
        if diff == 0:  # Megatron divides by zero here
            raise ScheduleError(f"{flag}: start batch size {start} equals --global-batch-size {gbs}: "
                                "nothing to ramp up; drop --rampup-batch-size")

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples` samples."""
        if self.steps is not None:
            size = self.steps[0][1]
            for threshold, bs in self.steps:
                if consumed_samples < threshold:
                    break
                size = bs
            return size
        if self.rampup is None:
            return self.global_batch_size
        start, incr, samples = self.rampup
        if consumed_samples > samples:
            return self.global_batch_size
        # Megatron: float samples per increment, int() of the float quotient.
        per_increment = samples / ((self.global_batch_size - start) // incr)
        return start + int(consumed_samples / per_increment) * incr

    def num_microbatches(self, consumed_samples: int) -> int:
        """Microbatches of that iteration: its batch / (micro batch x data-parallel size)."""
        return self.batch_size(consumed_samples) // (self.micro_batch_size * self.data_parallel_size)

    def walk(self, consumed_samples: int = 0) -> Iterator[tuple[int, int]]:
        """(samples consumed before, batch size) of every iteration from `consumed_samples` on."""
        while True:
            size = self.batch_size(consumed_samples)
            yield consumed_samples, size
            consumed_samples += size

    def train_iters(self, train_samples: int) -> int:
        """Megatron's `update_train_iters`: the iterations `--train-samples` gives."""
        if self.steps is not None:  # every iteration that starts below train_samples
            iterations = 0
            for consumed, _ in self.walk():
                if consumed >= train_samples:
                    return iterations
                iterations += 1
        if self.rampup is None:
            return train_samples // self.global_batch_size
        # Ramp-up phase (iterations starting at or below the ramp-up samples), then whole
        # batches of the final size; a partial last batch is dropped.
        iterations, consumed = 0, 0
        for consumed, size in self.walk():
            if consumed > self.rampup[2] or consumed > train_samples:
                break
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def plan(self, start_iteration: int, start_consumed: int, end_iteration: int) -> tuple[list[int], list[int]]:
        """(samples consumed before, batch size) of iterations start_iteration+1 .. end_iteration."""
        firsts, sizes = [], []
        steps = self.walk(start_consumed)
        for _ in range(max(0, end_iteration - start_iteration)):
            first, size = next(steps)
            firsts.append(first)
            sizes.append(size)
        return firsts, sizes

    def consumed_after(self, iterations: int, start_consumed: int = 0) -> int:
        """Samples consumed after `iterations` more iterations from `start_consumed`."""
        firsts, sizes = self.plan(0, start_consumed, iterations)
        return firsts[-1] + sizes[-1] if firsts else start_consumed

    def check_sizes(self, sizes) -> None:
        """Megatron's consistency check on each batch size a run reaches: a whole number
        (>= 1) of microbatches of micro batch x data-parallel size."""
        per_step = self.micro_batch_size * self.data_parallel_size
        flag = "--step-batch-size-schedule" if self.steps is not None else "--rampup-batch-size"
        for size in sorted(set(sizes)):
            if size % per_step or size < per_step:
                raise ScheduleError(
                    f"{flag}: current global batch size ({size}) is not divisible by micro-batch-size "
                    f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})")


def from_config(cfg, data_parallel_size: int) -> BatchSchedule:
    """The schedule of a Config (its `train` section) on `data_parallel_size` ranks."""
    t = cfg.train
    steps = (parse_step_schedule(t.step_batch_size_schedule, t.seq_length)
             if t.step_batch_size_schedule is not None else None)
    return BatchSchedule(t.global_batch_size, t.micro_batch_size, data_parallel_size,
                         tuple(t.rampup_batch_size) if t.rampup_batch_size is not None else None, steps)


def for_layout(cfg, layout) -> BatchSchedule:
    """The schedule of a finalized Config on its run's `BatchLayout` (mlm_jax/batch_layout.py)."""
    return from_config(cfg, layout.data_parallel_size)


def train_sample_count(cfg, schedule: BatchSchedule) -> int:
    """Training samples the dataset is built for: Megatron's (--train-samples, else iterations x
    global batch), or more where a batch-size schedule consumes more by --train-iters."""
    t = cfg.train
    count = t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size
    return max(count, schedule.consumed_after(t.train_iters)) if schedule.varies else count


def describe(cfg, schedule: BatchSchedule) -> str:
    """One log line on a run's batch-size schedule: what it gives, and (with --train-iters) the
    samples Megatron's LR scheduler counts per iteration, which is not the batch."""
    t = cfg.train
    line = (f"> batch-size schedule: {t.train_iters} iterations, {schedule.consumed_after(t.train_iters)} "
            f"samples, global batch {schedule.batch_size(0)} first")
    if t.train_samples is None:
        line += (f"; the LR schedule counts each iteration as {t.global_batch_size} samples (micro x dp, as "
                 "Megatron does with --step-batch-size-schedule); give --train-samples for one in samples")
    if schedule.rampup is not None:
        line += ("; --rampup-batch-size is deprecated in current Megatron-LM (which ignores it for "
                 "--step-batch-size-schedule): mlm_jax keeps its earlier meaning")
    return line


class RunPlan:
    """The batches of one run from where it starts (iteration `start_iteration`, after
    `start_consumed` samples) to `end_iteration`: each iteration's batch size and the samples
    consumed before it (Megatron's consumed_train_samples)."""

    def __init__(self, schedule: BatchSchedule, start_iteration: int, start_consumed: int, end_iteration: int):
        self.schedule = schedule
        self.start_iteration, self.start_consumed = int(start_iteration), int(start_consumed)
        self.firsts, self.sizes = schedule.plan(self.start_iteration, self.start_consumed, end_iteration)

    def _index(self, iteration: int) -> int:
        i = iteration - self.start_iteration - 1
        if not 0 <= i < len(self.sizes):
            raise IndexError(f"iteration {iteration} is outside this run's plan "
                             f"({self.start_iteration + 1}..{self.start_iteration + len(self.sizes)})")
        return i

    def batch_size(self, iteration: int) -> int:
        """The global batch of iteration `iteration` (1-based)."""
        return self.sizes[self._index(iteration)]

    def first_sample(self, iteration: int) -> int:
        """The samples consumed before iteration `iteration`: its batch's first sample."""
        return self.firsts[self._index(iteration)]

    def consumed(self, iteration: int) -> int:
        """Samples consumed after iteration `iteration` (>= the start)."""
        if iteration == self.start_iteration:
            return self.start_consumed
        i = self._index(iteration)
        return self.firsts[i] + self.sizes[i]
