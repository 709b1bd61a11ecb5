"""What `mmplan calibrate` measures (Settings), what it measured (Calibration), and its progress bar's steps."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from plans.cluster import Link

Progress = Callable[[str, float], None]
KiB, MiB = 2**10, 2**20


# Steps in the order they run, with their share of the progress bar (roughly their share of the wall time).
_STEPS = {"start": 0.04, "matmul": 0.21, "memory": 0.1, "optimizer": 0.04, "host": 0.03, "zero": 0.02, "all-reduce": 0.18, "p2p": 0.14,
          "host-to-device": 0.04, "disk": 0.12, "runtime step": 0.08}


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
                point_budget_s=0.04, rounds=1, timeout_s=30 * load_factor(), deadline_s=60 * load_factor(), probe_s=0.3)
        return Settings(
            matmul_sizes=(32, 64, 128, 256, 512, 1024, 2048), bf16_sizes=(256, 1024), fp16_sizes=(256,),
            copy_bytes=(4 * KiB, 16 * MiB, 64 * MiB, 256 * MiB),
            message_bytes=tuple(4**k for k in range(1, 14)),  # 4 B .. 64 MiB
            disk_bytes=(1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB),
            point_budget_s=0.12, rounds=3, timeout_s=60 * load_factor(), deadline_s=240 * load_factor())


def load_factor() -> float:
    """How many times slower than on an idle machine the measuring ranks may run: the runnable processes per core
    (1-minute load average / cores), at least 1. The calibration's wall-clock bounds (a quick one takes ~12 s at load
    3.5 on 2 cores, measured) are multiplied by it, so that a loaded machine (mmplan demo beside a CPU-heavy
    process) slows the calibration instead of failing it."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


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
    all_reduce: Link  # per-hop link implied by the gloo all-reduce under the ring model (see link_from_ring)
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


class Reporter:
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

