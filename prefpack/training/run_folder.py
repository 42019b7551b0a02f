"""The run folder's lock: one `train` at a time on a `run.output_dir`.

`RUN_DIR/.prefpack-lock` holds the pid and host of the process training there, under an exclusive `flock` for as
long as it trains (the kernel lets go of it when the process dies, however it dies). A second `train` on the folder
is refused with a message naming the holder; a lock file left by a process that is gone (this host, pid no longer
running) is taken over with a message. A lock file naming another host whose lock is free is refused too (a
filesystem shared between machines may not share `flock`): remove it once that run is certainly over. Under
torchrun only rank 0 takes it. `train` here is `loop.train` run under the lock (the public `prefpack.training.train`).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from pathlib import Path

from prefpack.errors import PrefpackError
from prefpack.stale import pid_alive

LOCK_FILE = ".prefpack-lock"


class RunFolderLocked(PrefpackError, OSError):
    """Another process trains in this run folder (or its lock file cannot be taken)."""


def _holder(text: str) -> tuple[int, str]:
    """(pid, host) written in a lock file; (0, "") when unreadable."""
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    try:
        return int(fields.get("pid", "0")), fields.get("host", "")
    except ValueError:
        return 0, fields.get("host", "")


class RunLock:
    """An exclusive lock on a run folder, held until `release()` (or the process's end)."""

    def __init__(self, run_dir: str | os.PathLike, *, log: Callable[[str], None] = print):
        import fcntl

        self.path = Path(run_dir) / LOCK_FILE
        self.created = not Path(run_dir).exists()  # removed again if the run leaves it empty (a refused config)
        try:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise RunFolderLocked(f"cannot create the run folder's lock {str(self.path)!r}: {exc.strerror or exc}; "
                                  "choose a run.output_dir you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:  # its holder removed it as we opened it
                raise OSError(errno.EWOULDBLOCK, "lock file replaced")
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunFolderLocked(f"cannot lock {str(self.path)!r}: {exc}") from None
            pid, host = _holder(self._read())
            who = f"process {pid} on {host}" if pid else "another process"
            raise RunFolderLocked(f"run folder {str(Path(run_dir))!r} is in use: {who} is training there (lock "
                                  f"{str(self.path)!r}); wait for it to finish or stop it, or choose another "
                                  "run.output_dir") from None
        self.fd = fd
        pid, host = _holder(self._read())
        here = socket.gethostname()
        if pid and host and host != here:
            self.release(remove=False)
            raise RunFolderLocked(f"run folder {str(Path(run_dir))!r} is locked by process {pid} on {host} "
                                  f"({str(self.path)!r}); this machine cannot tell whether it still runs. If that "
                                  "run is over, remove the lock file and train again")
        if pid and pid != os.getpid() and not pid_alive(pid):
            log(f"took over the lock of run folder {str(Path(run_dir))!r} from process {pid}, which is no longer "
                "running")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()}\nhost={here}\n".encode(), 0)

    def _read(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def release(self, *, remove: bool = True) -> None:
        """Let go of the lock; its file is removed first (still ours while locked)."""
        fd, self.fd = getattr(self, "fd", None), None
        if fd is None:
            return
        if remove:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(fd)  # closing the descriptor releases the flock
        if remove and self.created:
            try:
                self.path.parent.rmdir()  # only if empty
            except OSError:
                pass


def train(cfg, **kwargs):
    """`prefpack.training.loop.train` under the run folder's lock (rank 0 takes it; see the module's doc)."""
    from prefpack.training.loop import train as train_unlocked

    if int(os.environ.get("RANK", "0")) != 0:
        return train_unlocked(cfg, **kwargs)
    lock = RunLock(cfg.run.output_dir, log=kwargs.get("log", print))
    try:
        return train_unlocked(cfg, **kwargs)
    finally:
        lock.release()
