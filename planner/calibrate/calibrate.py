"""`mmplan calibrate`: measure this machine (matmul, memory, gloo collectives, disk) and describe it as a Cluster."""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

from planner.calibrate.fit import (COLLECTIVES, fit_alpha_beta, fit_collective_call, fit_optimizer, link_from_ring,
                                   rounded, to_cluster)
from planner.calibrate.local import cpu_name, measure_cuda, measure_disk, mem_total
from planner.calibrate.probes import OPTIMIZER_POINTS, OPTIMIZER_POINTS_QUICK, conv_flops
from planner.calibrate.ranks import run_ranks
from planner.calibrate.runtime_probes import measure_step_overhead, probe_slowdown, zero_costs, zero_priced
from planner.calibrate.settings import Calibration, Progress, Reporter, Settings
from plans.cluster import Cluster, Link
from plans.errors import MmplanError


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
    report = Reporter(progress)
    started = time.perf_counter()
    report("start", 0.0)
    scratch = Path(scratch_dir) if scratch_dir is not None else Path(tempfile.gettempdir())
    if not scratch.is_dir():
        raise MmplanError(f"scratch directory {scratch} for the disk measurement does not exist")

    ranks_out = run_ranks(ranks, settings, report, start_method)
    samples: dict[str, tuple[tuple[float, float], ...]] = {}
    figures = _rank_figures(ranks_out, settings, ranks, quick, samples)
    figures.update(_device_figures(settings, report, ranks, figures, samples))
    report("host-to-device", 1.0)

    write_times, read_times = measure_disk(scratch, settings, report)
    samples["disk_write"] = tuple(zip(map(float, settings.disk_bytes), write_times))
    samples["disk_read"] = tuple(zip(map(float, settings.disk_bytes), read_times))
    calibration = Calibration(
        ranks=ranks, disk_write=fit_alpha_beta(settings.disk_bytes, write_times),
        disk_read=fit_alpha_beta(settings.disk_bytes, read_times), disk_free_bytes=shutil.disk_usage(scratch).free,
        wall_s=time.perf_counter() - started, samples=samples, **figures)
    report("runtime step", 0.0)
    # 14 steps in quick mode too (~0.1 s more than 6): the median of 4 steps read 0.8-14 ms in five quick calibrations
    # of one VM, and every prediction made with the cluster moves by it
    calibration = replace(calibration, step_overhead_s=measure_step_overhead(to_cluster(calibration), steps=14),
                          wall_s=time.perf_counter() - started)
    report("done", 1.0)
    return calibration


def _rank_figures(ranks_out: list[dict[str, Any]], settings: Settings, ranks: int, quick: bool,
                  samples: dict[str, tuple[tuple[float, float], ...]]) -> dict[str, Any]:
    """Calibration fields from the ranks' measurements (matmul, peaks, memory, links, optimizer, host, ZeRO); adds
    their samples to `samples`."""
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
    all_reduce = link_from_ring(fit_alpha_beta(*zip(*samples["all_reduce"])), ranks)
    p2p_times = ranks_out[0]["p2p"]
    samples["p2p"] = tuple(zip(map(float, settings.message_bytes), p2p_times))
    p2p = fit_alpha_beta(settings.message_bytes, p2p_times)
    link = Link(min(p2p.bandwidth, all_reduce.bandwidth), p2p.latency_s)
    collective_s = fit_collective_call(rounded(link), ranks, samples)
    compute_slowdown = probe_slowdown(ranks_out[0]["probe"][0], [r["probe"][1] for r in ranks_out])
    points = OPTIMIZER_POINTS_QUICK if quick else OPTIMIZER_POINTS
    opt_times = [max(r["optimizer"][i] for r in ranks_out) for i in range(len(points))]
    samples["optimizer"] = tuple((float(k * n * 4), t) for (k, n), t in zip(points, opt_times))
    optimizer_tensor_s, optimizer_byte_s = fit_optimizer(points, opt_times)
    forward_op_s, backward_op_s, saved_tensor_s, released_tensor_s = (statistics.median(r["host"][i] for r in ranks_out)
                                                                      for i in range(4))
    zero_block_s, zero_byte_s, zero_tensor_s = zero_costs([r["zero"] for r in ranks_out],
                                                          zero_priced(rounded(Link(link.bandwidth, link.latency_s, collective_s)), ranks))
    return dict(matmul=matmul, peak_flops=peaks, memory_bandwidth=memory_bandwidth, copy=copy, all_reduce=all_reduce,
                p2p=p2p, optimizer_tensor_s=optimizer_tensor_s, optimizer_byte_s=optimizer_byte_s,
                compute_slowdown=compute_slowdown, collective_s=collective_s, zero_block_s=zero_block_s,
                zero_byte_s=zero_byte_s, zero_tensor_s=zero_tensor_s, forward_op_s=forward_op_s,
                backward_op_s=backward_op_s, saved_tensor_s=saved_tensor_s, released_tensor_s=released_tensor_s)


def _device_figures(settings: Settings, report: Reporter, ranks: int, figures: dict[str, Any],
                    samples: dict[str, tuple[tuple[float, float], ...]]) -> dict[str, Any]:
    """The device the Calibration describes: the CPU's ranks (each a share of the host memory, host-to-device = the
    memory copy), or the CUDA GPUs when present (measured here; their matmul, peaks and memory replace the CPU's)."""
    host_memory = mem_total()
    out = dict(device_name=cpu_name(), backend="gloo", gpus_per_node=ranks, host_to_device=figures["copy"],
               host_memory_bytes=host_memory, device_memory_bytes=host_memory // ranks)
    if torch.cuda.is_available():
        cuda = measure_cuda(settings, report)
        out.update(device_name=cuda["name"], backend="nccl", gpus_per_node=torch.cuda.device_count(),
                   matmul=cuda["matmul"], peak_flops=cuda["peaks"], memory_bandwidth=cuda["memory_bandwidth"],
                   device_memory_bytes=cuda["memory_bytes"], host_to_device=cuda["host_to_device"])
        samples["host_to_device"] = cuda["h2d_samples"]
    return out


__all__ = ["calibrate", "measure"]
