"""What a long run needs to be watched: per-iteration timers, slow-iteration warnings, profiler
traces, step memory, and Weights & Biases next to TensorBoard.

Timers. The loop keeps one step in flight (step i is dispatched before step i-1's results are
read), so iteration i is timed from the moment step i-1's outputs were ready to the moment step
i's are: in steady state that is the step time, and the times add up to the wall time. Its
parts are what the host did in between: `data_wait` (blocked on the loader), `checkpoint`
(blocked saving), `eval` (validation) and `step` (the rest: dispatch and waiting for the device).
`Instruments.window()` averages them over a log interval, like Megatron's timers.

A slow iteration (straggler): one that takes more than `--slow-iteration-factor` (default 3)
times the median of the last 50 is reported with its timers, so a data stall, a checkpoint or a
slow step (another host, a throttled GPU) can be told apart. In a multi-host run every step is
synchronous, so process 0 sees a straggler anywhere; the timers are process 0's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import statistics
import time
from typing import Any, Callable

from mlm_jax.config import InstrumentsConfig
from mlm_jax.metrics import Logger

TIMERS = ("data_wait", "checkpoint", "eval", "step")


class Instruments:
    """Per-iteration timers, slow-iteration detection and the profiler window of one run.

    Call `reset()` after the first (compiling) step, then `step_finished(i, outputs_of_step_i)`
    once per iteration, after step i+1 is dispatched; `add("data_wait", s)`, `timed("checkpoint")`
    and `timed("eval")` record the parts; `window()` summarises the log interval.
    """

    def __init__(self, cfg: InstrumentsConfig, *, profile_dir: str | None = None, main: bool = True,
                 clock: Callable[[], float] = time.perf_counter, history: int = 50, min_history: int = 5):
        self.cfg = cfg
        self.main = main
        self.clock = clock
        self.profile_dir = profile_dir
        self.min_history = min_history
        self.history: collections.deque[float] = collections.deque(maxlen=history)
        self.current = dict.fromkeys(TIMERS, 0.0)
        self.mark: float | None = None
        self.window_records: list[dict[str, float]] = []
        self.tracing = False

    # -- timers ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the compile step: the clock restarts at the next `step_finished`."""
        self.mark = None
        self.current = dict.fromkeys(TIMERS, 0.0)

    def add(self, name: str, seconds: float) -> None:
        self.current[name] += seconds

    @contextlib.contextmanager
    def timed(self, name: str):
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - t0)

    def step_finished(self, iteration: int, outputs: Any = None) -> dict[str, Any] | None:
        """Wait for step `iteration`'s `outputs`; its time runs from the previous step's end to
        now, with the timers recorded in between. Returns a slow-iteration record or None."""
        if outputs is not None:
            import jax

            jax.block_until_ready(outputs)
        now = self.clock()
        if self.mark is None:
            self.mark = now
            self.current = dict.fromkeys(TIMERS, 0.0)
            return None
        total, self.mark = now - self.mark, now
        timers = {f"{k}_ms": 1000 * v for k, v in self.current.items() if k != "step"}
        timers["step_ms"] = max(0.0, 1000 * total - sum(timers.values()))
        self.current = dict.fromkeys(TIMERS, 0.0)
        record = {"iteration_ms": 1000 * total, **timers}
        self.window_records.append(record)
        # An evaluation is expected to take long; it is timed but not judged.
        judged = record["iteration_ms"] - timers["eval_ms"]
        slow = None
        factor = self.cfg.slow_iteration_factor
        if factor > 0 and len(self.history) >= self.min_history:
            median = statistics.median(self.history)
            if judged > factor * median:
                slow = {"iteration": iteration, "slow_iteration_ms": judged,
                        "median_iteration_ms": median, **timers}
        self.history.append(judged)
        return slow

    def window(self) -> dict[str, float]:
        """Mean of each timer over the iterations since the last call, and the slowest one."""
        recs, self.window_records = self.window_records, []
        if not recs:
            return {}
        out = {f"{k}_ms": statistics.fmean(r[f"{k}_ms"] for r in recs) for k in TIMERS}
        out["max_iteration_ms"] = max(r["iteration_ms"] for r in recs)
        return out

    # -- profiler -------------------------------------------------------------------------
    def before_step(self, iteration: int) -> None:
        """Megatron's window: the trace starts before iteration `start + 1` ..."""
        if (self.cfg.profile and self.main and not self.tracing
                and iteration == self.cfg.profile_step_start + 1 and self.profile_dir):
            import jax

            os.makedirs(self.profile_dir, exist_ok=True)
            jax.profiler.start_trace(self.profile_dir)
            self.tracing = True

    def after_step(self, iteration: int, outputs: Any, last: bool = False) -> None:
        """... and stops once iteration `end` has run on the device (or training ended)."""
        if self.tracing and (iteration >= self.cfg.profile_step_end or last):
            import jax

            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.tracing = False

    def step_annotation(self, iteration: int):
        """Names the step in a profiler trace (a no-op outside one)."""
        if not self.tracing:
            return contextlib.nullcontext()
        import jax

        return jax.profiler.StepTraceAnnotation("train", step_num=iteration)

    def close(self) -> None:
        if self.tracing:
            import jax

            jax.profiler.stop_trace()
            self.tracing = False


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a step time into tokens/s and MFU: tokens per iteration, model FLOPs per token
    (causal attention, and Megatron's full-attention count), devices and their peak."""

    tokens_per_iter: int
    flops_causal: float
    flops_full: float
    devices: int
    peak: float  # FLOP/s per device
    peak_source: str  # "given", "datasheet <device kind>" or "measured"

    def figures(self, step_s: float) -> dict[str, float | str]:
        tps = self.tokens_per_iter / step_s
        return {"tokens_per_sec": tps, "mfu": tps * self.flops_causal / self.devices / self.peak,
                "mfu_megatron_full_attention": tps * self.flops_full / self.devices / self.peak,
                "mfu_peak_source": self.peak_source}


def exclude_from_rate(bar, seconds: float) -> None:
    """Leave `seconds` (evaluation, a checkpoint save, compiling) out of a tqdm bar's rate: tqdm
    has no pause, so its clocks move forward by as much (its elapsed time shows the same)."""
    if bar is None or getattr(bar, "disable", True):
        return
    bar.start_t += seconds
    bar.last_print_t += seconds


def iteration_record(iteration: int, global_batch_size: int, metrics: dict[str, float], step_s: float,
                     data_wait_s: float, throughput: Throughput, *extra: dict,
                     consumed_samples: int | None = None) -> dict[str, Any]:
    """The metrics-file record of a logged iteration; `metrics` holds host floats (lm_loss, lr,
    grad_norm), `step_s` the mean step time of the log window, `extra` memory and timers;
    `global_batch_size` is this iteration's, `consumed_samples` the samples consumed after it
    (default: iteration x global batch, a constant batch from the start)."""
    if consumed_samples is None:
        consumed_samples = iteration * global_batch_size
    record = {"iteration": iteration, "consumed_samples": int(consumed_samples), "global_batch_size": global_batch_size,
              "lm_loss": metrics["lm_loss"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
              "step_time_ms": 1000 * step_s, "data_wait_ms": 1000 * data_wait_s,
              **throughput.figures(step_s)}
    for more in extra:
        record.update(more)
    return record


def iteration_line(record: dict[str, Any], train_iters: int, global_batch_size: int) -> str:
    """Megatron's console line for `record` (and the figures Megatron does not print)."""
    r = record
    line = (f" iteration {r['iteration']:8d}/{train_iters:8d} | consumed samples: "
            f"{r['consumed_samples']:12d} | elapsed time per iteration (ms): {r['step_time_ms']:.1f} | "
            f"learning rate: {r['lr']:.6E} | global batch size: {global_batch_size:5d} | "
            f"lm loss: {r['lm_loss']:.6E} | {_scaling(r, 'loss_scale')}grad norm: {r['grad_norm']:.3f} | "
            f"{_scaling(r, 'skipped_iterations')}"
            f"tokens/s: {r['tokens_per_sec']:,.0f} | MFU (causal): {100 * r['mfu']:.1f}% | "
            f"MFU (Megatron, full attention): {100 * r['mfu_megatron_full_attention']:.1f}% | "
            f"data wait (ms): {r['data_wait_ms']:.1f} |")
    if r.get("checkpoint_ms", 0) >= 1:
        line += f" checkpoint (ms): {r['checkpoint_ms']:.1f} |"
    if "max_iteration_ms" in r:
        line += f" slowest iteration (ms): {r['max_iteration_ms']:.1f} |"
    if "bytes_in_use" in r:
        line += (f" memory (GiB): {r['bytes_in_use'] / 2**30:.2f} in use, "
                 f"{r.get('peak_bytes_in_use', 0) / 2**30:.2f} peak |")
    return line


def _scaling(record: dict[str, Any], key: str) -> str:
    """Megatron's loss-scaling fields of the line (fp16 runs only; '' otherwise)."""
    if key not in record:
        return ""
    if key == "loss_scale":
        return f"loss scale: {record[key]:.1f} | "
    return f"number of skipped iterations: {record[key]:3d} | "


def validation_line(iteration: int, loss: float, ppl: float) -> str:
    return (f" validation loss at iteration {iteration:6d} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {ppl:.6E} |")


def step_memory_line(mem: dict[str, int]) -> str:
    mib = lambda key: mem.get(key, 0) / 2**20  # noqa: E731
    return ("> step memory per device (XLA memory analysis; these devices report no live memory): "
            f"{mib('compiled_total_bytes'):.1f} MiB = arguments {mib('compiled_argument_bytes'):.1f} + "
            f"outputs {mib('compiled_output_bytes'):.1f} - donated {mib('compiled_alias_bytes'):.1f} + "
            f"temporaries {mib('compiled_temp_bytes'):.1f}")


def slow_iteration_line(slow: dict[str, Any]) -> str:
    return (f" warning: slow iteration {slow['iteration']}: {slow['slow_iteration_ms']:.1f} ms, "
            f"{slow['slow_iteration_ms'] / max(slow['median_iteration_ms'], 1e-9):.1f}x the running median "
            f"{slow['median_iteration_ms']:.1f} ms | data wait (ms): {slow['data_wait_ms']:.1f} | "
            f"checkpoint (ms): {slow['checkpoint_ms']:.1f} | step (ms): {slow['step_ms']:.1f} |")


def step_memory(compiled_fn, *args) -> dict[str, int]:
    """Per-device bytes of a compiled step from XLA's memory analysis (arguments, outputs,
    temporaries, aliased): the figure on backends whose devices report no live memory (CPU).
    `compiled_fn.lower(*args)` hits the compile cache when the step has run with these args."""
    try:
        analysis = compiled_fn.lower(*args).compile().memory_analysis()
    except Exception:  # a backend without memory analysis: nothing to report
        return {}
    if analysis is None:
        return {}
    out = {}
    for key in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes"):
        value = getattr(analysis, key, None)
        if value is not None:
            out["compiled_" + key.replace("_size_in_bytes", "_bytes")] = int(value)
    if out:
        # Donated inputs alias outputs: live at peak = arguments + outputs - aliased + temporaries.
        out["compiled_total_bytes"] = (out.get("compiled_argument_bytes", 0) + out.get("compiled_output_bytes", 0)
                                       - out.get("compiled_alias_bytes", 0) + out.get("compiled_temp_bytes", 0))
    return out


class RunLogger(Logger):
    """The metrics Logger (console, JSON lines, TensorBoard), plus Weights & Biases if asked."""

    def __init__(self, metrics_file, tensorboard_dir, write, wandb: "Wandb"):
        super().__init__(metrics_file, tensorboard_dir, write=write)
        self.wandb = wandb

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        super().log(record, console)
        if self.main:
            self.wandb.log(record)

    def close(self) -> None:
        super().close()
        self.wandb.close()


class Wandb:
    """Weights & Biases next to TensorBoard, on process 0, when `wandb` can be imported."""

    def __init__(self, cfg: InstrumentsConfig, config: Any, run_dir: str, main: bool, log=print):
        self.run = None
        if not (cfg.wandb_project and main):
            return
        try:
            import wandb
        except ImportError:
            log(f"> --wandb-project {cfg.wandb_project}: wandb is not installed (pip install wandb); "
                "logging to TensorBoard and the metrics file only")
            return
        self.wandb = wandb
        self.run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name,
                              dir=cfg.wandb_save_dir or run_dir,
                              config=dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config)

    def log(self, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        values = {k: v for k, v in record.items()
                  if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if values:
            self.wandb.log(values, step=int(record["iteration"]))

    def close(self) -> None:
        if self.run is not None:
            self.wandb.finish()
            self.run = None
