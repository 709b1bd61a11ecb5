"""Exclusive use of a directory by one run: an flock on a lock file inside it, released even when the holder is killed."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from plans.errors import MmplanError

LOCK_NAME = ".mmplan-lock"


class DirLock:
    """flock(2) on `directory/.mmplan-lock`: exclusive for a writer, shared for readers.

    The kernel drops the lock when every process holding the file open is gone (forked ranks inherit it), so a
    SIGKILLed run never leaves a directory locked. An exclusive holder removes the lock file on release; a waiter
    that locked the removed file notices (different inode) and retries on the new one.
    """

    def __init__(self, directory: str | os.PathLike, what: str, *, shared: bool = False) -> None:
        self.directory, self.what, self.shared = Path(directory), what, shared
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> "DirLock":
        """Take the lock or raise MmplanError naming the holder; never waits."""
        for _ in range(100):  # retried only when a holder removed the file under us
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise MmplanError(f"cannot use {self.what} {self.directory}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise MmplanError(f"{self.what} {self.directory} is in use by another mmplan run{holder}; "
                                      "wait for it to finish or choose another directory") from None
                raise MmplanError(f"cannot lock {self.what} {self.directory}: {e.strerror or e}") from None
            if _same_file(fd, self.path):
                self._fd = fd
                if not self.shared:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return self
            os.close(fd)  # the previous holder removed this file while we waited on it: lock the new one
        raise MmplanError(f"cannot lock {self.what} {self.directory}: its lock file keeps changing")

    def release(self) -> None:
        """Unlock (removing the lock file when exclusive); idempotent."""
        if self._fd is None:
            return
        if not self.shared:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self._fd)  # closing drops the flock
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def is_locked(directory: str | os.PathLike) -> bool:
    """True when some live process holds `directory`'s lock (exclusively or shared)."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {text})" if text.isdigit() else ""
