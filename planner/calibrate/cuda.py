"""`mmplan calibrate --device cuda`: a GPU cluster measured under torchrun (GEMMs by shape, NCCL collectives and p2p
within and across nodes, FSDP2's per-block cost) and described as the cluster TOML the solver reads."""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.calibrate.fit import fit_alpha_beta, rounded
from plans.cluster import Cluster, Device, Link
from plans.errors import MmplanError

# GEMM shapes (m, n, k) timed in bf16: square sizes for the curve's launch-bound end, and transformer shapes (tokens
# x hidden x hidden, tokens x 4 hidden x hidden, a head's 128k vocabulary) for its top (the cost model prices each
# GEMM by its FLOPs on this curve: hardware.efficiency).
GEMM_SHAPES = ((256, 256, 256), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
               (8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (4096, 128256, 4096))
# Message sizes of the collectives and p2p (bytes): 64 KiB .. 1 GiB, alpha at the small end, beta at the large.
MESSAGE_BYTES = tuple(2**k for k in range(16, 31, 2))
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "p2p")
SCOPES = ("intra_node", "inter_node")


@dataclass(frozen=True)
class CudaMeasurements:
    """What the ranks measured. `gemm`: (m, n, k, seconds) in bf16; `collectives`: per scope ("intra_node",
    "inter_node") and collective (COLLECTIVES) the (bytes, seconds) samples over `ranks[scope]` ranks (a collective's
    bytes are its whole buffer: the gathered output, the scattered input); `fsdp_block_s`: FSDP2's cost per sharded
    block and micro-batch (forward and backward) beyond the compute and the collectives."""

    device_name: str
    memory_bytes: int
    nodes: int
    gpus_per_node: int
    gemm: tuple[tuple[int, int, int, float], ...]
    memory_bandwidth: float
    host_to_device: Link
    collectives: dict[str, dict[str, tuple[tuple[float, float], ...]]]
    ranks: dict[str, int]
    fsdp_block_s: float
    host_memory_bytes: int
    nvme: Link
    nvme_bytes: int


def require_cuda() -> None:
    """Raise the one-line refusal on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise MmplanError("mmplan calibrate --device cuda needs CUDA GPUs: torch.cuda.is_available() is False on this "
                          "machine (calibrate it without --device cuda)")


def link_from_collective(op: str, fit: Link, ranks: int) -> Link:
    """The per-hop link (bandwidth, latency) under which `op` over `ranks` ranks takes the fitted t = A + S / B:
    ring all-reduce 2 (p-1) hops moving 2 (p-1)/p S, all-gather / reduce-scatter p-1 hops moving (p-1)/p S
    (Thakur, Rabenseifner & Gropp 2005; the formulas cost_models/comm.py applies), p2p one hop moving S."""
    if op == "p2p" or ranks < 2:
        return fit
    hops = (2 if op == "all_reduce" else 1) * (ranks - 1)
    return Link(bandwidth=fit.bandwidth * hops / ranks, latency_s=fit.latency_s / hops)


def scope_link(samples: dict[str, tuple[tuple[float, float], ...]], ranks: int) -> Link:
    """One scope's Link: the lowest per-hop bandwidth the collectives and p2p imply (what the slowest call of a step
    gets), the p2p send's latency."""
    links = {op: link_from_collective(op, fit_alpha_beta(*zip(*samples[op])), ranks) for op in COLLECTIVES if op in samples}
    if not links:
        raise MmplanError("calibrate --device cuda measured no collective for a scope")
    latency = links["p2p"].latency_s if "p2p" in links else min(lk.latency_s for lk in links.values())
    return rounded(Link(min(lk.bandwidth for lk in links.values()), latency))


def gemm_points(gemm: tuple[tuple[int, int, int, float], ...]) -> tuple[tuple[float, float], ...]:
    """(FLOPs per kernel, FLOP/s) of each timed GEMM, by FLOPs (the mean rate where shapes share a FLOP count)."""
    by_flops: dict[float, list[float]] = {}
    for m, n, k, seconds in gemm:
        by_flops.setdefault(2.0 * m * n * k, []).append(2.0 * m * n * k / seconds)
    return tuple((f, statistics.fmean(r)) for f, r in sorted(by_flops.items()))


def cuda_cluster(m: CudaMeasurements, *, peak_bf16: float | None = None, name: str = "calibrated-gpu",
                 unmeasured: Link | None = None) -> Cluster:
    """The Cluster the measurements describe: the bf16 peak (`peak_bf16`, the datasheet's when the caller knows the
    device, else the fastest GEMM measured), the GEMM efficiency curve by kernel FLOPs relative to it, the NCCL links
    within and across nodes (scope_link; one node: the intra-node link for both; one GPU per node: `unmeasured`, the
    catalog's link of the device, as nothing could be measured), FSDP2's per-block cost."""
    points = gemm_points(m.gemm)
    peak = peak_bf16 or max(rate for _, rate in points)
    curve = tuple((f, float(f"{min(1.0, rate / peak):.4g}")) for f, rate in points)  # as fit.efficiency_curve
    device = Device(name=m.device_name, peak_flops={"bf16": peak, "fp16": peak}, memory_bytes=m.memory_bytes,
                    memory_bandwidth=m.memory_bandwidth, efficiency=curve)
    if not m.collectives["intra_node"] and unmeasured is None:
        raise MmplanError("calibrate --device cuda measured no collective within a node (one GPU per node) and knows no "
                          f"catalog link for {m.device_name}")
    intra = scope_link(m.collectives["intra_node"], m.ranks["intra_node"]) if m.collectives["intra_node"] else unmeasured
    inter = scope_link(m.collectives["inter_node"], m.ranks["inter_node"]) if m.nodes > 1 else intra
    return Cluster(name=name, nodes=m.nodes, gpus_per_node=m.gpus_per_node, device=device, intra_node=intra,
                   inter_node=inter, host_to_device=rounded(m.host_to_device), nvme=rounded(m.nvme),
                   host_memory_bytes=m.host_memory_bytes, nvme_bytes=m.nvme_bytes, backend="nccl",
                   zero_block_s=float(f"{m.fsdp_block_s:.4g}"))


def write_cluster(m: CudaMeasurements, output: str | os.PathLike, *, peak_bf16: float | None = None,
                  unmeasured: Link | None = None) -> Cluster:
    """Write the measured cluster as a TOML (cost_models.cluster_toml) at `output`; return it."""
    from cost_models.cluster_toml import cluster_to_toml
    from plans.serial import write_atomic

    cluster = cuda_cluster(m, peak_bf16=peak_bf16, unmeasured=unmeasured)
    write_atomic(Path(output), cluster_to_toml(cluster))
    return cluster


# --- on the GPUs (under torchrun; not exercised on CPU-only machines) ------------------------------------------------

def _timed(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median seconds of `fn` on the current CUDA stream, after one warm-up, by CUDA events."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _gemms() -> tuple[tuple[int, int, int, float], ...]:
    import torch

    out = []
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        out.append((m, n, k, _timed(lambda: torch.mm(a, b))))
    return tuple(out)


def _collectives(group, ranks: list[int], rank: int) -> dict[str, tuple[tuple[float, float], ...]]:
    """(bytes, seconds) of each collective over `group` (every member calls it), p2p between its first two ranks."""
    import torch
    import torch.distributed as dist

    p = len(ranks)
    out: dict[str, list] = {op: [] for op in COLLECTIVES}
    for nbytes in MESSAGE_BYTES:
        full = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(nbytes // 2 // p, device="cuda", dtype=torch.bfloat16)
        full = full[: part.numel() * p]
        calls = {"all_gather": lambda: dist.all_gather_into_tensor(full, part, group=group),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, group=group),
                 "all_reduce": lambda: dist.all_reduce(full, group=group)}
        for op, call in calls.items():
            dist.barrier(group=group)
            out[op].append((float(full.numel() * 2), _timed(call)))
        if rank in ranks[:2]:
            peer = ranks[1] if rank == ranks[0] else ranks[0]
            send = rank == ranks[0]
            out["p2p"].append((float(full.numel() * 2), _timed(
                lambda: dist.send(full, peer) if send else dist.recv(full, peer))))
    return {op: tuple(v) for op, v in out.items() if v}


def _fsdp_block_s(blocks: int = 32, width: int = 256) -> float:
    """FSDP2's cost per block and micro-batch: a stack of small linear blocks, each under fully_shard (one FSDP2 unit
    per block, as runtime/zero.py), minus the same stack unsharded; forward + backward, per block."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    plain = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks))).cuda()
    sharded = copy.deepcopy(plain)
    for block in sharded:
        fully_shard(block)
    fully_shard(sharded)
    x = torch.randn(8, width, device="cuda")

    def step(model):
        def run():
            model(x).sum().backward()
        return run
    return max(0.0, (_timed(step(sharded)) - _timed(step(plain))) / blocks)


def measure_cluster(output: str | os.PathLike) -> Cluster | None:
    """Run on every rank of a torchrun launch (LOCAL_WORLD_SIZE GPUs per node, WORLD_SIZE in all): measure, then rank 0
    writes the cluster TOML at `output` and returns the Cluster (other ranks: None)."""
    import shutil

    import torch
    import torch.distributed as dist

    from planner.calibrate.local import mem_total

    require_cuda()
    if "RANK" not in os.environ:
        raise MmplanError("mmplan calibrate --device cuda runs under torchrun, e.g. `torchrun --nproc-per-node 8 "
                          "--nnodes N ... -m planner.cli calibrate --device cuda`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    nodes = world // per_node
    node_groups = [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]
    across = [list(range(i, world, per_node)) for i in range(per_node)]
    groups = {tuple(g): dist.new_group(g) for g in node_groups + across}  # every rank creates every group
    mine_intra, mine_inter = node_groups[rank // per_node], across[local]
    started = time.perf_counter()
    gemm = _gemms()
    samples = {"intra_node": _collectives(groups[tuple(mine_intra)], mine_intra, rank) if per_node > 1 else {},
               "inter_node": _collectives(groups[tuple(mine_inter)], mine_inter, rank) if nodes > 1 else {}}
    fsdp = _fsdp_block_s()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, samples)
    if rank != 0:
        dist.destroy_process_group()
        return None
    # per scope, collective and size: the slowest rank's time (a collective ends when its last rank does)
    merged = {scope: {op: tuple((rows[0][0], max(t for _, t in rows))
                                for rows in zip(*(g[scope][op] for g in gathered if op in g[scope])))
                      for op in COLLECTIVES if any(op in g[scope] for g in gathered)} for scope in SCOPES}
    src = torch.ones(2**29, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / _timed(lambda: dst.copy_(src))
    host = torch.empty(2**28, dtype=torch.uint8).pin_memory()
    h2d = Link(host.numel() / _timed(lambda: dst[: host.numel()].copy_(host, non_blocking=True)), 10e-6)
    m = CudaMeasurements(
        device_name=torch.cuda.get_device_name(), memory_bytes=torch.cuda.get_device_properties(local).total_memory,
        nodes=nodes, gpus_per_node=per_node, gemm=gemm, memory_bandwidth=bandwidth, host_to_device=h2d,
        collectives=merged,
        ranks={"intra_node": per_node, "inter_node": nodes}, fsdp_block_s=fsdp, host_memory_bytes=mem_total(),
        nvme=Link(2e9, 100e-6), nvme_bytes=max(1, shutil.disk_usage(Path(output).resolve().parent).free))
    print(f"calibrate --device cuda: {world} GPUs measured in {time.perf_counter() - started:.0f} s", flush=True)
    dist.destroy_process_group()
    ref = _catalog_entry(m.device_name)
    return write_cluster(m, output, peak_bf16=ref.device.peak_flops["bf16"] if ref else None,
                         unmeasured=ref.intra_node if ref else None)


def _catalog_entry(device_name: str) -> Cluster | None:
    """The catalog cluster of a device of the same family (cost_models/catalog.py: its datasheet peak, its NVLink),
    None for others."""
    from cost_models.catalog import CATALOG

    name = device_name.lower()
    key = next((k for k, hint in (("h200", "h200"), ("h100-sxm", "h100"), ("a100-80g", "a100")) if hint in name), None)
    return CATALOG[key] if key and key in CATALOG else None


__all__ = ["COLLECTIVES", "CudaMeasurements", "cuda_cluster", "gemm_points", "link_from_collective", "measure_cluster",
           "require_cuda", "scope_link", "write_cluster"]
