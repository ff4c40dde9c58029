"""Output paths checked at the edge, before any work: a run must not train for an hour and then
find that its --save folder is a file or cannot be written.

`writable_dir(path, flag)` and `writable_file(path, flag)` create nothing; they prove the folder
(or, where it does not exist yet, its nearest existing ancestor) writable by creating and
removing a probe file: `os.access` says
yes to root on a read-only or immutable folder, a real write does not. Errors are
`UsageError`s that name the flag, the path and the reason.

Input paths: `not_there(path, kind)` says why a path is not the folder (or file) a flag reads, so
that a file given where a folder is needed is called a file, not missing. `inside(folder, name)`:
a file name read from inside a checkpoint or model folder, resolved, or None where it leads out
of that folder (an absolute path, `../`, a symlink pointing elsewhere).

Writes: `naming(path)` makes an OSError raised inside it name `path` where it names no file (a
full disk's `[Errno 28] No space left on device` from a write or a flush names none).
"""

from __future__ import annotations

import contextlib
import os
import socket

from mlm_jax.errors import UsageError


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


@contextlib.contextmanager
def naming(path: str):
    """Writes to `path` inside: an OSError that names no file is raised again naming `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def writable_dir(path: str, flag: str, shown: str | None = None) -> str:
    """The absolute folder `path`, proven creatable and writable; else a UsageError naming
    `flag` and `shown` (default `path`; `writable_file`: the file the folder is for).

    Nothing is created: a folder that does not exist yet is checked through its nearest
    existing ancestor, so a run that stops at a later check leaves no trace on disk."""
    full = os.path.abspath(path)
    what = path if shown is None else shown
    if os.path.exists(full) and not os.path.isdir(full):
        raise UsageError(f"{flag} {what}: exists and is a file, not a folder")
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {what}: cannot create the folder: {existing} is a file, not a folder")
    probe = os.path.join(existing, f".mlm_jax-write-test-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        folder = "the folder" if shown is None else f"its folder {existing}"
        why = f"{folder} is not writable" if existing == full else f"cannot create it in {existing}"
        raise UsageError(f"{flag} {what}: {why} ({_reason(e)})") from e
    return full


def writable_file(path: str, flag: str) -> str:
    """The absolute file `path` (its folder created if missing), writable; else a UsageError."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    parent = os.path.dirname(full)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise UsageError(f"{flag} {path}: cannot create the file: {parent} is a file, not a folder")
    writable_dir(parent, flag, path)
    if os.path.exists(full):
        try:
            with open(full, "a"):
                pass
        except OSError as e:
            raise UsageError(f"{flag} {path}: the file is not writable ({_reason(e)})") from e
    return full


def not_there(path: str, kind: str = "folder") -> str | None:
    """Why `path` is not the existing `kind` an input flag needs ("folder", "file", or a noun ending
    in either: "checkpoint folder"): "no such folder", "is a file, not a folder" (or the reverse);
    None when it is one. Callers raise their own error naming the flag, so a file given for a
    folder is never called missing."""
    folder = kind.endswith("folder")
    if not os.path.exists(path):
        return f"no such {kind}"
    if os.path.isdir(path) != folder:
        return f"is a {'file' if folder else 'folder'}, not a {kind}"
    return None


def inside(folder: str, name: str) -> str | None:
    """The real path of `name` (a file name a checkpoint or model folder's own index gives) joined
    to `folder`, or None where it resolves outside `folder`: an index must not make a reader open
    /etc/passwd or another folder's weights."""
    if not isinstance(name, str) or not name or "\0" in name:
        return None
    root = os.path.realpath(folder)
    full = os.path.realpath(os.path.join(root, name))
    return full if os.path.commonpath([root, full]) == root and full != root else None
