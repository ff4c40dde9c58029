"""How every command-line entry point ends: one `error:` line, and an exit code that means something.

- `UsageError` (exit 2): the user asked for something that cannot run: a bad flag, value,
  file or combination. The message names the flag, file or value and what would be valid.
- `RunFailure` (exit 1): the run started and could not go on (a failed save, a dead peer
  process, NaN loss). The message says what failed and where.
- anything else (exit 1): a bug or an unexpected failure; shown as one line naming the
  exception, with the traceback only under `MLM_JAX_DEBUG=1`.
- Ctrl-C (exit 130): one line, never a `KeyboardInterrupt` traceback.

`cli(main)` wraps an entry point's `main(argv) -> int` so that all of this holds; the last line a
failed command prints is always `error: ...`. This module imports no jax: the data tools use it.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable, Sequence

DEBUG_ENV = "MLM_JAX_DEBUG"
EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(ValueError):
    """Input that cannot run (exit 2); the message names the flag, file or value."""


class RunFailure(RuntimeError):
    """A run that started and could not go on (exit 1); the message says what failed."""


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_RUNTIME


def describe(exc: BaseException) -> str:
    """The one-line message for `exc`: our own errors speak for themselves, others are named."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    text = " ".join(str(exc).split()) if not isinstance(exc, (UsageError, RunFailure)) else str(exc)
    if isinstance(exc, (UsageError, RunFailure)):
        return text
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    hint = "" if debug() else f" (set {DEBUG_ENV}=1 for the traceback)"
    return f"{type(exc).__name__}: {text}{hint}"


def report(exc: BaseException) -> int:
    """Print `exc` as the `error:` line (traceback first under MLM_JAX_DEBUG) and return the
    exit code; in a multi-process run the process leaves at once (see `distributed.fail`)."""
    if debug() and not isinstance(exc, KeyboardInterrupt):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    if "jax" in sys.modules:  # only then can this be a multi-process run
        from mlm_jax.distributed import fail

        ours = isinstance(exc, (UsageError, RunFailure, KeyboardInterrupt))
        return fail(describe(exc), exit_code(exc), suspect_peers=not ours)
    print(f"error: {describe(exc)}", file=sys.stderr, flush=True)
    return exit_code(exc)


def cli(main: Callable[[Sequence[str] | None], int | None]) -> Callable[[Sequence[str] | None], int]:
    """Wrap an entry point so that every failure ends as `report` says."""

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None) -> int:
        try:
            return int(main(argv) or 0)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure becomes one named line
            return report(exc)

    return wrapped
