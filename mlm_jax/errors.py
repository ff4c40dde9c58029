"""The errors of a run that the user can act on, and the exit code each means. The ground of the
import graph: this module imports nothing of mlm_jax (and no jax), so every module may use it.

- `UsageError` (exit 2): the user asked for something that cannot run: a bad flag, value,
  file or combination. The message names the flag, file or value and what would be valid.
  `ConfigError` is the one for a configuration (a flag's value, or flags that do not go together).
- `RunFailure` (exit 1): the run started and could not go on (a failed save, a dead peer
  process, NaN loss). The message says what failed and where.
- anything else (exit 1): a bug or an unexpected failure; shown as one line naming the
  exception, with the traceback only under `MLM_JAX_DEBUG=1`.
- Ctrl-C (exit 130): one line, never a `KeyboardInterrupt` traceback.

How a command-line entry point turns these into its last line and exit code: `mlm_jax/cli.py`.
"""

from __future__ import annotations

import os

DEBUG_ENV = "MLM_JAX_DEBUG"
EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(ValueError):
    """Input that cannot run (exit 2); the message names the flag, file or value."""


class ConfigError(UsageError):
    """A configuration that cannot run; the message names the values and the rule."""


class RunFailure(RuntimeError):
    """A run that started and could not go on (exit 1); the message says what failed."""


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_RUNTIME
