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
    """flock(2) on `directory/.mmplan-lock`: exclusive for a writer, shared for readers (a reader that cannot write
    in the directory locks it without creating anything there: see _open).

    The kernel drops the lock when every process holding the file open is gone (forked ranks inherit it), so a
    SIGKILLed run never leaves a directory locked. An exclusive holder removes the lock file on release; a waiter
    that locked the removed file notices (different inode) and retries on the new one.
    """

    def __init__(self, directory: str | os.PathLike, what: str, *, shared: bool = False) -> None:
        self.directory, self.what, self.shared = Path(directory), what, shared
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self._dir_fd: int | None = None  # an exclusive holder's flock on the directory itself (see _open)

    def acquire(self) -> "DirLock":
        """Take the lock or raise MmplanError naming the holder; never waits."""
        for _ in range(100):  # retried only when a holder removed the file under us
            fd, target = self._open()
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd) if target == self.path else ""
                os.close(fd)
                self._busy(e, holder)
            if _same_file(fd, target):
                self._fd = fd
                if not self.shared:
                    self._lock_directory()
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return self
            os.close(fd)  # the previous holder removed this file while we waited on it: lock the new one
        raise MmplanError(f"cannot lock {self.what} {self.directory}: its lock file keeps changing")

    def _open(self) -> tuple[int, Path]:
        """The file to flock and its path: the lock file, created if missing. A reader of a directory it cannot
        write in (a read-only checkpoint resumed from) opens an existing lock file read-only, or else locks the
        directory itself -- which every exclusive holder also locks (_lock_directory), so the two still exclude."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), self.path
        except OSError as e:
            if not self.shared or e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise MmplanError(f"cannot use {self.what} {self.directory}: {e.strerror or e}") from None
        with contextlib.suppress(OSError):
            return os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), self.path
        try:
            return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), self.directory
        except OSError as e:
            raise MmplanError(f"cannot use {self.what} {self.directory}: {e.strerror or e}") from None

    def _lock_directory(self) -> None:
        """An exclusive holder also flocks the directory, excluding readers that could not create the lock file
        (best effort: a file system without flock on directories has no such readers either)."""
        try:
            self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            fcntl.flock(self._dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._dir_fd)
            self._dir_fd = None
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                self.release()
                self._busy(e, "")

    def _busy(self, e: OSError, holder: str) -> None:
        if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise MmplanError(f"{self.what} {self.directory} is in use by another mmplan run{holder}; "
                              "wait for it to finish or choose another directory") from None
        raise MmplanError(f"cannot lock {self.what} {self.directory}: {e.strerror or e}") from None

    def release(self) -> None:
        """Unlock (removing the lock file when exclusive); idempotent."""
        if self._fd is None:
            return
        if not self.shared:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)  # closing drops the flock
        self._fd = self._dir_fd = None

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


class FileLock:
    """An exclusive flock(2) on a file itself, for a run's --log: a second run writing into the same log is refused
    (two writers, each at its own offset, tore each other's lines). The file is created when missing (its run
    removes it again if it fails before writing); the kernel drops the lock when its holders are gone."""

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    def acquire(self) -> "FileLock":
        """Take the lock or raise MmplanError; never waits."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise MmplanError(f"cannot use {self.what} {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise MmplanError(f"{self.what} {self.path} is being written by another run; give each run its own log") from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
