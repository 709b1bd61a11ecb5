"""A training process keeps the host memory it frees (glibc malloc), so that steady-state steps take no page faults.

By default glibc serves every allocation above a threshold (128 KiB, rising as such blocks are freed, to at most
32 MiB) with a fresh mmap, unmaps it when freed, and returns the top of the heap to the kernel once more than
128 KiB of it is free. A training step allocates and frees the same activations, gradients and optimizer
temporaries every step, so on a CPU rank each step pays a page fault per 4 KiB page of them again. Measured on a
2-vCPU KVM guest, alternated with glibc's defaults: `mmplan demo`'s solved plan (2 gloo ranks, 14-step runs)
244-259 ms per step by default against 200-210 ms with the memory kept; the demo model's Adam step in one process
66.6 ms against 29.8 ms (bench/host_memory_bench.py).
PyTorch's performance guide recommends jemalloc or TCMalloc for CPU training for the same reason; these settings
get most of that from glibc itself (mallopt(3)): every block up to 32 MiB (glibc's largest mmap threshold on
64-bit) from the heap, and freed heap memory kept up to 1 GiB.

Called by every rank process (runtime/launch.py: `mmplan run`, and `mmplan calibrate`'s probes) and by `mmplan
profile --measure` on the CPU (planner/profiler/profile.py), so what is measured runs as `mmplan run` trains. A variable the user set (MALLOC_*_, GLIBC_TUNABLES with glibc.malloc) wins; on
a C library without mallopt (macOS, musl) nothing changes.
"""
from __future__ import annotations

import ctypes
import os

# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: glibc refuses more
TRIM_THRESHOLD = 2**30  # free memory kept at the top of the heap before any is returned
TOP_PAD = 16 * 2**20  # extra heap requested per sbrk, so a growing step does not extend the heap page by page
_USER_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")

_applied: bool | None = None


def user_tuned(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the environment already tunes glibc's malloc (then it is left as the user set it)."""
    return any(v in environ for v in _USER_VARS) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Apply the settings above to this process once; True when they are in force."""
    global _applied
    if _applied is None:
        _applied = False if user_tuned() else _mallopt()
    return _applied


def _mallopt() -> bool:
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
