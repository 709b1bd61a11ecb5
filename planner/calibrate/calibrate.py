"""`mmplan calibrate`: measure this machine (matmul, memory, gloo collectives, disk) and describe it as a Cluster."""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
import torch.distributed as dist

from planner.profiler.host_probe import host_probe
from plans.cluster import Cluster, Device, Link
from plans.errors import MmplanError

Progress = Callable[[str, float], None]
KiB, MiB = 2**10, 2**20

# Steps in the order they run, with their share of the progress bar (roughly their share of the wall time).
_STEPS = {"start": 0.04, "matmul": 0.21, "memory": 0.1, "optimizer": 0.04, "host": 0.03, "zero": 0.02, "all-reduce": 0.18, "p2p": 0.14,
          "host-to-device": 0.04, "disk": 0.12, "runtime step": 0.08}

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
_OPTIMIZER_POINTS = ((1, 1 << 22), (1, 1 << 23), (64, 1 << 12), (256, 1 << 10), (32, 1 << 17))
_OPTIMIZER_POINTS_QUICK = ((1, 1 << 22), (64, 1 << 10), (128, 1 << 8))
# Adam steps before timing one: the first few steps of a 4M-element tensor take 30-40 ms here, the steady state
# 12-13 ms (glibc's mmap threshold rises as the step's large temporaries are freed, after which they come from the
# heap without page faults); training runs in the steady state
_OPTIMIZER_WARMUP = 6


@dataclass(frozen=True, slots=True)
class Settings:
    """What to measure: sizes and time budgets. quick=True keeps the whole run a few seconds (for tests)."""

    matmul_sizes: tuple[int, ...]  # n of an (n, n) @ (n, n) fp32 matmul, 2 n^3 FLOPs
    bf16_sizes: tuple[int, ...]  # n for the bf16 peak
    fp16_sizes: tuple[int, ...]  # n for the fp16 peak (small: CPUs without fp16 arithmetic do ~2 GFLOP/s)
    # Memory copy sizes: a tiny one for the latency, then sizes past the caches (L3 is 32 MiB on the reference
    # machine) for the bandwidth -- cache-resident sizes would inflate it. The largest gives memory bandwidth.
    copy_bytes: tuple[int, ...]
    message_bytes: tuple[int, ...]  # all-reduce and send/recv sizes
    disk_bytes: tuple[int, ...]  # temp-file sizes written with fsync and read back uncached
    point_budget_s: float  # time spent per measured point (at least 3 repetitions)
    rounds: int  # sweeps over all sizes; each point keeps its best round (other jobs come and go)
    timeout_s: float  # process-group timeout: no single wait lasts longer
    deadline_s: float  # hard wall-clock limit of the whole multi-process part
    probe_s: float = 1.0  # seconds of one turn of the compute_slowdown probe: half alone, half with every rank at once

    @staticmethod
    def for_run(quick: bool) -> Settings:
        if quick:
            return Settings(
                matmul_sizes=(64, 128, 256, 512), bf16_sizes=(256,), fp16_sizes=(128,),
                copy_bytes=(4 * KiB, 16 * MiB, 64 * MiB),
                message_bytes=tuple(4**k for k in range(1, 12)),  # 4 B .. 4 MiB
                disk_bytes=(1 * MiB, 8 * MiB, 32 * MiB),
                point_budget_s=0.04, rounds=1, timeout_s=30, deadline_s=60, probe_s=0.3)
        return Settings(
            matmul_sizes=(32, 64, 128, 256, 512, 1024, 2048), bf16_sizes=(256, 1024), fp16_sizes=(256,),
            copy_bytes=(4 * KiB, 16 * MiB, 64 * MiB, 256 * MiB),
            message_bytes=tuple(4**k for k in range(1, 14)),  # 4 B .. 64 MiB
            disk_bytes=(1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB),
            point_budget_s=0.12, rounds=3, timeout_s=60, deadline_s=240)


@dataclass(frozen=True, slots=True)
class Calibration:
    """Everything `calibrate` measured, raw samples included; `to_cluster` turns it into a Cluster."""

    device_name: str
    ranks: int  # gloo ranks that ran concurrently (one thread each)
    gpus_per_node: int  # ranks of the described node: `ranks` on CPU, the visible GPUs with CUDA
    backend: str  # backend of the Cluster the measurements describe ("gloo" on CPU, "nccl" with CUDA)
    matmul: tuple[tuple[int, float], ...]  # (n, FLOP/s per rank) of fp32 (CPU) or bf16 (CUDA) n x n matmuls
    peak_flops: dict[str, float]  # best measured FLOP/s per dtype
    memory_bandwidth: float  # bytes read + written per second per rank, largest copy, all ranks copying
    copy: Link  # alpha-beta fit of a memory copy (bytes copied per second)
    host_to_device: Link  # pinned host->device copies with CUDA; else the memory copy
    all_reduce: Link  # per-hop link implied by the gloo all-reduce under the ring model (see _link_from_ring)
    p2p: Link  # gloo send/recv between two ranks (half a ping-pong)
    disk_write: Link  # temp file written and fsync'd
    disk_read: Link  # the same file read back with the page cache dropped
    host_memory_bytes: int  # /proc/meminfo MemTotal
    device_memory_bytes: int  # per rank: CUDA device memory, else host memory / ranks
    disk_free_bytes: int  # free space where the temp file was written
    wall_s: float
    optimizer_tensor_s: float = 0.0  # Adam step per parameter tensor, all ranks stepping at once
    optimizer_byte_s: float = 0.0  # Adam step per byte of fp32 parameters, all ranks stepping at once
    step_overhead_s: float = 0.0  # the runtime's fixed per-step cost (a near-empty model's step, beyond its prediction)
    compute_slowdown: float = 1.0  # matmul and memory copy with every rank busy vs one process alone (mean ratio)
    zero_block_s: float = 0.0  # FSDP2 per sharded block and micro-batch (forward + backward) beyond its collectives
    zero_byte_s: float = 0.0  # FSDP2 per byte of a sharded block's parameters and micro-batch (copy-in / copy-out)
    zero_tensor_s: float = 0.0  # FSDP2's extra Adam time per sharded parameter tensor
    collective_s: float = 0.0  # fixed cost per gloo collective call beyond the ring model (fit_collective_call)
    forward_op_s: float = 0.0  # host time per aten op in a forward, all ranks at once (planner/profiler/host_probe.py)
    backward_op_s: float = 0.0  # host time per aten op in a backward
    saved_tensor_s: float = 0.0  # the runtime's saved-tensor hook per activation storage, in the forward
    released_tensor_s: float = 0.0  # its release of that storage, in the backward
    samples: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)  # name -> (bytes, seconds)


# ---------------------------------------------------------------------------------------------------------------
# Pure fitting helpers


def fit_alpha_beta(sizes: Any, times: Any) -> Link:
    """Least-squares fit of t = alpha + size / beta (Hockney's model) to measured (size, seconds) samples.

    Residuals are taken relative to each time, (alpha + size * b - t) / t, so that microsecond latencies and
    second-long transfers weigh alike. A negative intercept is clamped to 0 (refit through the origin); a
    non-positive slope (noise only) falls back to the best observed size / time.
    """
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if s.shape != t.shape or s.size < 2 or not np.all(t > 0) or not np.all(s >= 0):
        raise ValueError(f"need >= 2 (size >= 0, time > 0) samples, got sizes {sizes} and times {times}")
    a = np.stack([1 / t, s / t], axis=1)  # rows: [1/t_i, s_i/t_i] . [alpha, b] ~= 1
    (alpha, b), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if alpha < 0:
        alpha, b = 0.0, float(np.sum(s / t) / np.sum((s / t) ** 2))
    if not b > 0:
        return Link(bandwidth=float(np.max(s / t)), latency_s=float(max(np.min(t), 0.0)))
    return Link(bandwidth=float(1 / b), latency_s=float(alpha))


def _link_from_ring(fit: Link, ranks: int) -> Link:
    """The per-hop link under which a ring all-reduce of S bytes over p ranks takes the measured time.

    Ring all-reduce: t = 2 (p - 1) alpha + 2 (p - 1) / p * S / beta (Thakur, Rabenseifner & Gropp, "Optimization
    of Collective Communication Operations in MPICH", IJHPCA 2005; the formula cost_models/comm.py applies).
    The fit is t = A + S / B, so alpha = A / (2 (p - 1)) and beta = 2 (p - 1) / p * B.
    """
    hops = 2 * (ranks - 1)
    return Link(bandwidth=fit.bandwidth * hops / ranks, latency_s=fit.latency_s / hops)


def fit_optimizer(points: Any, times: Any) -> tuple[float, float]:
    """(seconds per tensor, seconds per byte) of t = a * tensors + b * bytes (fp32: 4 bytes per element) fitted to
    optimizer steps of `points` = (tensors, elements per tensor), least squares relative to each time; both >= 0
    (a negative one is dropped and the other refitted alone)."""
    k = np.array([p[0] for p in points], dtype=float)
    nbytes = np.array([p[0] * p[1] * 4 for p in points], dtype=float)
    t = np.asarray(times, dtype=float)
    if k.size < 2 or t.shape != k.shape or not np.all(t > 0):
        raise ValueError(f"need >= 2 optimizer samples with time > 0, got {times}")
    a = np.stack([k / t, nbytes / t], axis=1)
    (per_tensor, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if per_tensor < 0:
        per_tensor, per_byte = 0.0, float(np.sum(nbytes / t) / np.sum((nbytes / t) ** 2))
    elif per_byte < 0:
        per_tensor, per_byte = float(np.sum(k / t) / np.sum((k / t) ** 2)), 0.0
    return float(per_tensor), float(per_byte)


def efficiency_curve(matmul: tuple[tuple[int, float], ...], peak: float) -> tuple[tuple[float, float], ...]:
    """(FLOPs of one n x n matmul = 2 n^3, achieved / peak) points, sorted by FLOPs, each in (0, 1]."""
    return tuple((float(2 * n**3), _round(min(1.0, rate / peak))) for n, rate in sorted(matmul))


def _round(x: float, digits: int = 4) -> float:
    """Keep `digits` significant digits: measurements are not more precise, and the TOML stays readable."""
    return float(f"{x:.{digits}g}")


def _slower(a: Link, b: Link) -> Link:
    """A link no faster than either: the higher latency and the lower bandwidth."""
    return Link(min(a.bandwidth, b.bandwidth), max(a.latency_s, b.latency_s))


def _rounded(link: Link) -> Link:
    return Link(_round(link.bandwidth), _round(link.latency_s), _round(link.collective_s))


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def fit_collective_call(link: Link, ranks: int, samples: dict[str, Any]) -> float:
    """Link.collective_s: the fixed seconds per collective call that the ring model on `link` (its send latency
    and bandwidth) leaves out of the measured collectives, `samples` = {collective: ((bytes, seconds), ...)} for
    COLLECTIVES. Least squares relative to each time (as fit_alpha_beta) of t = c + ring(bytes): c = sum((t - r)
    / t^2) / sum(1 / t^2); never negative."""
    from cost_models.comm import all_gather_time, all_reduce_time, reduce_scatter_time

    ring = {"all_reduce": all_reduce_time, "all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time}
    bare = Link(link.bandwidth, link.latency_s)
    pairs = [(ring[key](nbytes, ranks, bare), t) for key in COLLECTIVES for nbytes, t in samples.get(key, ())]
    weights = sum(1 / t**2 for _, t in pairs)
    if not weights:
        return 0.0
    return max(0.0, sum((t - r) / t**2 for r, t in pairs) / weights)


def between_ranks(cal: "Calibration") -> Link:
    """The link between ranks: a send's latency (p2p), the lower of the p2p and the ring-implied all-reduce
    bandwidths (the all-reduce includes gloo's reduction on the CPU), and the fixed cost per collective call."""
    return _rounded(Link(min(cal.p2p.bandwidth, cal.all_reduce.bandwidth), cal.p2p.latency_s, cal.collective_s))


# ---------------------------------------------------------------------------------------------------------------
# Measurement


def calibrate(*, ranks: int = 2, quick: bool = False, progress: Progress | None = None,
              scratch_dir: str | os.PathLike | None = None,
              start_method: Literal["fork", "spawn"] = "fork") -> Cluster:
    """Measure this machine and describe it as a one-node Cluster of `ranks` ranks (see measure / to_cluster)."""
    return to_cluster(measure(ranks=ranks, quick=quick, progress=progress, scratch_dir=scratch_dir,
                              start_method=start_method))


def measure(*, ranks: int = 2, quick: bool = False, progress: Progress | None = None,
            scratch_dir: str | os.PathLike | None = None,
            start_method: Literal["fork", "spawn"] = "fork") -> Calibration:
    """Run the measurements: `ranks` gloo processes (one thread each) for matmul, memory copy, all-reduce and
    send/recv; then CUDA (bf16 matmul, HBM copy, pinned host<->device) when present; then the disk."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 2 <= ranks <= 64:
        raise MmplanError(f"calibrate needs 2 <= ranks <= 64 to measure gloo collectives, got {ranks!r}")
    settings = Settings.for_run(quick)
    report = _Reporter(progress)
    started = time.perf_counter()
    report("start", 0.0)
    scratch = Path(scratch_dir) if scratch_dir is not None else Path(tempfile.gettempdir())
    if not scratch.is_dir():
        raise MmplanError(f"scratch directory {scratch} for the disk measurement does not exist")

    ranks_out = _run_ranks(ranks, settings, report, start_method)
    samples: dict[str, tuple[tuple[float, float], ...]] = {}

    def rate(key: str, i: int, n: int) -> float:  # FLOP/s of one n x n matmul (2 n^3), mean over the ranks
        return statistics.fmean(2 * n**3 / r[key][i] for r in ranks_out)

    matmul = tuple((n, rate("matmul", i, n)) for i, n in enumerate(settings.matmul_sizes))
    conv = statistics.fmean(conv_flops() / r["conv"][0] for r in ranks_out)  # FLOP/s, mean over the ranks
    samples["conv"] = ((float(conv_flops()), conv_flops() / conv),)
    # the fp32 peak: the highest rate in model FLOPs that a dense kernel reached -- a 3 x 3 convolution's when
    # oneDNN runs it as Winograd (CONV_SHAPE), so that a measured profile of a convolutional model is never faster
    # than the peak; the matmul efficiency curve is relative to it (efficiency_curve), GEMM times are unchanged
    peaks = {"fp32": max(max(flops for _, flops in matmul), conv)}
    peaks["bf16"] = max(rate("bf16", i, n) for i, n in enumerate(settings.bf16_sizes))
    peaks["fp16"] = max(rate("fp16", i, n) for i, n in enumerate(settings.fp16_sizes))
    copy_times = [statistics.fmean(r["copy"][i] for r in ranks_out) for i in range(len(settings.copy_bytes))]
    samples["copy"] = tuple(zip(map(float, settings.copy_bytes), copy_times))
    copy = fit_alpha_beta(settings.copy_bytes, copy_times)
    memory_bandwidth = 2 * settings.copy_bytes[-1] / copy_times[-1]  # read + write (STREAM "Copy" convention)
    for key in COLLECTIVES:
        samples[key] = tuple((float(b), max(r[key][i] for r in ranks_out)) for i, b in enumerate(settings.message_bytes))
    all_reduce = _link_from_ring(fit_alpha_beta(*zip(*samples["all_reduce"])), ranks)
    p2p_times = ranks_out[0]["p2p"]
    samples["p2p"] = tuple(zip(map(float, settings.message_bytes), p2p_times))
    p2p = fit_alpha_beta(settings.message_bytes, p2p_times)
    link = Link(min(p2p.bandwidth, all_reduce.bandwidth), p2p.latency_s)
    collective_s = fit_collective_call(_rounded(link), ranks, samples)
    compute_slowdown = probe_slowdown(ranks_out[0]["probe"][0], [r["probe"][1] for r in ranks_out])
    points = _OPTIMIZER_POINTS_QUICK if quick else _OPTIMIZER_POINTS
    opt_times = [max(r["optimizer"][i] for r in ranks_out) for i in range(len(points))]
    samples["optimizer"] = tuple((float(k * n * 4), t) for (k, n), t in zip(points, opt_times))
    optimizer_tensor_s, optimizer_byte_s = fit_optimizer(points, opt_times)
    forward_op_s, backward_op_s, saved_tensor_s, released_tensor_s = (statistics.median(r["host"][i] for r in ranks_out)
                                                                      for i in range(4))
    zero_block_s, zero_byte_s, zero_tensor_s = zero_costs([r["zero"] for r in ranks_out],
                                                          zero_priced(_rounded(Link(link.bandwidth, link.latency_s, collective_s)), ranks))

    host_memory = _mem_total()
    device_name, backend, gpus = _cpu_name(), "gloo", ranks
    host_to_device, device_memory = copy, host_memory // ranks
    if torch.cuda.is_available():
        cuda = _measure_cuda(settings, report)
        device_name, backend, gpus, matmul = cuda["name"], "nccl", torch.cuda.device_count(), cuda["matmul"]
        peaks, memory_bandwidth, device_memory = cuda["peaks"], cuda["memory_bandwidth"], cuda["memory_bytes"]
        host_to_device = cuda["host_to_device"]
        samples["host_to_device"] = cuda["h2d_samples"]
    report("host-to-device", 1.0)

    write_times, read_times = _measure_disk(scratch, settings, report)
    samples["disk_write"] = tuple(zip(map(float, settings.disk_bytes), write_times))
    samples["disk_read"] = tuple(zip(map(float, settings.disk_bytes), read_times))
    calibration = Calibration(
        device_name=device_name, ranks=ranks, gpus_per_node=gpus, backend=backend, matmul=matmul, peak_flops=peaks,
        memory_bandwidth=memory_bandwidth, copy=copy, host_to_device=host_to_device, all_reduce=all_reduce,
        p2p=p2p, disk_write=fit_alpha_beta(settings.disk_bytes, write_times),
        disk_read=fit_alpha_beta(settings.disk_bytes, read_times), host_memory_bytes=host_memory,
        device_memory_bytes=device_memory, disk_free_bytes=shutil.disk_usage(scratch).free,
        wall_s=time.perf_counter() - started, samples=samples, optimizer_tensor_s=optimizer_tensor_s,
        optimizer_byte_s=optimizer_byte_s, compute_slowdown=compute_slowdown, collective_s=collective_s, zero_block_s=zero_block_s,
        zero_byte_s=zero_byte_s, zero_tensor_s=zero_tensor_s, forward_op_s=forward_op_s, backward_op_s=backward_op_s,
        saved_tensor_s=saved_tensor_s, released_tensor_s=released_tensor_s)
    report("runtime step", 0.0)
    # 14 steps in quick mode too (~0.1 s more than 6): the median of 4 steps read 0.8-14 ms in five quick calibrations
    # of one VM, and every prediction made with the cluster moves by it
    calibration = replace(calibration, step_overhead_s=measure_step_overhead(to_cluster(calibration), steps=14),
                          wall_s=time.perf_counter() - started)
    report("done", 1.0)
    return calibration


def to_cluster(cal: Calibration) -> Cluster:
    """A one-node Cluster from measurements: gpus_per_node = ranks (CUDA: the GPUs), achieved peaks, the
    matmul efficiency curve relative to the best matmul, and measured links (rounded to 4 digits).

    The link between ranks (between_ranks): a send's latency, the lower of the p2p and all-reduce bandwidths
    (the all-reduce includes gloo's reduction on the CPU, which the ring formula books as transfer time), and
    the fixed cost per collective call that the ring model leaves out of the measured all-reduces, all-gathers
    and reduce-scatters (fit_collective_call), so neither pipeline sends nor collectives are under-predicted.
    One machine has no inter-node link: it gets the same figure. NVMe: the slower of disk write and read.
    """
    peaks = {dtype: _round(flops) for dtype, flops in cal.peak_flops.items()}
    compute_dtype = "bf16" if cal.backend == "nccl" else "fp32"
    device = Device(name=cal.device_name, peak_flops=peaks, memory_bytes=cal.device_memory_bytes,
                    memory_bandwidth=_round(cal.memory_bandwidth),
                    efficiency=efficiency_curve(cal.matmul, peaks[compute_dtype]))
    link = between_ranks(cal)
    nvme = _rounded(_slower(cal.disk_write, cal.disk_read))
    return Cluster(name=f"calibrated-{'gpu' if cal.backend == 'nccl' else 'cpu'}", nodes=1,
                   gpus_per_node=cal.gpus_per_node,
                   device=device, intra_node=link, inter_node=link,
                   host_to_device=_rounded(cal.host_to_device), nvme=nvme,
                   host_memory_bytes=cal.host_memory_bytes, nvme_bytes=max(1, cal.disk_free_bytes),
                   backend=cal.backend, optimizer_tensor_s=_round(cal.optimizer_tensor_s),
                   optimizer_byte_s=_round(cal.optimizer_byte_s), step_overhead_s=_round(cal.step_overhead_s),
                   compute_slowdown=_round(cal.compute_slowdown, 3), zero_block_s=_round(cal.zero_block_s),
                   zero_byte_s=_round(cal.zero_byte_s), zero_tensor_s=_round(cal.zero_tensor_s),
                   forward_op_s=_round(cal.forward_op_s), backward_op_s=_round(cal.backward_op_s),
                   saved_tensor_s=_round(cal.saved_tensor_s), released_tensor_s=_round(cal.released_tensor_s))


NEAR_EMPTY_MODEL = "planner.calibrate.calibrate:near_empty_model"


class _NearEmpty(torch.nn.Module):
    """Two 4 x 4 Linear layers and a mean as the loss: a training step with almost no work."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def near_empty_model(micro_batch: int = 1):
    """The model whose training step is the runtime's own cost (factory: model, example batch)."""
    return _NearEmpty(), {"x": torch.randn(micro_batch, 4)}


def measure_step_overhead(cluster: Cluster, *, steps: int = 14) -> float:
    """The runtime's fixed cost per step (Python, metrics, logging): train NEAR_EMPTY_MODEL with `mmplan run`'s own
    path (dp over every rank of `cluster`, one sample per rank) and take its median step (the first two warm up)
    minus what the cost model predicts for that plan on `cluster` (its gradient all-reduce and optimizer step)."""
    from cost_models.evaluate import evaluate
    from planner.solver.baselines import homogeneous_plan
    from planner.profiler.profile import profile_model
    from planner.commands.run import run_plan
    from plans.plan import save_plan
    from runtime.source import resolve

    profile = profile_model(resolve(NEAR_EMPTY_MODEL), device="meta")
    plan = homogeneous_plan(profile, cluster, cluster.world_size, f"tp=1,pp=1,dp={cluster.world_size}")
    with tempfile.TemporaryDirectory(prefix="mmplan-calibrate-") as scratch:
        path = Path(scratch) / "plan.json"
        save_plan(plan, path)
        metrics = run_plan(path, steps=steps, model=NEAR_EMPTY_MODEL, timeout_s=120, op_timeout_s=60).metrics
    measured = statistics.median(m["step_time_s"] for m in (metrics[2:] or metrics))
    return max(0.0, measured - evaluate(plan, profile, cluster).predicted.step_time_s)


# compute_slowdown's probe: the forward and backward of a small MLP block (256 -> 1024 -> 256 on 128 tokens, GELU,
# LayerNorm: GEMMs and memory-bound elementwise work, as a training step mixes them), timed for Settings.probe_s
# seconds (median), by rank 0 alone and by every rank at once, in turns (_slowdown_probe). Medians, not the lower
# quartiles of the other points: the probe is to see the sharing of cores, caches and memory bandwidth.
_PROBE_WIDTH, _PROBE_TOKENS = 256, 128


def _probe_step() -> Callable[[], Any]:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(_PROBE_WIDTH), torch.nn.Linear(_PROBE_WIDTH, 4 * _PROBE_WIDTH),
                                torch.nn.GELU(), torch.nn.Linear(4 * _PROBE_WIDTH, _PROBE_WIDTH))
    x = torch.randn(_PROBE_TOKENS, _PROBE_WIDTH, requires_grad=True)
    return lambda: block(x).square().mean().backward()


def _median_time(step: Callable[[], Any], seconds: float) -> float:
    """Median seconds of one call of `step` over `seconds` of repetitions (at least 5)."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# turns of the probe (rank 0 alone, then every rank at once); the slowdown is the median of the turns' ratios. A
# shared VM's speed drifts by +-20 % over seconds whatever runs on it (2 vCPUs of a KVM guest: the same step alone
# took 469-715 ms in three turns a minute apart); each turn's ratio pairs two measurements a fraction of a second apart,
# and the median drops a turn that a drift or another job's spike hit (two turns, averaged, gave 1.02-1.63 in five
# quick calibrations of one machine)
_PROBE_TURNS = 5


def _slowdown_probe(rank: int, settings: Settings) -> tuple[list[float], list[float]]:
    """(rank 0's probe step alone, this rank's with every rank at once) per turn, median seconds of each: measured in
    turns by the same processes (threads as in training), so that a drift of the machine's speed between the two
    hits both alike; ranks not measuring wait in a barrier. Rank 0's first list is empty on the other ranks."""
    step = _probe_step()
    step()  # warm-up
    alone, together = [], []
    for _ in range(_PROBE_TURNS):
        dist.barrier()
        if rank == 0:
            alone.append(_median_time(step, settings.probe_s / 2))
        dist.barrier()
        together.append(_median_time(step, settings.probe_s / 2))
    return alone, together


def probe_slowdown(alone: list[float], together: list[list[float]]) -> float:
    """compute_slowdown from _slowdown_probe's turns: the median over turns of every rank's time at once (mean
    over the ranks) over rank 0's alone in the same turn; never below 1."""
    ratios = [statistics.fmean(ranks) / a for a, ranks in zip(alone, zip(*together)) if a > 0]
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


class _Reporter:
    """Maps (step, fraction of that step) to the overall fraction and forwards it to the caller's callback."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.last = 0.0

    def __call__(self, step: str, fraction: float) -> None:
        if self.progress is None:
            return
        if step == "done":
            overall = 1.0
        else:
            names = list(_STEPS)
            before = sum(_STEPS[s] for s in names[: names.index(step)])
            overall = before + _STEPS[step] * min(max(fraction, 0.0), 1.0)
        self.last = max(self.last, min(overall, 1.0))  # never moves backwards
        self.progress(step, self.last)


def _mem_total() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return "cpu"


def _typical(times: list[float]) -> float:
    """The lower quartile of repeated timings: less sensitive than the median to the scheduling spikes that
    other jobs cause on a shared machine (single gloo messages stretched 25x there), less optimistic than the
    minimum."""
    return sorted(times)[len(times) // 4]


def _call_time(fn: Callable[[], Any], budget_s: float, min_reps: int = 3, max_reps: int = 2000, warmup: int = 1) -> float:
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


def _expected(times: list[float]) -> float:
    """The mean of repeated message timings without their slowest 5 %: a step pays every message, so what it pays
    is their mean, and on a CPU host gloo's is far above its typical one (2 ranks on 2 cores: a 2 KB all-reduce
    has a lower quartile of 0.45 ms and a mean of 1.6 ms, a third of them waiting ~3.4 ms for a scheduler slice);
    the slowest 5 % are the spikes other jobs cause."""
    kept = sorted(times)[:max(1, math.ceil(0.95 * len(times)))]
    return statistics.fmean(kept)


def _busy_gap(rank: int) -> Callable[[], Any]:
    """The compute a training rank does between two messages (~1 ms of matmul), run before every timed message:
    gloo's threads then wake from idle onto cores that compute, as in a step ("gloo latency under load"), not
    from a tight loop of messages that keeps them hot."""
    a, b = torch.randn(160, 160, generator=torch.Generator().manual_seed(rank)), torch.randn(160, 160)
    return lambda: [torch.mm(a, b) for _ in range(8)]


def _collective_iterations(nbytes: int, budget_s: float) -> int:
    """Repetitions of a collective: a pure function of the size, so that every rank runs the same number."""
    guess = 5e-4 + nbytes / 1e9  # gloo loopback: ~0.5 ms + ~1 GB/s (PLATFORM-NOTES.md)
    return max(3, min(40, int(budget_s / guess)))


# ---------------------------------------------------------------------------------------------------------------
# The rank processes (gloo, one thread each)


def _run_ranks(ranks: int, settings: Settings, report: _Reporter, start_method: str) -> list[dict[str, Any]]:
    """The measuring ranks, launched by runtime/launch.py as training ranks are (file:// rendezvous, one thread
    each; the first failure, or the deadline, ends them all and names the root cause). Rank 0's progress comes
    back through a queue that a thread here forwards to `report`."""
    from runtime.launch import RankFailure, launch

    messages = mp.get_context(start_method).Queue()
    step = ["start"]

    def forward() -> None:
        try:
            while (item := messages.get()) is not None:
                _, _, step[0], fraction = item
                report(step[0], fraction)
        except (EOFError, OSError, ValueError):  # a rank killed mid-message: progress is best effort
            return

    forwarder = threading.Thread(target=forward, name="mmplan-calibrate-progress", daemon=True)
    forwarder.start()
    try:
        return launch(_rank_main, ranks, (settings, messages), backend="gloo", timeout_s=settings.deadline_s,
                      op_timeout_s=settings.timeout_s, start_method=start_method)
    except RankFailure as e:
        if e.rank is None:
            raise MmplanError(f"calibration timed out after {settings.deadline_s:g} s in step {step[0]}") from None
        cause = str(e).removeprefix(f"rank {e.rank} failed: ")
        raise MmplanError(f"calibration failed on rank {e.rank} in step {step[0]}: {cause}") from None
    finally:
        messages.put(None)  # after every rank's messages: the ranks flushed theirs before exiting
        forwarder.join(timeout=5)
        messages.close()
        messages.cancel_join_thread()  # a rank killed while writing may hold the queue's lock: never wait on it


def _rank_main(ctx: Any, payload: tuple[Settings, Any]) -> dict[str, list[float]]:
    """One rank (runtime.launch worker): measure, then flush the progress messages before the process exits."""
    settings, messages = payload
    try:
        return _rank_measure(ctx.rank, ctx.world_size, settings, messages)
    finally:
        messages.close()
        messages.join_thread()


def _rank_measure(rank: int, world: int, settings: Settings, messages: Any) -> dict[str, list[float]]:
    """Seconds per call for every point, the best of `settings.rounds` rounds (each a lower quartile)."""
    def progress(step: str, fraction: float) -> None:
        if rank == 0:
            messages.put(("progress", 0, step, fraction))

    budget = settings.point_budget_s
    rounds = range(settings.rounds)
    out: dict[str, list[float]] = {}

    def keep(key: str, i: int, seconds: float) -> None:
        values = out.setdefault(key, [])
        if i == len(values):
            values.append(seconds)
        else:
            values[i] = min(values[i], seconds)

    points = [("matmul", torch.float32, j, n) for j, n in enumerate(settings.matmul_sizes)]
    points += [("bf16", torch.bfloat16, j, n) for j, n in enumerate(settings.bf16_sizes)]
    points += [("fp16", torch.float16, j, n) for j, n in enumerate(settings.fp16_sizes)]
    out["probe"] = list(_slowdown_probe(rank, settings))  # [alone (rank 0), all ranks at once]
    progress("matmul", 0.0)
    for r in rounds:
        for i, (key, dtype, j, n) in enumerate(points):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            keep(key, j, _call_time(lambda: torch.mm(a, b), budget if key == "matmul" else budget / 2))
            progress("matmul", (r * len(points) + i + 1) / (len(points) * len(rounds)))
        x, w = torch.randn(CONV_SHAPE[:2] + (CONV_SHAPE[2],) * 2), torch.randn(CONV_SHAPE[1], CONV_SHAPE[1], 3, 3)
        keep("conv", 0, _call_time(lambda: torch.nn.functional.conv2d(x, w, padding=1), budget / 2))

    dist.barrier()
    src = torch.ones(max(settings.copy_bytes), dtype=torch.uint8)  # allocated and paged in once; sizes are
    dst = torch.empty_like(src)                                     # prefixes of it
    for r in rounds:
        for i, nbytes in enumerate(settings.copy_bytes):
            to, frm = dst[:nbytes], src[:nbytes]
            keep("copy", i, _call_time(lambda: to.copy_(frm), budget / 2))
            progress("memory", (r * len(settings.copy_bytes) + i + 1) / (len(settings.copy_bytes) * len(rounds)))
    src = dst = to = frm = None  # free them before the collectives

    dist.barrier()  # the optimizer step as `run` takes it: torch's Adam, every rank stepping at once
    points = _OPTIMIZER_POINTS if budget > 0.1 else _OPTIMIZER_POINTS_QUICK
    for r in rounds:
        for i, (k, n) in enumerate(points):
            params = [torch.nn.Parameter(torch.randn(n)) for _ in range(k)]
            for p in params:
                p.grad = torch.randn(n)
            adam = torch.optim.Adam(params, lr=1e-3)
            keep("optimizer", i, _call_time(adam.step, budget / 2, min_reps=8, warmup=_OPTIMIZER_WARMUP))
            progress("optimizer", (r * len(points) + i + 1) / (len(points) * len(rounds)))
    params = adam = None

    dist.barrier()  # the host's work per op and per saved tensor, every rank at once
    out["host"] = list(host_probe(budget * 8))
    progress("host", 1.0)

    dist.barrier()  # ZeRO's FSDP2 beyond its collectives, every rank at once
    out["zero"] = _zero_probe(rank, world, budget)
    progress("zero", 1.0)

    from runtime.sequence_parallel import _reduce_scatter  # the runtime's reduce-scatter, whatever torch names it

    _all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the latter deprecated)

    sizes = settings.message_bytes
    gap = _busy_gap(rank)
    for r in rounds:
        for i, nbytes in enumerate(sizes):
            n = max(world, nbytes // 4 // world * world)  # float32 elements, a multiple of the ranks
            x, part = torch.ones(n), torch.empty(n // world)
            calls = {"all_reduce": lambda: dist.all_reduce(x),  # each on a tensor of `nbytes`: the reduced
                     "all_gather": lambda: _all_gather(x, part),  # input, the gathered
                     "reduce_scatter": lambda: _reduce_scatter(part, x)}  # result (cost_models/comm.py)
            for key, call in calls.items():
                dist.barrier()
                call()  # warm-up
                times = []
                for _ in range(_collective_iterations(nbytes, budget)):
                    gap()
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                keep(key, i, _expected(times))
            progress("all-reduce", (r * len(sizes) + i + 1) / (len(sizes) * len(rounds)))

    for r in rounds:
        for i, nbytes in enumerate(sizes):
            x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            dist.barrier()
            if rank < 2:  # ping-pong between ranks 0 and 1; one-way time = half a round trip
                peer = 1 - rank
                times = []
                for it in range(_collective_iterations(nbytes, budget) + 1):
                    t0 = time.perf_counter()  # no busy gap: a pipeline's receiver waits in recv
                    if rank == 0:
                        dist.send(x, peer)
                        dist.recv(x, peer)
                    else:
                        dist.recv(x, peer)
                        dist.send(x, peer)
                    if it:  # the first round trip is the warm-up
                        times.append((time.perf_counter() - t0) / 2)
                keep("p2p", i, _expected(times))
            progress("p2p", (r * len(sizes) + i + 1) / (len(sizes) * len(rounds)))
    dist.barrier()
    return out


# ZeRO's probe: ZERO_BLOCKS blocks (Linear w -> w + LayerNorm: 4 parameter tensors each) on 16 rows, trained plain
# and sharded over all the ranks by the runtime's own FSDP2 path (runtime/zero.apply_zero, ZeRO-2: each step
# all-gathers every block's parameters in the forward and reduce-scatters its gradients in the backward, as a
# ZeRO-1/2 step of one micro-batch does). What the sharded step costs beyond the plain one and beyond the two
# collectives as the cost model prices them (one ring all-gather and one ring reduce-scatter of all the bytes on the
# measured link, cost_models/comm.zero_collectives) is FSDP2's own: per block (hooks, DTensor views, and one gloo
# all-gather and reduce-scatter per block, each paying the latency) and per parameter byte (copying into and out of
# the flat buffers, and gloo's all-gather / reduce-scatter moving bytes slower than its all-reduce: measured here
# ~3x the ring model's time). Two widths separate the two.
ZERO_BLOCKS, ZERO_TENSORS_PER_BLOCK, ZERO_WIDTHS = 8, 4, (64, 1024)


def zero_block_bytes(width: int) -> int:
    """fp32 parameter bytes of one probe block (Linear weight + bias, LayerNorm weight + bias)."""
    return 4 * (width * width + 3 * width)


def _lockstep_time(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of `fn` (collectives inside) over `reps` calls after one warm-up, every call started together
    on all ranks (a barrier before each): every rank must run the same `reps`."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _zero_probe(rank: int, world: int, budget: float) -> list[float]:
    """Seconds on this rank for the probe model: [fwd+bwd plain, fwd+bwd sharded] at each width, then [Adam plain,
    Adam sharded] at the narrow width."""
    from runtime.zero import apply_zero

    out: list[float] = []
    adams = []
    for width in ZERO_WIDTHS:
        torch.manual_seed(0)
        plain = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width)) for _ in range(ZERO_BLOCKS)]
        sharded = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width)) for _ in range(ZERO_BLOCKS)]
        apply_zero({str(i): m for i, m in enumerate(sharded)}, dist.group.WORLD, 2, torch.device("cpu"))
        x = torch.randn(16, width)
        reps = min(10, _collective_iterations(ZERO_BLOCKS * zero_block_bytes(width), budget))  # the same on every rank
        for blocks in (plain, sharded):
            def step(blocks=blocks) -> None:
                y = x
                for m in blocks:
                    y = m(y)
                y.sum().backward()
            out.append(_lockstep_time(step, reps))
        if width == ZERO_WIDTHS[0]:
            adams = [torch.optim.Adam([p for m in blocks for p in m.parameters()], lr=1e-6) for blocks in (plain, sharded)]
    return out + [_call_time(adam.step, budget / 2) for adam in adams]


def zero_costs(per_rank: list[list[float]], priced: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, float]:
    """(zero_block_s, zero_byte_s, zero_tensor_s) from the ranks' _zero_probe results (medians over the ranks) and
    what the cost model prices the probe's collectives at, per width (`priced`): the per-block residual at the two
    widths as a + b x bytes per block; never < 0."""
    narrow_plain, narrow_sharded, wide_plain, wide_sharded, adam_plain, adam_sharded = (
        statistics.median(r[i] for r in per_rank) for i in range(6))
    narrow, wide = (max(0.0, (s - p - c) / ZERO_BLOCKS)
                    for p, s, c in ((narrow_plain, narrow_sharded, priced[0]), (wide_plain, wide_sharded, priced[1])))
    small, large = (zero_block_bytes(w) for w in ZERO_WIDTHS)
    per_byte = max(0.0, (wide - narrow) / (large - small))
    return (max(0.0, narrow - small * per_byte), per_byte,
            max(0.0, (adam_sharded - adam_plain) / (ZERO_BLOCKS * ZERO_TENSORS_PER_BLOCK)))


def zero_priced(link: Link, ranks: int) -> tuple[float, float]:
    """The cost model's time for the probe's collectives at each width: one all-gather and one reduce-scatter of
    all its parameter bytes over `ranks` (cost_models/comm.py)."""
    from cost_models.comm import all_gather_time, reduce_scatter_time

    return tuple(all_gather_time(b, ranks, link) + reduce_scatter_time(b, ranks, link)
                 for b in (ZERO_BLOCKS * zero_block_bytes(w) for w in ZERO_WIDTHS))


# ---------------------------------------------------------------------------------------------------------------
# CUDA and disk (in the calling process)


def _measure_cuda(settings: Settings, report: _Reporter) -> dict[str, Any]:
    """bf16 matmul sweep, fp32 (TF32 off) and fp16 peaks, HBM copy bandwidth, pinned host->device copies."""
    dev = torch.device("cuda", 0)

    def timed(fn: Callable[[], Any], budget: float) -> float:
        def synced() -> None:
            fn()
            torch.cuda.synchronize(dev)
        return _call_time(synced, budget)

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


def _measure_disk(directory: Path, settings: Settings, report: _Reporter) -> tuple[list[float], list[float]]:
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


__all__ = ["Calibration", "Settings", "calibrate", "efficiency_curve", "fit_alpha_beta", "measure", "to_cluster"]
