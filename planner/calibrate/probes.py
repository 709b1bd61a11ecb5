"""The kernel probes a calibration rank times (matmul, convolution, memory copy, Adam, messages) and their timers."""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

# The convolution probe: (batch, channels, height = width) of a 3 x 3, stride-1, same-padding convolution, the
# shape of `mmplan demo`'s encoder blocks. On a CPU, oneDNN runs such convolutions with the Winograd algorithm
# (fewer multiplications than the direct convolution counted in FLOPs): measured 171-188 GFLOP/s in model FLOPs
# on a 2-vCPU AMD EPYC guest whose best fp32 matmul reached 86-94 (one thread).
CONV_SHAPE = (4, 96, 24)


def conv_flops(shape: tuple[int, int, int] = CONV_SHAPE) -> int:
    """Model FLOPs of the convolution probe: 2 x batch x H x W x C_out x C_in x 3 x 3."""
    b, c, h = shape
    return 2 * b * h * h * c * c * 9


# Optimizer measurement: (parameter tensors, elements per tensor) of fp32 Adam steps; the fit of time against
# tensors and bytes separates the per-tensor cost (Python, kernel launches) from the per-byte one.
# Sizes of 16 MiB and more per step are past the caches, as a model's parameters are.
OPTIMIZER_POINTS = ((1, 1 << 22), (1, 1 << 23), (64, 1 << 12), (256, 1 << 10), (32, 1 << 17))


# Quick: one size past the caches (the per-byte cost), and many small tensors. (256, 1 << 10), OPTIMIZER_POINTS'
# too, is a model's many tensors whose Adam state (4 MiB) leaves a core's 2 MiB L2: with both ranks stepping at once
# it took 10-14 ms where 256 x (64, 1 << 10)'s per-tensor cost, in cache and not slowed by the other rank (1.4 ms
# alone and at once), made 5.6 ms (2-vCPU development VM).
OPTIMIZER_POINTS_QUICK = ((1, 1 << 22), (64, 1 << 10), (128, 1 << 8), (256, 1 << 10))


# Adam steps before timing one: the first few steps of a 4M-element tensor take 30-40 ms here, the steady state
# 12-13 ms (glibc's mmap threshold rises as the step's large temporaries are freed, after which they come from the
# heap without page faults); training runs in the steady state
OPTIMIZER_WARMUP = 6


def _typical(times: list[float]) -> float:
    """The lower quartile of repeated timings: less sensitive than the median to the scheduling spikes that
    other jobs cause on a shared machine (single gloo messages stretched 25x there), less optimistic than the
    minimum."""
    return sorted(times)[len(times) // 4]


def call_time(fn: Callable[[], Any], budget_s: float, min_reps: int = 3, max_reps: int = 2000, warmup: int = 1) -> float:
    """Typical seconds of one call, after `warmup` calls, over >= min_reps calls or budget_s seconds."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _typical(times)


def expected(times: list[float]) -> float:
    """The mean of repeated message timings without their slowest 5 %: a step pays every message, so what it pays
    is their mean, and on a CPU host gloo's is far above its typical one (2 ranks on 2 cores: a 2 KB all-reduce
    has a lower quartile of 0.45 ms and a mean of 1.6 ms, a third of them waiting ~3.4 ms for a scheduler slice);
    the slowest 5 % are the spikes other jobs cause."""
    kept = sorted(times)[:max(1, math.ceil(0.95 * len(times)))]
    return statistics.fmean(kept)


def busy_gap(rank: int) -> Callable[[], Any]:
    """The compute a training rank does between two messages (~1 ms of matmul), run before every timed message:
    gloo's threads then wake from idle onto cores that compute, as in a step ("gloo latency under load"), not
    from a tight loop of messages that keeps them hot."""
    a, b = torch.randn(160, 160, generator=torch.Generator().manual_seed(rank)), torch.randn(160, 160)
    return lambda: [torch.mm(a, b) for _ in range(8)]


def collective_iterations(nbytes: int, budget_s: float) -> int:
    """Repetitions of a collective: a pure function of the size, so that every rank runs the same number."""
    guess = 5e-4 + nbytes / 1e9  # gloo loopback: ~0.5 ms + ~1 GB/s (PLATFORM-NOTES.md)
    return max(3, min(40, int(budget_s / guess)))

