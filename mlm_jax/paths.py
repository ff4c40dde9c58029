"""Output paths checked at the edge, before any work: a run must not train for an hour and then
find that its --save folder is a file or cannot be written.

`writable_dir(path, flag)` and `writable_file(path, flag)` create what is missing (as the run
would) and prove the folder writable by creating and removing a probe file: `os.access` says
yes to root on a read-only or immutable folder, a real write does not. Errors are
`UsageError`s that name the flag, the path and the reason.
"""

from __future__ import annotations

import os
import socket

from mlm_jax.errors import UsageError


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def writable_dir(path: str, flag: str) -> str:
    """The absolute folder `path`, created if missing and proven writable; else a UsageError."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise UsageError(f"{flag} {path}: exists and is a file, not a folder")
    try:
        os.makedirs(full, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create the folder ({_reason(e)}"
                         + (f": {e.filename}" if e.filename and e.filename != full else "") + ")") from e
    probe = os.path.join(full, f".mlm_jax-write-test-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"{flag} {path}: the folder is not writable ({_reason(e)})") from e
    return full


def writable_file(path: str, flag: str) -> str:
    """The absolute file `path` (its folder created if missing), writable; else a UsageError."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    parent = os.path.dirname(full)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: cannot create the file: {parent} is a file, not a folder")
    writable_dir(parent, flag)
    if os.path.exists(full):
        try:
            with open(full, "a"):
                pass
        except OSError as e:
            raise UsageError(f"{flag} {path}: the file is not writable ({_reason(e)})") from e
    return full
