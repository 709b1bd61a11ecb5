"""Why nothing fits: the capacity check before the tier search and the sentence naming the shortfall when no plan fits."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cost_models.memory import model_state_bytes
from planner.solver.candidates import stage_in_flight, zero_stages
from planner.solver.partition import cut_table
from planner.solver.segments import Segments
from planner.solver.space import GPU_ONLY, OFFLOAD, Policy, Setting, divisors, tp_degrees
from planner.solver.structure import profile_units
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.units import format_bytes, format_capacity, short_by


def state_bytes(profile: Profile, dtype: str) -> float:
    """Bytes of the model's training state: parameters, gradients and optimizer state (mixed-precision Adam)."""
    return model_state_bytes(sum(b.params for b in profile.blocks), dp=1, zero=0, dtype=dtype, optimizer="adam").total


def check_capacity(profile: Profile, cluster: Cluster, dtype: str) -> None:
    """The training state must fit in all tiers combined: every GPU, every node's host memory and NVMe."""
    need = state_bytes(profile, dtype)
    have = cluster.world_size * cluster.device.memory_bytes + cluster.nodes * (cluster.host_memory_bytes + cluster.nvme_bytes)
    if need > have:
        raise MmplanError(
            f"{profile.model} cannot fit on {cluster.world_size} x {cluster.device.name} even with every memory tier: its training "
            f"state needs {need / 1e9:,.1f} GB but GPU memory, host memory and NVMe hold {have / 1e9:,.1f} GB "
            f"{short_by(need, have)}; add nodes or NVMe")


def no_fit(profile: Profile, cluster: Cluster, setting: Setting, structures, memory_tiers: bool, stopped: bool) -> MmplanError:
    if stopped:
        return MmplanError("the time limit ended the search before any plan that fits was found; raise --time-limit")
    need = _least_gpu_bytes(profile, cluster, setting, memory_tiers)
    cap = cluster.device.memory_bytes
    how = "with every memory tier" if memory_tiers else "in GPU memory (try --memory-tiers)"
    if need is None or need <= cap:
        single = f"one layout for the whole model would need {need / 1e9:,.2f} GB of the {format_capacity(cap)} per GPU" \
            if need is not None else f"no layout fits the {format_capacity(cap)} per GPU"
        return MmplanError(f"no plan of {profile.model} fits {cluster.world_size} x {cluster.device.name} {how} at global batch "
                           f"{setting.global_batch} with the placements searched ({single}); add GPUs or change the global batch")
    return MmplanError(
        f"{profile.model} does not fit on {cluster.world_size} x {cluster.device.name} {how}: its least-loaded layout needs "
        f"{format_bytes(need)} on its fullest GPU, which has {format_capacity(cap)} {short_by(need, cap)}; "
        f"{_more_gpus(profile, cluster, setting, memory_tiers, cap)}")


def _more_gpus(profile: Profile, cluster: Cluster, setting: Setting, memory_tiers: bool, cap: float) -> str:
    """The advice when the least-loaded layout is short of GPU memory: "add GPUs" only when a deeper pipeline (one
    stage per block at most, which more nodes allow) brings its fullest GPU under the capacity; otherwise what it
    would still need, since more GPUs cannot shrink a stage below one block."""
    unit = profile_units(profile, "chain")[0]
    floor = None
    if cluster.world_size < len(unit.blocks) * max(tp_degrees(unit, cluster)):
        more = replace(cluster, nodes=cluster.nodes * len(unit.blocks))
        floor = _least_gpu_bytes(profile, more, replace(setting, cluster=more), memory_tiers)
        if floor is not None and floor <= cap:
            return f"add GPUs (a deeper pipeline's fullest GPU needs {format_bytes(floor)})"
    still = f": one block per stage still needs {format_bytes(floor)}" if floor is not None else ""
    return (f"more GPUs do not help{still}; use GPUs with more memory, a smaller --memory-reserve or a smaller model "
            f"or sequence")


def _least_gpu_bytes(profile: Profile, cluster: Cluster, setting: Setting, memory_tiers: bool) -> float | None:
    """The least GPU memory any layout of the whole model needs on its fullest rank: the partition DP with stage
    memory as its cost (min-max bytes), over tp and dp degrees, the most sharding ZeRO stage and every policy,
    at the most micro-batches (the fewest samples in each)."""
    unit = profile_units(profile, "chain")[0]
    policies = GPU_ONLY + (OFFLOAD if memory_tiers else ())
    st = replace(setting, policies=policies)
    m = setting.global_batch
    best = None
    for tp in tp_degrees(unit, cluster):
        for dp in divisors(setting.global_batch // m):
            if tp * dp > cluster.world_size:
                continue
            seg = Segments(unit, st, tp, dp, zero_stages(cluster, dp)[-1], m)
            depth = min(len(unit.blocks), cluster.world_size // (tp * dp))
            table = cut_table(seg.n, functools.partial(_stage_bytes, seg, policies), depth)
            for pp in range(1, depth + 1):
                part = table.best(pp)
                if part is not None and (best is None or part.slowest < best):
                    best = part.slowest
    return best


def _stage_bytes(seg: Segments, policies: Sequence[Policy], q: int) -> np.ndarray:
    """GPU bytes of every segment as a stage with q stages after it, under its least-GPU policy."""
    flight = stage_in_flight(seg.setting.schedule, seg.micro_batches, q)
    out = np.full_like(seg.params, np.inf)
    for pol in policies:
        g0, g1, *_ = seg.memory(pol)
        out = np.minimum(out, np.where(seg.valid, g0 + flight * g1, np.inf))
    return out
