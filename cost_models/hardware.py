"""Hardware specs: the device catalog, cluster specs from a shorthand or a TOML file (and back), device efficiency."""
from __future__ import annotations

import bisect
import functools
import math
import re
import tomllib
from dataclasses import replace
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

from plans.cluster import DTYPES, Cluster, Device, Link
from plans.errors import FormatError, MmplanError
from plans.serial import read_text, validate

# Units. Datasheets use SI: "GB/s" = 1e9 bytes/s, "TFLOPS" = 1e12 FLOP/s. The TOML format uses the same
# (memory_gb = 1e9 bytes, bandwidth_gbps = 1e9 bytes/s, latency_us = 1e-6 s, peak_tflops = 1e12 FLOP/s).
GB = 10**9
TB = 10**12
MiB = 2**20
GiB = 2**30
GBps = 1e9
TFLOPS = 1e12
US = 1e-6


def _launch_bound_curve(peak: float, best: float, launch_s: float) -> tuple[tuple[float, float], ...]:
    """(flops, efficiency) points at 1e6..1e13 FLOPs for a kernel that costs launch_s + flops / (best * peak).

    Roofline with a fixed per-launch cost (Williams et al., "Roofline", CACM 2009, plus launch overhead):
    efficiency(f) = best * f / (f + best * peak * launch_s). Rounded to 3 digits so files stay readable.
    """
    knee = best * peak * launch_s
    return tuple((10.0**k, float(f"{best * 10.0**k / (10.0**k + knee):.3g}")) for k in range(6, 14))


# A CUDA kernel launch plus cuBLAS heuristics costs a few microseconds (estimate; "CUDA C++ Best Practices
# Guide", section on kernel launch overhead). Large GEMMs of transformer shapes, fraction of the dense tensor peak:
# - A100: 0.75. NVIDIA's CUTLASS profiler documentation (media/docs/profiler.md, "Example Tensor Core GEMM
#   Operations", CUTLASS 2.2, 2020) measures an fp16 GEMM m=3456 n=4096 k=8192 on A100 at 235.1 TFLOP/s = 0.754 x
#   312. The best shape of a search with today's cuBLAS reaches 267.9 TFLOP/s =
#   0.86 (S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS" table): a searched maximum, not a
#   transformer's shapes.
# - Hopper: 0.75 (estimate; the same MAMF table: H100 SXM best shape 792.1 TFLOP/s = 0.80 of 989; NVIDIA's blog
#   "New cuBLAS 12.0 Features and Matrix Multiplication Performance on NVIDIA Hopper GPUs" for curves).
# Both are replaced by measurements with `mmplan calibrate` on the target.
_GPU_LAUNCH_S = 5e-6
_GPU_BEST_FRACTION = {"a100": 0.75, "hopper": 0.75}

# Memory-bound kernels (norms, softmax, elementwise, copies) stream at a fraction of the datasheet HBM bandwidth:
# BabelStream's Triad (Deakin et al. 2018, "Evaluating attainable memory bandwidth of parallel programming models
# via BabelStream"; published runs: A100-SXM4-40GB ~1.4 TB/s of 1.555, H100 SXM ~3.0 TB/s of 3.35) reaches ~90 %.
_GPU_STREAM_FRACTION = 0.90
# Fused attention (flash attention) as its own kernel, fraction of the dense bf16 peak over forward + backward:
# FlashAttention-2 reaches 50-73 % of peak on A100 (Dao 2023, abstract and Figure 4: ~60 % fwd+bwd at head dim
# 128); on H100 FlashAttention-2 reaches ~35 % and FlashAttention-3 / cuDNN 60-75 % (Shah et al. 2024, Figures
# 1-3); we take the middle, 0.5, for Hopper. Used only for the FLOPs the profile attributes to fused attention.
_GPU_ATTENTION_FRACTION = {"a100": 0.60, "hopper": 0.50}

# Per-hop latencies of NCCL's own cost model, Ring / Simple protocol, in microseconds
# (NVIDIA/nccl src/graph/tuning.cc, hwLat[NVLINK] = 3.4, hwLat[NET] = 9.6).
_NVLINK_LATENCY_S = 3.4e-6
_IB_LATENCY_S = 9.6e-6
# A small cudaMemcpy host<->device costs ~10 us of setup (estimate, typical of CUDA bandwidthTest/nvbandwidth
# at small sizes). NVMe read latency ~100 us (estimate, typical 4 KiB random read of a datacenter U.2 drive).
_PCIE_LATENCY_S = 10e-6
_NVME_LATENCY_S = 100e-6
# Per-drive sequential write of a 3.84 TB PCIe Gen4 U.2 data-centre drive (Samsung PM1733 / KIOXIA CM6 product
# briefs: ~3.5-4 GB/s write, ~6.5-7 GB/s read); a RAID-0 of n drives at ~80 % scaling is write-bound at ~3 GB/s x n.
_NVME_WRITE_PER_DRIVE = 3.0 * GBps


def _a100(name: str, memory_bytes: int, hbm_gbps: float) -> Device:
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): FP32 19.5 TFLOPS; BF16/FP16 Tensor Core 312 TFLOPS dense
    # (624 with sparsity).
    peak = {"fp32": 19.5 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS}
    return Device(name, peak, memory_bytes, hbm_gbps * GBps,
                  _launch_bound_curve(peak["bf16"], _GPU_BEST_FRACTION["a100"], _GPU_LAUNCH_S))


def _hopper(name: str, memory_bytes: int, hbm_gbps: float) -> Device:
    # NVIDIA H100 and H200 Tensor Core GPU datasheets (SXM): FP32 67 TFLOPS; BF16/FP16 Tensor Core 1,979 TFLOPS
    # with sparsity = 989.4 dense (528 tensor cores x 1,024 FLOP/clk x 1.83 GHz boost). Same GH100 chip in both.
    peak = {"fp32": 67 * TFLOPS, "bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS}
    return Device(name, peak, memory_bytes, hbm_gbps * GBps,
                  _launch_bound_curve(peak["bf16"], _GPU_BEST_FRACTION["hopper"], _GPU_LAUNCH_S))


# NCCL moves data over NVLink at ~80 % of the line rate: "450GB/s is the line rate. With the protocol overhead
# (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as "BusBw" when running
# non-allreduce operations, or when running with NCCL_ALGO=RING" (S. Jeaugey, NCCL maintainer, NVIDIA/nccl-tests
# issue #212, 2024, for H100). The same protocol runs on A100's NVLink 3: nccl-tests all_reduce on 8x
# A100-SXM4-80GB measures ~200 GB/s bus bandwidth of the 300 GB/s line rate (NVIDIA/nccl-tests issue #149).
# The catalog's NVLink is that effective bandwidth, the bandwidth a ring collective or a p2p send achieves.
# (InfiniBand: NCCL reaches 92-96 % of the NICs' line rate -- nccl-tests issue #119: 96 GB/s of 4 x 200 Gb/s HDR;
# issue #290, NCCL developer: "For NDR @ 400Gbps you should see 46-48GB/s per NIC"; left at line rate.)
_NCCL_NVLINK_FRACTION = 0.80


def _dgx(name: str, device: Device, *, nvlink_gbps: float, ib_gbps: float, pcie_gbps: float,
         host_memory_bytes: int, nvme_drives: int) -> Cluster:
    """One DGX-style node of 8 GPUs: the template that shorthands like `64xh100-sxm` scale out. `nvlink_gbps` is
    the datasheet's per-direction line rate; the link gets NCCL's effective share of it (_NCCL_NVLINK_FRACTION)."""
    return Cluster(
        name=name,
        nodes=1,
        gpus_per_node=8,
        device=device,
        intra_node=Link(nvlink_gbps * _NCCL_NVLINK_FRACTION * GBps, _NVLINK_LATENCY_S),
        inter_node=Link(ib_gbps * GBps, _IB_LATENCY_S),
        host_to_device=Link(pcie_gbps * GBps, _PCIE_LATENCY_S),
        nvme=Link(nvme_drives * _NVME_WRITE_PER_DRIVE, _NVME_LATENCY_S),
        host_memory_bytes=host_memory_bytes,
        nvme_bytes=nvme_drives * 3840 * GB,  # DGX user guides: internal storage is n x 3.84 TB NVMe U.2
        backend="nccl",
    )


# local-cpu: the machine mmplan's tests and demos run on -- a 2-core AMD EPYC (Zen 4, "Genoa") KVM guest with
# ~23.5 GiB of RAM, torch CPU with gloo, one rank per core, one thread per rank (PLATFORM-NOTES.md).
_LOCAL_CORES = 2
_LOCAL_RAM = 24_684_096 * 1024  # /proc/meminfo MemTotal on the reference machine (kB)
_LOCAL_CPU = Cluster(
    name="local-cpu",
    nodes=1,
    gpus_per_node=_LOCAL_CORES,
    device=Device(
        name="local-cpu",
        peak_flops={
            # Zen 4 core: two 256-bit FMA pipes (AVX-512 runs double-pumped) = 32 fp32 FLOP/cycle, x 3.7 GHz
            # max boost (AMD EPYC 9004 series product brief; AMD "Software Optimization Guide for the Zen 4
            # Microarchitecture", section 2.11).
            "fp32": 32 * 3.7e9,
            # AVX512_BF16 VDPBF16PS does 2 bf16 products per fp32 lane: 2x the fp32 rate (same guide).
            "bf16": 64 * 3.7e9,
            # Zen 4 has no fp16 arithmetic (no AVX512-FP16); torch's CPU fp16 matmul measured ~3 GFLOP/s at
            # n = 256 on the reference machine (2026, torch 2.13, 1 thread).
            "fp16": 3e9,
        },
        memory_bytes=_LOCAL_RAM // _LOCAL_CORES,  # a rank's share of RAM (the "GPU" tier is host RAM here)
        # 256 MiB copies, both ranks copying at once: 23 GB/s per rank counting bytes read + written
        # (`mmplan calibrate` on the reference machine); rounded down.
        memory_bandwidth=20 * GBps,
        # fp32 n x n matmuls (2 n^3 FLOPs) for n = 32 .. 2048, 1 thread per rank, both ranks busy, relative to the
        # 118.4 GFLOP/s peak above (`mmplan calibrate` on the reference machine: best 103 GFLOP/s at n = 256).
        efficiency=((6.55e4, 0.24), (5.24e5, 0.61), (4.19e6, 0.81), (3.36e7, 0.87), (2.68e8, 0.87),
                    (2.15e9, 0.82), (1.72e10, 0.79)),
    ),
    # gloo over loopback between processes on one machine: ~1 GB/s, ~0.5 ms per message. PLATFORM-NOTES.md:
    # 1-element all-reduce ~0.9 ms (2 hops), 16 MB send 5-12 ms. `mmplan calibrate` on a quiet moment: 41 us /
    # 4.5 GB/s send-recv, 125 us / 1.7 GB/s per hop for all-reduce; other jobs on the 2 shared cores stretch
    # single messages to ~2 ms, hence the conservative figure. One machine: the inter-node link is the same.
    intra_node=Link(1.0 * GBps, 0.5e-3),
    inter_node=Link(1.0 * GBps, 0.5e-3),
    # No device: "host to device" is a copy inside RAM, bytes copied per second (`mmplan calibrate`: 10.5 GB/s,
    # 0.4 us per copy, both ranks copying).
    host_to_device=Link(10 * GBps, 1e-6),
    # The VM's virtual disk, temp file written with fsync and read back uncached (`mmplan calibrate`: 1.4 GB/s
    # write, 2.3 GB/s read, 0.1-0.5 ms latency); rounded down for a shared disk.
    nvme=Link(1.0 * GBps, 0.5e-3),
    host_memory_bytes=_LOCAL_RAM,
    nvme_bytes=50 * GB,  # ~80 GB free on the reference machine; planned against a conservative share
    backend="gloo",
    # The runtime's own costs (cost_models/overhead.py), which on a CPU are milliseconds where a model's compute is
    # too: without them a plan for this entry was predicted ~4x fast (README guide: 30 ms predicted, 116 ms
    # measured) and ZeRO looked free (the guide's dp2 + ZeRO-1 plan ran 2.3x slower than plain dp2). Two full
    # `mmplan calibrate` runs on a 2-vCPU Sapphire Rapids KVM guest (2026-12, torch 2.13; the mean, rounded):
    # Adam 24.5-25.5 us per tensor + 0.98-1.03 ns per byte; 1.5-2.2 ms fixed per step; FSDP2 3.4-4.0 ms per
    # sharded block and micro-batch, 2.2-2.3 ns per byte, 200-207 us per sharded tensor in the step. Every rank
    # busy slowed compute 1.01x: not applied. `mmplan calibrate` measures the machine at hand.
    optimizer_tensor_s=25e-6,
    optimizer_byte_s=1.0e-9,
    step_overhead_s=2e-3,
    zero_block_s=3.7e-3,
    zero_byte_s=2.3e-9,
    zero_tensor_s=200e-6,
    # The host's work of running a model op by op (Block.fwd_ops / bwd_ops / saved_tensors): a tiny-vlm-heavy layer
    # dispatches ~40 ops forward and ~100 backward and saves ~15 activation storages whatever its batch, so at
    # micro-batch 1 its step on a CPU is mostly this (5.4 ms forward where its FLOPs take 0.7 ms). calibrate's host
    # probe (planner/profiler/host_probe.py) in two full calibrations on a 2-vCPU AMD EPYC KVM guest (2026-12, torch 2.13,
    # both ranks at once): 7.2 / 6.1 us per forward op, 4.7 / 3.7 us per backward op, 10.5 / 9.8 us per storage
    # through the runtime's saved-tensor hook and its accounting, 3.3 / 3.1 us to release it in the backward.
    forward_op_s=6.5e-6,
    backward_op_s=4.2e-6,
    saved_tensor_s=10e-6,
    released_tensor_s=3.2e-6,
)

CATALOG: dict[str, Cluster] = {
    # DGX A100 user guide (320 GB system): 8x A100-SXM4-40GB, 1 TB RAM, 4x 3.84 TB NVMe (15 TB),
    # 8x ConnectX-6 200 Gb/s HDR InfiniBand for compute = 25 GB/s per GPU per direction.
    # 40960 MiB is the capacity nvidia-smi reports; HBM2 1,555 GB/s (A100 datasheet).
    # NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction (600 GB/s total, A100 datasheet).
    # PCIe Gen4 x16: 32 GB/s raw, ~25 GB/s achieved for pinned copies (CUDA bandwidthTest).
    "a100-40g": _dgx("a100-40g", _a100("a100-40g", 40960 * MiB, 1555), nvlink_gbps=300, ib_gbps=25,
                     pcie_gbps=25, host_memory_bytes=1 * TB, nvme_drives=4),
    # DGX A100 user guide (640 GB system): 8x A100-SXM4-80GB, 2 TB RAM, 8x 3.84 TB NVMe (30 TB), same fabric.
    # 81920 MiB as nvidia-smi reports; HBM2e 2,039 GB/s (A100 80GB datasheet).
    "a100-80g": _dgx("a100-80g", _a100("a100-80g", 81920 * MiB, 2039), nvlink_gbps=300, ib_gbps=25,
                     pcie_gbps=25, host_memory_bytes=2 * TB, nvme_drives=8),
    # DGX H100 user guide: 8x H100 SXM5 80GB, 2 TB RAM, 8x 3.84 TB NVMe U.2 (30 TB), 8x ConnectX-7 single-port
    # 400 Gb/s NDR InfiniBand = 50 GB/s per GPU per direction. 81559 MiB as nvidia-smi reports; HBM3 3.35 TB/s
    # (H100 datasheet). NVLink 4: 18 links, 900 GB/s total = 450 GB/s per direction.
    # PCIe Gen5 x16: 64 GB/s raw, ~50 GB/s achieved for pinned copies.
    "h100-sxm": _dgx("h100-sxm", _hopper("h100-sxm", 81559 * MiB, 3350), nvlink_gbps=450, ib_gbps=50,
                     pcie_gbps=50, host_memory_bytes=2 * TB, nvme_drives=8),
    # DGX H200 user guide: 8x H200 SXM 141GB, 2 TB RAM, 8x 3.84 TB NVMe U.2, 8x ConnectX-7 400 Gb/s NDR.
    # 143771 MiB as nvidia-smi reports; HBM3e 4.8 TB/s (H200 datasheet); NVLink 4 900 GB/s total; PCIe Gen5.
    "h200": _dgx("h200", _hopper("h200", 143771 * MiB, 4800), nvlink_gbps=450, ib_gbps=50,
                 pcie_gbps=50, host_memory_bytes=2 * TB, nvme_drives=8),
    "local-cpu": _LOCAL_CPU,
}

# Entries whose ranks all live on the one machine they describe and share its RAM: `4xlocal-cpu` is one node of
# 4 ranks (oversubscribed cores), each with host RAM / 4 as its "device" memory.
_LOCAL = frozenset({"local-cpu"})


# ---------------------------------------------------------------------------------------------------------------
# Efficiency and peaks


def efficiency(device: Device, flops: float) -> float:
    """Achieved fraction of peak for a kernel of `flops` FLOPs: the device's points interpolated linearly in
    log(flops), clamped to the first / last point outside their range."""
    points = device.efficiency
    if not flops > points[0][0]:  # also catches NaN and 0
        return points[0][1]
    if flops >= points[-1][0]:
        return points[-1][1]
    i = bisect.bisect_right([f for f, _ in points], flops)  # points[i-1].flops <= flops < points[i].flops
    (f0, e0), (f1, e1) = points[i - 1], points[i]
    t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
    return e0 + t * (e1 - e0)


def _family(device: Device) -> str | None:
    """The catalog family a device belongs to by name ("a100", "hopper"), None for others (CPUs, custom)."""
    name = device.name.lower()
    if "a100" in name:
        return "a100"
    if "h100" in name or "h200" in name or "hopper" in name:
        return "hopper"
    return None


def stream_bandwidth(device: Device) -> float:
    """Bytes/s a memory-bound kernel achieves: the datasheet bandwidth x BabelStream's attainable fraction on GPUs
    of the catalog; a device described otherwise (local-cpu, `mmplan calibrate`) gives its measured figure."""
    return device.memory_bandwidth * (_GPU_STREAM_FRACTION if _family(device) else 1.0)


# Streaming multiprocessors per GPU (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020: 108 SMs on A100;
# NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022: 132 SMs on H100 SXM5; H200 is the same GH100 part).
_SM_COUNT = {"a100": 108, "hopper": 132}


def sm_count(device: Device) -> int | None:
    """Streaming multiprocessors of a catalog GPU (_SM_COUNT); None for other devices (CPUs, custom)."""
    family = _family(device)
    return _SM_COUNT[family] if family else None


def attention_efficiency(device: Device, flops: float) -> float:
    """Fraction of peak a fused attention kernel achieves (flash attention, see _GPU_ATTENTION_FRACTION); on other
    devices the GEMM curve (a CPU runs attention as its own matmuls)."""
    family = _family(device)
    return _GPU_ATTENTION_FRACTION[family] if family else efficiency(device, flops)


def peak_flops(device: Device, dtype: str) -> float:
    """The device's dense peak FLOP/s for a compute dtype, or a clear error when it has none."""
    try:
        return device.peak_flops[dtype]
    except KeyError:
        raise MmplanError(f"device {device.name} has no peak FLOP/s for dtype {dtype}; it lists "
                          f"{', '.join(device.peak_flops)}") from None


# ---------------------------------------------------------------------------------------------------------------
# Cluster specs: shorthand or TOML

_SHORTHAND = re.compile(r"(?:(\d+)\s*x\s*)?([a-z][a-z0-9._-]*)")


def parse_cluster(spec: str, gpus_per_node: int | None = None) -> Cluster:
    """A cluster from a catalog shorthand (`64xh100-sxm`: 64 GPUs, 8 per node; bare `h200`: one node) or from the
    path of a cluster TOML file. gpus_per_node regroups the same GPUs into nodes of that size."""
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 1):
        raise FormatError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise FormatError("empty cluster spec: give a catalog shorthand such as 64xh100-sxm or a path to a .toml file")
    spec = spec.strip()
    if spec.lower().endswith(".toml") or "/" in spec or "\\" in spec or _is_file(spec):
        cluster = load_cluster_toml(spec)
        return cluster if gpus_per_node is None else _regroup(cluster, gpus_per_node, spec)
    return catalog_cluster(spec, gpus_per_node)


def _is_file(spec: str) -> bool:
    try:
        return Path(spec).is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def catalog_cluster(spec: str, gpus_per_node: int | None = None) -> Cluster:
    """`[N x]name` from CATALOG: N GPUs (default: one node) in nodes of the entry's size or gpus_per_node."""
    match = _SHORTHAND.fullmatch(spec.strip().lower())
    if match is None:
        raise FormatError(f"cluster spec {spec!r} is neither a catalog shorthand like 64xh100-sxm nor a path to a "
                          f".toml file")
    count, name = match.group(1), match.group(2)
    if count is not None and len(count.lstrip("0")) > 12:
        raise FormatError(f"GPU count in cluster spec {spec[:20]!r}... is out of range; give at most 12 digits")
    if name not in CATALOG:
        raise FormatError(f"unknown device {name!r} in cluster spec {spec!r}; known: {', '.join(CATALOG)} "
                          f"(or give a path to a cluster .toml file)")
    base = CATALOG[name]
    total = int(count) if count is not None else None
    if total == 0:
        raise FormatError(f"GPU count in cluster spec {spec!r} must be >= 1")
    if gpus_per_node is not None:
        per_node = gpus_per_node
    elif total is not None and (name in _LOCAL or total < base.gpus_per_node):
        per_node = total  # all local ranks on the one machine; fewer GPUs than a node: one partial node
    else:
        per_node = base.gpus_per_node
    total = per_node if total is None else total
    if total % per_node:
        raise FormatError(f"cluster spec {spec!r}: {total} GPUs do not fill whole nodes of {per_node}; use a "
                          f"multiple of {per_node} or another gpus_per_node")
    cluster = replace(base, name=f"{total}x{name}" if count is not None else name,
                      nodes=total // per_node, gpus_per_node=per_node)
    return _share_local_cores(_share_local_memory(cluster)) if name in _LOCAL else cluster


def _share_local_memory(cluster: Cluster) -> Cluster:
    """On a local machine each rank's "device" memory is its share of the node's RAM."""
    share = cluster.host_memory_bytes // cluster.gpus_per_node
    return replace(cluster, device=replace(cluster.device, memory_bytes=share))


# what a local-cpu rank's share of the reference machine's cores scales: its speeds down, its measured per-call costs up
_PER_CORE_COSTS = ("optimizer_tensor_s", "optimizer_byte_s", "step_overhead_s", "zero_block_s", "zero_byte_s",
                   "zero_tensor_s", "forward_op_s", "backward_op_s", "saved_tensor_s", "released_tensor_s")


def _share_local_cores(cluster: Cluster) -> Cluster:
    """More local ranks than the reference machine has cores (`4xlocal-cpu` on its 2): the ranks time-share the
    cores, so while all of them compute each runs at cores / ranks of the entry's one-rank-per-core figures --
    FLOP/s and memory bandwidth, the runtime's measured per-call costs, and profiles measured in one process
    (compute_slowdown). This is what `mmplan calibrate --ranks N` measures with N ranks busy at once; pipeline
    bubbles, in which some ranks idle, make it an upper bound."""
    share = min(1.0, _LOCAL_CORES / cluster.gpus_per_node)
    if share >= 1.0:
        return cluster
    device = replace(cluster.device, peak_flops={k: v * share for k, v in cluster.device.peak_flops.items()},
                     memory_bandwidth=cluster.device.memory_bandwidth * share)
    costs = {name: getattr(cluster, name) / share for name in _PER_CORE_COSTS}
    return replace(cluster, device=device, compute_slowdown=cluster.compute_slowdown / share, **costs)


def _regroup(cluster: Cluster, gpus_per_node: int, source: str) -> Cluster:
    total = cluster.world_size
    if total % gpus_per_node:
        raise FormatError(f"cluster {source}: its {total} GPUs do not fill whole nodes of gpus_per_node = "
                          f"{gpus_per_node}")
    return replace(cluster, nodes=total // gpus_per_node, gpus_per_node=gpus_per_node)


def load_cluster_toml(path: str | Path) -> Cluster:
    """Read a cluster TOML file (format: docs/cluster-toml.md); every problem is one FormatError."""
    return cluster_from_toml(read_text(path, "cluster file"), source=str(path))


def cluster_from_toml(text: str, source: str = "cluster TOML") -> Cluster:
    """Parse cluster TOML text. Floats are read as decimals so that cluster_to_toml's output reads back exactly."""
    try:
        data = tomllib.loads(text, parse_float=Decimal)
    except tomllib.TOMLDecodeError as e:
        raise FormatError(f"{source} is not valid TOML ({e})") from None
    except ValueError as e:  # valid TOML Python refuses to read: an integer of more digits than it converts
        raise FormatError(f"{source} is not usable TOML: {str(e).split('; use sys.set_int_max_str_digits')[0]}") from None
    except ArithmeticError:  # a float whose exponent does not fit a Decimal (e.g. 1e99999999999999999999)
        raise FormatError(f"{source} is not usable TOML: a number is out of range") from None
    except RecursionError:
        raise FormatError(f"{source} is not usable TOML: arrays or tables nest too deeply") from None
    return _cluster_from_data(data, source)


_LINKS = ("intra_node", "inter_node", "host_to_device", "nvme")


def _cluster_from_data(data: dict[str, Any], source: str) -> Cluster:
    """A Cluster from a parsed cluster TOML: validated against plans/schema/cluster.json (keys, types, signs, what
    is required without a base entry), then converted to bytes, FLOP/s and seconds over the base entry's values."""
    _check_finite(data, [], source)
    validate(data, "cluster", source, message=functools.partial(_schema_message, source))
    device_value = data.get("device")
    base_name = data.get("base", device_value if isinstance(device_value, str) else None)
    device_table = device_value if isinstance(device_value, dict) else {}
    base = None
    if base_name is not None:
        if base_name.lower() not in CATALOG:
            raise FormatError(f"{source}: unknown base device {base_name!r}; known: {', '.join(CATALOG)}")
        base_name = base_name.lower()
        base = CATALOG[base_name]
    gpus_per_node = data.get("gpus_per_node", base.gpus_per_node if base else None)
    host_memory = _bytes(data, "host_memory_gb", base.host_memory_bytes if base else None, source)
    device = _device(device_table, base.device if base else None, source)
    if base_name in _LOCAL and "memory_gb" not in device_table:
        device = replace(device, memory_bytes=host_memory // gpus_per_node)  # a rank's share of RAM
    links_table = data.get("links", {})
    links = {k: _link(links_table.get(k), getattr(base, k) if base else None, f"[links.{k}]", source) for k in _LINKS}
    return Cluster(name=data.get("name", base_name or "cluster"), nodes=data.get("nodes", 1), gpus_per_node=gpus_per_node,
                   device=device, **links, host_memory_bytes=host_memory,
                   nvme_bytes=_bytes(data, "nvme_gb", base.nvme_bytes if base else None, source),
                   backend=data.get("backend", base.backend if base else "nccl"), **_runtime_costs(data, base, source))


# The [runtime] table of a cluster TOML (`mmplan calibrate`'s measured runtime costs): TOML key -> (Cluster field, exponent)
_RUNTIME = {"optimizer_us_per_tensor": ("optimizer_tensor_s", -6), "optimizer_ns_per_byte": ("optimizer_byte_s", -9),
            "step_overhead_us": ("step_overhead_s", -6), "compute_slowdown": ("compute_slowdown", 0),
            "zero_us_per_block": ("zero_block_s", -6), "zero_ns_per_byte": ("zero_byte_s", -9),
            "zero_us_per_tensor": ("zero_tensor_s", -6), "forward_us_per_op": ("forward_op_s", -6),
            "backward_us_per_op": ("backward_op_s", -6), "us_per_saved_tensor": ("saved_tensor_s", -6),
            "us_per_released_tensor": ("released_tensor_s", -6)}


def _runtime_costs(data: dict[str, Any], base: Cluster | None, source: str) -> dict[str, float]:
    table = data.get("runtime", {})
    return {name: _scaled(table[key], exponent, f"[runtime] {key}", source) if key in table
            else getattr(base, name) if base else Cluster.__dataclass_fields__[name].default
            for key, (name, exponent) in _RUNTIME.items()}


def _check_finite(value: Any, path: list, source: str) -> None:
    """TOML's inf and nan (read as decimals) are no sizes or speeds (and a NaN does not compare: check them first)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, [*path, key], source)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, [*path, i], source)
    elif isinstance(value, Decimal) and not value.is_finite():
        raise FormatError(f"{source}: {_field(path)} must be a finite number, got {value}")


def _table(path: list) -> str:
    """The TOML table a path into the document names: "the top level", "[device]", "[links.nvme]", ..."""
    keys = [k for k in path if isinstance(k, str)]
    if not keys:
        return "the top level"
    return "[" + ".".join(keys[:2] if keys[0] == "links" or keys[1:2] == ["peak_tflops"] else keys[:1]) + "]"


def _field(path: list) -> str:
    """How a field is named in messages: "nodes", "[device] memory_gb", "[links.nvme] latency_us", "[device] efficiency"."""
    keys = [k for k in path if isinstance(k, str)]
    if len(keys) == 1:
        return keys[0] if keys[0] not in ("device", "links") else f"[{keys[0]}]"
    table = _table(keys)
    rest = keys[2:] if table.count(".") else keys[1:]
    if keys == ["device", "peak_tflops"]:
        return "[device] peak_tflops"
    return " ".join([table, *rest])


def _schema_message(source: str, err: Any) -> str:
    """One sentence for the first schema error of a cluster TOML, naming the field as the file names it."""
    path, node = list(err.absolute_path), err.schema
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        key = next(k for k in err.instance if k not in node.get("properties", {}))
        return f"{source}: unknown key {key!r} in {_table(path)}; allowed: {', '.join(node.get('properties', {}))}"
    if err.validator == "required":
        missing = next(k for k in err.validator_value if k not in err.instance)
        return f"{source}: {_field([*path, missing])} is required when no base device is given (base = \"h100-sxm\")"
    if "propertyNames" in err.schema_path:
        return f"{source}: unknown dtype {err.instance!r} in [device.peak_tflops]; known: {', '.join(DTYPES)}"
    if err.validator == "not":  # device = "name" beside base = "name"
        return f"{source}: {node['x-error']}"
    clause = node.get("x-error") or _expected(node, err.validator) or err.message
    return f"{source}: {_field(path)} {clause}, got {_brief_value(err.instance)}"


def _expected(node: dict, validator: str) -> str | None:
    """The clause of a message for a failed scalar field, from its schema: "must be an integer >= 1", ..."""
    if "enum" in node:
        return f"must be one of {', '.join(node['enum'])}"
    kind = node.get("type")
    if kind == "integer":
        return f"must be an integer >= {node.get('minimum', 0)}"
    if kind == "number":
        if validator == "type":
            return "must be a number"
        return f"must be a finite number > {node['exclusiveMinimum']}" if "exclusiveMinimum" in node \
            else f"must be a finite number >= {node.get('minimum', 0)}"
    if kind == "string":
        return "must be a non-empty string"
    return None


def _brief_value(value: Any) -> str:
    """A value as the TOML file wrote it (decimals as numbers), cut short."""
    text = _as_written(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]}"


def _as_written(value: Any) -> str:
    if isinstance(value, Decimal):
        return _brief(value)
    if isinstance(value, list):
        return "[" + ", ".join(_as_written(v) for v in value[:8]) + (", ..." if len(value) > 8 else "") + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_as_written(v)}" for k, v in list(value.items())[:8]) + "}"
    return repr(value)


# Numbers of a cluster file lie within 1e-400 .. 1e400 (floats span 5e-324 .. 1.8e308, and a field is scaled by
# at most 1e12); beyond, the decimal arithmetic that turns them into bytes and seconds overflows or stalls.
_MAX_EXPONENT = 400
_MAX_BYTES = 10**24  # no tier holds a yottabyte; larger integers overflow float arithmetic downstream


def _in_range(number: Decimal, field: str, source: str) -> Decimal:
    if number and not -_MAX_EXPONENT <= number.adjusted() <= _MAX_EXPONENT:
        raise FormatError(f"{source}: {field} is out of range, got {_brief(number)}")
    return number


def _brief(number: Decimal) -> str:
    text = str(number)
    return text if len(text) <= 32 else f"{text[:16]}...{text[-8:]}"


def _bytes(table: dict[str, Any], key: str, default: int | None, source: str, where: str = "") -> int:
    """A size in GB (1e9 bytes; a schema-checked number > 0, or absent: the base's) -> whole bytes."""
    if key not in table:
        return default
    nbytes = int(_in_range(Decimal(table[key]), where + key, source).scaleb(9).to_integral_value(ROUND_HALF_EVEN))
    if nbytes < 1:
        raise FormatError(f"{source}: {where}{key} must be at least one byte, got {table[key]}")
    if nbytes > _MAX_BYTES:
        raise FormatError(f"{source}: {where}{key} is out of range (at most {_MAX_BYTES // GB:.0e} GB), "
                          f"got {_brief(Decimal(table[key]))}")
    return nbytes


def _scaled(value: Any, exponent: int, field: str, source: str) -> float:
    """value x 10**exponent, rounded once (so decimals written by _number() read back bit-exactly)."""
    return float(_in_range(Decimal(value), field, source).scaleb(exponent))


def _device(table: dict[str, Any], base: Device | None, source: str) -> Device:
    """The [device] table (schema-checked) over the base entry's device."""
    peaks = {k: _scaled(v, 12, f"[device.peak_tflops] {k}", source) for k, v in table.get("peak_tflops", {}).items()}
    memory = _bytes(table, "memory_gb", base.memory_bytes if base else None, source, "[device] ")
    if "memory_bandwidth_gbps" in table:
        bandwidth = _scaled(table["memory_bandwidth_gbps"], 9, "[device] memory_bandwidth_gbps", source)
    else:
        bandwidth = base.memory_bandwidth
    curve = _efficiency_points(table["efficiency"], source) if "efficiency" in table else (
        base.efficiency if base else Device.__dataclass_fields__["efficiency"].default)
    try:
        return Device(table.get("name", base.name if base else None), {**(base.peak_flops if base else {}), **peaks},
                      memory, bandwidth, curve)
    except FormatError as e:
        raise FormatError(f"{source}: [device] {e}") from None


def _efficiency_points(value: list, source: str) -> tuple[tuple[float, float], ...]:
    points = tuple((_scaled(f, 0, "[device] efficiency flops", source), _scaled(e, 0, "[device] efficiency value", source))
                   for f, e in value)
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise FormatError(f"{source}: [device] efficiency points must be sorted by strictly increasing flops")
    return points


def _link(table: dict[str, Any] | None, base: Link | None, where: str, source: str) -> Link:
    """A [links.*] table (schema-checked) over the base entry's link."""
    if table is None:
        return base
    bandwidth = _scaled(table["bandwidth_gbps"], 9, f"{where} bandwidth_gbps", source) if "bandwidth_gbps" in table \
        else base.bandwidth
    latency = float(_in_range(Decimal(table["latency_us"]), f"{where} latency_us", source).scaleb(-6)) \
        if "latency_us" in table else (base.latency_s if base else 0.0)
    collective = float(_in_range(Decimal(table["collective_us"]), f"{where} collective_us", source).scaleb(-6)) \
        if "collective_us" in table else (base.collective_s if base else 0.0)
    try:
        return Link(bandwidth, latency, collective)
    except FormatError as e:  # a finite decimal too large for a float
        raise FormatError(f"{source}: {where} {e}") from None


def _number(value: float | int, exponent: int = 0) -> str:
    """value x 10**exponent as a plain TOML number whose exact decimal reads back to value (see _scaled)."""
    exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    return format(exact.scaleb(exponent).normalize(), "f")


def cluster_to_toml(cluster: Cluster) -> str:
    """A self-contained cluster TOML (no base entry) that parse_cluster reads back to an equal Cluster."""
    dev = cluster.device
    lines = [
        "# mmplan cluster (format: docs/cluster-toml.md). Units: GB = 1e9 bytes, GB/s = 1e9 bytes/s,",
        "# us = 1e-6 s, TFLOP/s = 1e12 FLOP/s; efficiency = [[FLOPs of one kernel, fraction of peak], ...].",
        f"name = {_string(cluster.name)}",
        f"nodes = {cluster.nodes}",
        f"gpus_per_node = {cluster.gpus_per_node}",
        f"backend = {_string(cluster.backend)}",
        f"host_memory_gb = {_number(cluster.host_memory_bytes, -9)}  # per node",
        f"nvme_gb = {_number(cluster.nvme_bytes, -9)}  # per node",
        "",
        "[device]",
        f"name = {_string(dev.name)}",
        f"memory_gb = {_number(dev.memory_bytes, -9)}  # per rank",
        f"memory_bandwidth_gbps = {_number(dev.memory_bandwidth, -9)}",
        "efficiency = [" + ", ".join(f"[{_number(f)}, {_number(e)}]" for f, e in dev.efficiency) + "]",
        "",
        "[device.peak_tflops]  # dense",
        *(f"{dtype} = {_number(flops, -12)}" for dtype, flops in dev.peak_flops.items()),
    ]
    for key in _LINKS:
        link: Link = getattr(cluster, key)
        lines += ["", f"[links.{key}]", f"bandwidth_gbps = {_number(link.bandwidth, -9)}",
                  f"latency_us = {_number(link.latency_s, 6)}"]
        if link.collective_s:
            lines.append(f"collective_us = {_number(link.collective_s, 6)}")
    if any(getattr(cluster, name) != Cluster.__dataclass_fields__[name].default for name, _ in _RUNTIME.values()):
        lines += ["", "[runtime]  # measured by mmplan calibrate"]
        lines += [f"{key} = {_number(getattr(cluster, name), -exponent)}" for key, (name, exponent) in _RUNTIME.items()]
    return "\n".join(lines) + "\n"


def _string(text: str) -> str:
    """A TOML basic string: backslash, quote and control characters (incl. DEL) escaped (TOML 1.0, "String")."""
    escaped = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in '"\\' else c
                      for c in text)
    return f'"{escaped}"'


__all__ = ["CATALOG", "GB", "GBps", "GiB", "MiB", "TB", "TFLOPS", "US", "attention_efficiency", "catalog_cluster",
           "cluster_from_toml", "cluster_to_toml", "efficiency", "sm_count", "stream_bandwidth", "load_cluster_toml", "parse_cluster", "peak_flops"]
