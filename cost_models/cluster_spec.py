"""Cluster specs: a catalog shorthand (`64xh100-sxm`) or a TOML path, and local ranks' shares of one machine."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from cost_models.catalog import CATALOG, LOCAL, LOCAL_CORES
from cost_models.cluster_toml import load_cluster_toml
from plans.cluster import Cluster
from plans.errors import FormatError

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
    elif total is not None and (name in LOCAL or total < base.gpus_per_node):
        per_node = total  # all local ranks on the one machine; fewer GPUs than a node: one partial node
    else:
        per_node = base.gpus_per_node
    total = per_node if total is None else total
    if total % per_node:
        raise FormatError(f"cluster spec {spec!r}: {total} GPUs do not fill whole nodes of {per_node}; use a "
                          f"multiple of {per_node} or another gpus_per_node")
    cluster = replace(base, name=f"{total}x{name}" if count is not None else name,
                      nodes=total // per_node, gpus_per_node=per_node)
    return _share_local_cores(_share_local_memory(cluster)) if name in LOCAL else cluster


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
    share = min(1.0, LOCAL_CORES / cluster.gpus_per_node)
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

