"""How every command-line entry point ends: one `error:` line, and an exit code that means something
(the errors and their codes: `mlm_jax/errors.py`).

`cli(main)` wraps an entry point's `main(argv) -> int` so that every failure ends as `report`
says; the last line a failed command prints is always `error: ...`. This module imports no jax:
the data tools use it.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence

from mlm_jax.distributed import fail
from mlm_jax.errors import DEBUG_ENV, RunFailure, UsageError, debug, exit_code


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
        ours = isinstance(exc, (UsageError, RunFailure, KeyboardInterrupt))
        return fail(describe(exc), exit_code(exc), suspect_peers=not ours)
    print(f"error: {describe(exc)}", file=sys.stderr, flush=True)
    return exit_code(exc)


def cli(main: Callable[[Sequence[str] | None], int | None]) -> Callable[[Sequence[str] | None], int]:
    """Wrap an entry point so that every failure ends as `report` says."""

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None, **options) -> int:
        try:
            return int(main(argv, **options) or 0)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure becomes one named line
            return report(exc)

    return wrapped
