"""Pure fits of calibration samples (alpha-beta links, optimizer costs, GEMM efficiency) and the Cluster they describe."""
from __future__ import annotations

from typing import Any

import numpy as np

from planner.calibrate.settings import Calibration
from plans.cluster import Cluster, Device, Link


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


def link_from_ring(fit: Link, ranks: int) -> Link:
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


def rounded(link: Link) -> Link:
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
    return rounded(Link(min(cal.p2p.bandwidth, cal.all_reduce.bandwidth), cal.p2p.latency_s, cal.collective_s))


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
    nvme = rounded(_slower(cal.disk_write, cal.disk_read))
    return Cluster(name=f"calibrated-{'gpu' if cal.backend == 'nccl' else 'cpu'}", nodes=1,
                   gpus_per_node=cal.gpus_per_node,
                   device=device, intra_node=link, inter_node=link,
                   host_to_device=rounded(cal.host_to_device), nvme=nvme,
                   host_memory_bytes=cal.host_memory_bytes, nvme_bytes=max(1, cal.disk_free_bytes),
                   backend=cal.backend, optimizer_tensor_s=_round(cal.optimizer_tensor_s),
                   optimizer_byte_s=_round(cal.optimizer_byte_s), step_overhead_s=_round(cal.step_overhead_s),
                   compute_slowdown=_round(cal.compute_slowdown, 3), zero_block_s=_round(cal.zero_block_s),
                   zero_byte_s=_round(cal.zero_byte_s), zero_tensor_s=_round(cal.zero_tensor_s),
                   forward_op_s=_round(cal.forward_op_s), backward_op_s=_round(cal.backward_op_s),
                   saved_tensor_s=_round(cal.saved_tensor_s), released_tensor_s=_round(cal.released_tensor_s))

