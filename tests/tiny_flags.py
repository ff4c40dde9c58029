"""The command-line face of the tiny test model: one flag list every file that runs
`mlm_jax.train` starts from, and one helper that runs it and reads its metrics back.

The same flags give the same compiled programs, so runs in different files share them (the
persistent compilation cache, and within a process jax's own)."""

from __future__ import annotations

import json
import os
import re

# The model of tests/parallel_util.py (2 layers, d64, 8 heads, vocab 500, seq 32) on mock data,
# with the console quiet: every run adds only its batch, optimizer and layout flags.
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "500",
        "--no-progress-bar", "--sample-tokens", "0"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def xla_flags_for(devices: int | None) -> str:
    """The suite's XLA_FLAGS (conftest: cheap CPU code generation) for a child process with
    `devices` CPU devices (None: no count, the child's MLM_JAX_CPU_DEVICES decides); a child
    given only the device count compiles at full optimisation."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return flags if devices is None else f"{flags} --xla_force_host_platform_device_count={devices}".strip()


def tiny(*flags: str) -> list[str]:
    """TINY followed by `flags` (a later flag wins, as on the command line)."""
    return [*TINY, *map(str, flags)]


def train_run(argv: list[str], run_dir) -> tuple[dict, list[dict], str]:
    """(summary, metrics.jsonl records, the log text) of `mlm_jax.train` with `argv` + --run-dir."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.train import train

    logs: list = []
    summary = train(parse_args([*argv, "--run-dir", str(run_dir)]), log=logs.append)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return summary, records, "\n".join(map(str, logs))
