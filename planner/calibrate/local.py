"""The measurements `mmplan calibrate` takes in the calling process: CUDA, the disk, host memory and the CPU's name."""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from planner.calibrate.fit import fit_alpha_beta
from planner.calibrate.probes import call_time
from planner.calibrate.settings import KiB, MiB, Reporter, Settings


def mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return "cpu"


def measure_cuda(settings: Settings, report: Reporter) -> dict[str, Any]:
    """bf16 matmul sweep, fp32 (TF32 off) and fp16 peaks, HBM copy bandwidth, pinned host->device copies."""
    dev = torch.device("cuda", 0)

    def timed(fn: Callable[[], Any], budget: float) -> float:
        def synced() -> None:
            fn()
            torch.cuda.synchronize(dev)
        return call_time(synced, budget)

    sizes = (256, 1024, 4096) if settings.point_budget_s < 0.1 else (256, 512, 1024, 2048, 4096, 8192)
    matmul = []
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        matmul.append((n, 2 * n**3 / timed(lambda: torch.mm(a, b), settings.point_budget_s)))
    peaks = {"bf16": max(rate for _, rate in matmul)}
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for dtype, key in ((torch.float32, "fp32"), (torch.float16, "fp16")):
            a = torch.randn(4096, 4096, device=dev, dtype=dtype)
            b = torch.randn(4096, 4096, device=dev, dtype=dtype)
            peaks[key] = 2 * 4096**3 / timed(lambda: torch.mm(a, b), settings.point_budget_s)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    src = torch.ones(512 * MiB, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    memory_bandwidth = 2 * src.numel() / timed(lambda: dst.copy_(src), settings.point_budget_s)
    src = dst = None  # free the HBM
    report("host-to-device", 0.5)
    h2d_bytes = tuple(4**k * KiB for k in range(1, 10))  # 4 KiB .. 256 MiB
    h2d_times = []
    for nbytes in h2d_bytes:
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        h2d_times.append(timed(lambda: device.copy_(host, non_blocking=True), settings.point_budget_s / 2))
    return {"name": torch.cuda.get_device_name(dev), "matmul": tuple(matmul), "peaks": peaks,
            "memory_bandwidth": memory_bandwidth, "memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
            "host_to_device": fit_alpha_beta(h2d_bytes, h2d_times),
            "h2d_samples": tuple(zip(map(float, h2d_bytes), h2d_times))}


def measure_disk(directory: Path, settings: Settings, report: Reporter) -> tuple[list[float], list[float]]:
    """Seconds to write (with fsync) and to read back (page cache dropped) a temp file of each size."""
    chunk = 4 * MiB
    block = np.random.default_rng(0).bytes(chunk)  # incompressible data
    buffer = bytearray(chunk)
    writes, reads = [], []
    for i, nbytes in enumerate(settings.disk_bytes):
        w, r = [], []
        for _ in range(3 if nbytes <= 16 * MiB else 2 if nbytes <= 64 * MiB else 1):
            fd, name = tempfile.mkstemp(prefix=".mmplan-disk-", dir=directory)
            try:
                t0 = time.perf_counter()
                left = nbytes
                while left > 0:
                    left -= os.write(fd, block[: min(chunk, left)])
                os.fsync(fd)
                w.append(time.perf_counter() - t0)
                if hasattr(os, "posix_fadvise"):  # drop the cached pages so that the read comes from the disk
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.lseek(fd, 0, os.SEEK_SET)
                t0 = time.perf_counter()
                while os.readv(fd, [buffer]) > 0:
                    pass
                r.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
                os.unlink(name)
        writes.append(min(w))  # best repetition, as for the other measurements
        reads.append(min(r))
        report("disk", (i + 1) / len(settings.disk_bytes))
    return writes, reads

