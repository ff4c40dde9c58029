"""One training run per --save folder: a second run writing into the same folder would interleave
its checkpoints with the first's (one run reported iteration 5 committed while `5/` held the other
run's parameters, and the other failed on a temporary folder that vanished under it).

Process 0 of a run takes `SaveLock` on `<save>/.mlm_jax.lock` before its first step and holds it
for the run's life: an exclusive `flock` on the open file, which the kernel releases on every exit
path, kill -9 included, so a dead run leaves no stale lock behind. The file holds the owner's pid,
host, start time and run folder, which the refusal names. Where the filesystem has no `flock`
(some network mounts), the file itself is the lock (created exclusively), and one whose owner is
a dead process on this host is taken over; one from another host is reported with its owner.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from mlm_jax.errors import UsageError

LOCK_NAME = ".mlm_jax.lock"


def _owner(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(owner: dict) -> str:
    if not owner:
        return "another process"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    run = f", run folder {owner['run_dir']}" if owner.get("run_dir") else ""
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {when}{run}"


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # someone else's process (or no pid): not ours to call dead
    return True


class SaveLock:
    """The lock of one save folder, held from `take` until `release` (or the process's end)."""

    def __init__(self, path: str, fd: int | None, created: bool = False):
        self.path, self.fd, self.created = path, fd, created

    @classmethod
    def take(cls, save: str, run_dir: str = "") -> "SaveLock":
        """Lock `save` (created if needed) for this run; a UsageError naming the folder and the
        other run where one holds it."""
        created = not os.path.isdir(save)
        os.makedirs(save, exist_ok=True)
        path = os.path.join(save, LOCK_NAME)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "run_dir": run_dir}
        for _ in range(10):  # the file may be replaced between open and lock: take the one in place
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UsageError(f"--save {save}: another training run is writing checkpoints into this folder "
                                     f"({_describe(_owner(path))}); give another --save folder, or stop that run "
                                     "first") from None
                return cls._exclusive_file(save, path, me, created)  # no flock here (ENOLCK, EOPNOTSUPP)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # released and removed by its owner as we opened it
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(me).encode())
            return cls(path, fd, created)
        raise UsageError(f"--save {save}: could not lock {path} (it kept being replaced)")

    @classmethod
    def _exclusive_file(cls, save: str, path: str, me: dict, created: bool) -> "SaveLock":
        """The lock where flock is not available: the file created with O_EXCL."""
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = _owner(path)
                if owner.get("host") == me["host"] and not _alive(owner.get("pid")):
                    os.unlink(path)  # stale: its process is gone
                    continue
                raise UsageError(f"--save {save}: another training run is writing checkpoints into this folder "
                                 f"({_describe(owner)}; {path}); give another --save folder, or stop that run "
                                 "first (delete the file if that run is gone)") from None
            os.write(fd, json.dumps(me).encode())
            os.close(fd)
            return cls(path, None, created)
        raise UsageError(f"--save {save}: could not take {path}")

    def release(self) -> None:
        """Remove the lock file and let go (idempotent); a save folder `take` created and nothing
        was written into goes too (a run refused at a later check leaves no trace)."""
        if self.path is None:
            return
        try:
            os.unlink(self.path)
        except OSError:  # gone, or the folder turned read-only: the flock still goes with the fd
            pass
        if self.fd is not None:
            os.close(self.fd)
        if self.created:
            try:
                os.rmdir(os.path.dirname(self.path))
            except OSError:
                pass  # checkpoints in it (or not empty): kept
        self.path, self.fd = None, None
