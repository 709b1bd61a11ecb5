"""The catalog of named GPUs and clusters (DGX nodes of A100 / H100 / H200, local-cpu), each figure with its source."""
from __future__ import annotations

from plans.cluster import Cluster, Device, Link

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
# - A100: 0.737. What PyTorch's cuBLAS sustains on a large square fp16 GEMM: `a @ b` at n = 8192 on an A100 80GB,
#   timed over at least 3 s (torch.utils.benchmark blocked_autorange(min_run_time=3), so at the clocks a sustained
#   load runs at), 230 TFLOP/s = 0.737 x 312 (mli/transformers-benchmarks, README "Micro-Benchmarking Summary" and
#   micro_bench.ipynb, NGC PyTorch 22.07: the cuBLAS of the 2021-2022 Megatron-LM runs). NVIDIA's CUTLASS profiler
#   documentation (media/docs/profiler.md, CUTLASS 2.2, 2020) measures one CUTLASS kernel, m=3456 n=4096 k=8192, at
#   235.1 TFLOP/s = 0.754 (the figure used before: a profiler run, not cuBLAS under a sustained load). The best
#   shape of a search with today's cuBLAS reaches 267.9 TFLOP/s = 0.86 (S. Bekman, ml-engineering, "Maximum
#   Achievable Matmul FLOPS" table): a searched maximum, not a transformer's shapes.
# - Hopper: 0.687 (estimate, derived the A100's way). No sustained-load cuBLAS figure for H100 was found: what is
#   published are short bursts -- the searched maximum of the same MAMF table, 792.1 TFLOP/s = 0.801 of 989.4
#   (ml-engineering, table of 2024, CUDA 12.1; 794.5 = 0.803 with torch 2.7, "H200 is the same"), and 30-iteration
#   square bf16 matmuls of 0.68 / 0.80 / 0.81 at n = 2048 / 4096 / 8192 (zzc0721/torch-performance-test-data issue
#   #79, H100 80GB HBM3, torch 2.7: ~40 ms of work, before the clocks settle). A GPU held at its power limit runs
#   below its burst clocks (ml-engineering, benchmarks/README.md "Input data affects measured performance": the
#   SM clock steps down to stay inside the power envelope); on the A100 the sustained square GEMM above is 0.737 /
#   0.859 = 0.858 of the same table's burst maximum (267.9 TFLOP/s = 0.859, CUDA 12.1). That ratio applied to the
#   H100's burst maximum: 0.801 x 0.858 = 0.687. (The 0.75 used before was an estimate between the two, uncited.)
# Both are replaced by measurements with `mmplan calibrate` on the target.
_GPU_LAUNCH_S = 5e-6
_GPU_BEST_FRACTION = {"a100": 0.737, "hopper": round(0.801 * 0.737 / 0.859, 3)}


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
LOCAL_CORES = 2
_LOCAL_RAM = 24_684_096 * 1024  # /proc/meminfo MemTotal on the reference machine (kB)
_LOCAL_CPU = Cluster(
    name="local-cpu",
    nodes=1,
    gpus_per_node=LOCAL_CORES,
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
        memory_bytes=_LOCAL_RAM // LOCAL_CORES,  # a rank's share of RAM (the "GPU" tier is host RAM here)
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
LOCAL = frozenset({"local-cpu"})

