"""Moving bytes between tiers: one background I/O thread, a scratch directory, and raw file reads and writes."""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from plans.errors import MmplanError
from plans.units import format_bytes

ALIGN = 64  # bytes; alignment of tensors packed into one NVMe file


def check_nvme_space(directory: str | os.PathLike, needed_bytes: float) -> None:
    """Refuse (MmplanError) when `directory` does not exist or has less free space than `needed_bytes`."""
    if not os.path.isdir(directory):
        raise MmplanError(f"NVMe tier directory {os.fspath(directory)} does not exist; create it or choose another with --nvme-dir")
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise MmplanError(
            f"NVMe tier directory {os.fspath(directory)} has {format_bytes(free)} free but the plan needs "
            f"{format_bytes(needed_bytes)}; free space there or choose another directory"
        )


class TierIO:
    """One background thread (FIFO, so a file's read never overtakes its write) and a scratch directory."""

    def __init__(self, name: str, nvme_dir: str | os.PathLike | None, device: torch.device) -> None:
        self.name, self.root, self.device = name, nvme_dir, device
        self.dir: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._names = itertools.count()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._cleanup: weakref.finalize | None = None

    def submit(self, fn: Callable, *args: Any, inline: bool = False) -> Future | Done:
        """fn(*args) on the I/O thread; `inline`: here and now, as a completed Future (what a copy inside host
        memory on a CPU rank takes: no copy engine runs beside the core, and a thread hand-off costs more than the
        copy -- GIL hand-offs measured ~0.4 ms per block on the 2-core reference machine, bench/tiers_bench.py)."""
        if inline:
            return Done(fn(*args))  # its exception raises here, in the caller that would have waited for it
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mmplan-{self.name}-io")
        return self._pool.submit(fn, *args)

    def path(self) -> str:
        """A fresh file name in this component's NVMe directory (made on first use)."""
        if self.dir is None:
            if self.root is None:
                raise MmplanError(f"the NVMe tier ({self.name}) needs a directory; pass --nvme-dir")
            check_nvme_space(self.root, 0)
            self.dir = tempfile.mkdtemp(prefix=f"mmplan-{self.name}-", dir=self.root)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)  # when dropped without close()
        return os.path.join(self.dir, f"{next(self._names)}.bin")

    def unlink_later(self, path: str) -> None:
        """Delete `path` after the writes already queued (called from finalizers; never raises)."""
        try:
            if self._pool is not None:
                self._pool.submit(_unlink, path)
                return
        except RuntimeError:  # pool shut down: the directory is removed by close()
            pass
        _unlink(path)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._cleanup is not None:
            self._cleanup()  # removes the directory, once
            self.dir = None


class Done:
    """The result of work run inline, waited for like a Future (result(), done()) without a Future's lock."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value

    def done(self) -> bool:
        return True


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _buffer(t: torch.Tensor) -> memoryview:
    """A writable buffer over a contiguous CPU tensor's bytes (ctypes, not .numpy(): that would make the
    storage non-resizable for good, and parameter storages are resized)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


def write_file(path: str, data: torch.Tensor, offset: int = 0) -> None:
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.seek(offset)
        f.write(_buffer(data))


def read_file(path: str, into: torch.Tensor, offset: int = 0) -> torch.Tensor:
    with open(path, "rb") as f:
        f.seek(offset)
        n = f.readinto(_buffer(into))
    if n != into.numel() * into.element_size():
        raise MmplanError(f"NVMe tier file {path} is short: read {n} of {into.numel() * into.element_size()} bytes")
    return into


def aligned_nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor takes in a MappedFile: its size rounded up to ALIGN."""
    return -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN


class MappedFile:
    """One memory-mapped file of `nbytes` in a fresh directory under nvme_dir, handed out as zero-filled tensors
    (the NVMe tier of Adam's state and of gradients: every read and write of those tensors goes to the file,
    through the page cache). close() removes the directory; the tensors must not be used after it."""

    def __init__(self, name: str, what: str, nvme_dir: str | os.PathLike | None, nbytes: int) -> None:
        if nvme_dir is None:
            raise MmplanError(f"{what} on the NVMe tier needs a directory; pass --nvme-dir")
        check_nvme_space(nvme_dir, nbytes)
        self.dir: str | None = tempfile.mkdtemp(prefix=f"mmplan-{name}-", dir=nvme_dir)
        self.path = os.path.join(self.dir, f"{name}.bin")
        self._mmap: np.memmap | None = np.memmap(self.path, dtype=np.uint8, mode="w+", shape=(max(nbytes, 1),))
        self._offset = 0

    def zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        """The next ALIGN-aligned slice of the file as a tensor of t's dtype and shape (zeros: a new file)."""
        n = t.numel() * t.element_size()
        view = torch.from_numpy(np.asarray(self._mmap[self._offset:self._offset + n]))
        self._offset += aligned_nbytes(t)
        return view.view(t.dtype).view(t.shape)

    def flush(self) -> None:
        if self._mmap is not None:
            self._mmap.flush()

    def close(self) -> None:
        """Drop the map and remove the file and its directory (once)."""
        self._mmap = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
