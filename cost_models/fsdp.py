"""ZeRO / FSDP2 per block: a chunk's forward and backward with each block's all-gather and reduce-scatter beside its
neighbours' compute, the SMs NCCL takes from the GEMMs it overlaps, and FSDP2's copies and hooks per block."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cost_models.comm import all_gather_time, reduce_scatter_time
from cost_models.hardware import sm_count, stream_bandwidth
from cost_models.memory import zero_divisors
from plans.cluster import Cluster, Link

# How FSDP2 (torch.distributed.fsdp.fully_shard, one unit per block: runtime/zero.py) runs a chunk's blocks 0..n-1:
# - Forward: block k's all-gather is issued on its own stream when the CPU reaches block k, while the GPU still
#   computes block k-1 ("implicit forward prefetching ... layer 1 all-gather can overlap with layer 0 forward
#   compute ... The 1st all-gather will not be able to overlap with anything", PyTorch docs, notes/fsdp.rst,
#   "FSDP Prefetch Nuances"); so the prefetch depth is one block and the first gather is exposed:
#       fwd = g_0 + sum_{k<n-1} overlapped(c_k, g_{k+1}) + c_{n-1}.
# - Backward (blocks n-1..0): FSDP2 prefetches the all-gather of the next block in backward order, one block ahead
#   (FSDPModule.set_modules_to_backward_prefetch's docstring, torch/distributed/fsdp/_fully_shard/_fully_shard.py:
#   "the default backward pre[f]etching implementation ... prefetches the next FSDP module based on the reverse
#   post-forward order"; a longer list "is required for more aggressive overlap"), and reduce-scatters block k's gradients on
#   the reduce-scatter stream after block k's backward, beside block k-1's backward. The gathers and the
#   reduce-scatters share the rank's links, so they are timed one after the other on one comm lane:
#       bwd = g_{n-1} + sum_k overlapped(b_k, g_{k-1} + r_{k+1}) + r_0   (g_{-1} = r_n = 0),
#   the first gather and the last reduce-scatter exposed. Without a backward gather (reshard_after_forward=False,
#   ZeRO-2's reduce-scatters) the g terms are 0.
# - overlapped(c, x): compute of c seconds beside a collective of x seconds. NCCL's kernels occupy one SM per
#   channel for the whole collective, so the compute runs on the other SMs while it lasts: it does the share
#   (1 - f) of its work per second, f = NCCL's SMs / the GPU's SMs; after the collective it runs at full speed:
#       overlapped(c, x) = max(x, c + f x)      (exact: c + f x when the compute outlasts x / (1 - f)).
#   f is _NCCL_OVERLAP_CTAS / hardware.sm_count; 0 for devices without a known SM count (CPUs: nothing overlaps
#   there anyway, offload.overlaps_compute).
# - ZeRO-1/2 (reshard_after_forward=False; resharded after the stage's last backward: runtime/zero.before_backward):
#   nothing gathers after the optimizer step; the next step's first forward of the chunk gathers block by block in
#   the same pre-forward hooks (FSDPParamGroup.pre_forward -> unshard, _fsdp_param_group.py), so its all-gathers
#   are the forward's g_k above, once per step, with FSDP2's copies around each (copy_time); the later micro-batches
#   find the parameters unsharded (unshard is a no-op). What they add to that forward is gather_exposure.
# The same formulas, summed over every segment [i, j) of a unit at once, are the solver's (segment_times); tests
# check the two agree.

# SMs an NCCL all-gather holds while it overlaps FSDP2's GEMMs: 24 thread blocks (one per channel) measured in
# Nsight Systems beside a 132-block GEMM on an H100 (NVIDIA developer forums, "Compute-Communication Overlap
# Causes Severe GEMM Performance Degradation because of Tail Effect", 2025, thread 337991: "the concurrent
# ncclAllGather kernel launches 24 blocks"; the same thread measured the GEMM nearly 2x slower from the extra
# wave, which this share-of-SMs model leaves out). Taken for A100 too (NCCL picks channels per topology; no
# published A100 figure was found).
_NCCL_OVERLAP_CTAS = 24

# FSDP2's host work per sharded block and pass (pre/post-forward or pre/post-backward hooks, DTensor <-> tensor
# swaps): "`FSDP::pre_forward` calls take 50% of the step time of my model ... 1 ms launches" (pytorch/pytorch
# issue 173680, torch 2.10 on a Xeon host, profiler trace). On a GPU the host runs ahead of the device, so this only
# bounds a block from below (overhead.with_host's rule): a block takes max(device work, host work).
_FSDP2_HOOK_S = 1e-3


def overlap_share(cluster: Cluster) -> float:
    """f: the share of the GPU's SMs NCCL's collective kernels hold while they overlap compute (0: unknown / CPU)."""
    sms = sm_count(cluster.device) if cluster.backend == "nccl" else None
    return _NCCL_OVERLAP_CTAS / sms if sms else 0.0


def overlapped(compute_s, comm_s, share: float):
    """Seconds of `compute_s` of compute beside a `comm_s` collective that holds `share` of the SMs (numpy too)."""
    return np.maximum(comm_s, compute_s + share * comm_s)


def host_floor(cluster: Cluster) -> float:
    """Seconds of host work per sharded block and pass that bound it from below on a GPU (_FSDP2_HOOK_S), unless
    `mmplan calibrate` measured FSDP2's per-block cost (Cluster.zero_block_s, added as CPU work by
    overhead.zero_block_time); 0 on CPU ranks."""
    return _FSDP2_HOOK_S if cluster.backend == "nccl" and cluster.zero_block_s == 0 else 0.0


def copy_time(param_bytes, dp: int, cluster: Cluster):
    """Seconds of FSDP2's copies around one all-gather (or one reduce-scatter) of a block holding `param_bytes` of
    unsharded parameters, when `mmplan calibrate` measured none (Cluster.zero_byte_s = 0): the all-gather's copy-in
    of the local shard into the flat buffer (read + write param_bytes / dp) and its copy-out into the unsharded
    parameters (torch.split_with_sizes_copy: read + write param_bytes), or the reduce-scatter's copy-in of the
    gradients (torch._chunk_cat: read + write) and the reduced shard's accumulation (read + write / dp)
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_all_gather / foreach_all_gather_copy_out /
    foreach_reduce), memory-bound at hardware.stream_bandwidth. 0 on CPU ranks (the measured zero_byte_s there)."""
    if cluster.backend != "nccl" or cluster.zero_byte_s > 0:
        return 0.0 * param_bytes
    return 2 * param_bytes * (1 + 1 / dp) / stream_bandwidth(cluster.device)


def pass_times(fwd: Sequence[float], bwd: Sequence[float], gather: Sequence[float], scatter: Sequence[float], *,
               share: float, backward_gather: bool = True, host_s: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of a chunk's blocks with their ZeRO collectives, FSDP2's way (see the top):
    per block its compute `fwd[k]` / `bwd[k]`, its all-gather `gather[k]` (0 without ZeRO-3) and its gradient
    reduce-scatter `scatter[k]` (0 without ZeRO-2/3); `backward_gather`: the backward gathers again
    (reshard_after_forward=True); `host_s`: FSDP2's host work per block with a collective (host_floor)."""
    n = len(fwd)
    if n == 0:
        return 0.0, 0.0
    g = list(gather)
    gb = g if backward_gather else [0.0] * n
    c = [max(x, host_s) if g[k] or scatter[k] else x for k, x in enumerate(fwd)]
    b = [max(x, host_s) if gb[k] or scatter[k] else x for k, x in enumerate(bwd)]
    f_total = g[0] + c[n - 1] + sum(float(overlapped(c[k], g[k + 1], share)) for k in range(n - 1))
    b_total = gb[n - 1] + scatter[0]
    for k in range(n):
        x = (gb[k - 1] if k > 0 else 0.0) + (scatter[k + 1] if k < n - 1 else 0.0)
        b_total += float(overlapped(b[k], x, share))
    return f_total, b_total


def segment_times(fwd: np.ndarray, bwd: np.ndarray, gather: np.ndarray, scatter: np.ndarray, *, share: float,
                  backward_gather: bool = True, host_s: float = 0.0,
                  positions: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """pass_times of every segment [i, j) of a unit's blocks at once, as (n+1, n+1) arrays (entry [i, j]; 0 where
    j <= i): per-block terms of the formulas at the top summed with prefix sums, the edge terms (the first gather,
    the last reduce-scatter, the backward's two end blocks) added per segment. positions: only the segments between
    these block indices, as (K, K) arrays (the solver's cut positions, planner/solver/segments.cut_positions)."""
    n = len(fwd)
    pos = np.arange(n + 1) if positions is None else np.asarray(positions)
    fwd, bwd, g, r = (np.asarray(a, dtype=float) for a in (fwd, bwd, gather, scatter))
    gb = g if backward_gather else np.zeros(n)
    c = np.where((g > 0) | (r > 0), np.maximum(fwd, host_s), fwd)
    b = np.where((gb > 0) | (r > 0), np.maximum(bwd, host_s), bwd)
    zero = np.zeros(1)
    nxt_g, prv_g = np.concatenate((g[1:], zero)), np.concatenate((zero, gb[:-1]))
    nxt_r = np.concatenate((r[1:], zero))
    i = pos[:, None]
    j = pos[None, :]
    valid = j > i
    ii, jl = np.minimum(i, n - 1), np.clip(j - 1, 0, n - 1)  # the segment's first and last block (clamped)

    def span(v: np.ndarray, lo, hi) -> np.ndarray:  # sum of v[lo:hi] (0 where hi <= lo)
        p = np.concatenate(([0.0], np.cumsum(v)))
        return np.where(hi > lo, p[np.clip(hi, 0, n)] - p[np.clip(lo, 0, n)], 0.0)

    # forward: sum c + g_i + sum_{k=i}^{j-2} (overlapped(c_k, g_{k+1}) - c_k)
    ahead = overlapped(c, nxt_g, share) - c
    f = span(c, i, j) + g[ii] + span(ahead, i, j - 1)
    # backward: sum b + g_{j-1} + r_i + the excess of every block over its compute: interior blocks see
    # g_{k-1} + r_{k+1}, the first in backward order (j-1) only g_{j-2}, the last (i) only r_{i+1}, a lone block none
    inner = overlapped(b, prv_g + nxt_r, share) - b
    first = overlapped(b, prv_g, share) - b
    last = overlapped(b, nxt_r, share) - b
    edges = np.where(j - 1 > i, first[jl] + last[ii] + span(inner, i + 1, j - 1), 0.0)
    bw = span(b, i, j) + gb[jl] + r[ii] + edges
    return np.where(valid, f, 0.0), np.where(valid, bw, 0.0)


def gather_exposure(fwd: Sequence[float], gather: Sequence[float], scatter: Sequence[float], *, share: float,
                    host_s: float = 0.0) -> float:
    """Seconds a chunk's forward gains when its blocks all-gather `gather[k]` on the way (pass_times' forward with
    them minus without; `scatter` and `host_s` as pass_times, so both sides see the blocks' host floors alike):
    the first block's gather, what each next gather outlasts of its block's compute, and the SMs NCCL holds."""
    n = len(fwd)
    zeros = [0.0] * n
    with_gathers, _ = pass_times(fwd, zeros, gather, scatter, share=share, host_s=host_s)
    without, _ = pass_times(fwd, zeros, zeros, scatter, share=share, host_s=host_s)
    return with_gathers - without


def segment_gather_exposure(fwd: np.ndarray, gather: np.ndarray, scatter: np.ndarray, *, share: float,
                            host_s: float = 0.0, positions: np.ndarray | None = None) -> np.ndarray:
    """gather_exposure of every segment [i, j) at once (segment_times' forwards with and without the gathers)."""
    fwd = np.asarray(fwd, dtype=float)
    zeros = np.zeros(len(fwd))
    with_gathers, _ = segment_times(fwd, zeros, gather, scatter, share=share, host_s=host_s, positions=positions)
    without, _ = segment_times(fwd, zeros, zeros, scatter, share=share, host_s=host_s, positions=positions)
    return with_gathers - without


def first_forward_gather(per_block, zero: int, dp: int, link: Link, cluster: Cluster, *,
                         reduce_scale: float = 1.0) -> float:
    """Seconds ZeRO-1/2's parameter all-gather adds to a step on a GPU, where FSDP2 runs it: in the chunk's first
    forward of the next step, block by block (see the top), per block (forward, backward, parameter bytes, trained
    parameter bytes) as chunk_passes: gather_exposure of the blocks' trained parameters (the bytes the stage's
    optimizer updates, tail.tail_over's), and FSDP2's copies around each gather (copy_time). 0 for other stages and
    without data parallelism.
    `reduce_scale`: as chunk_passes (ZeRO-2's reduce-scatters set the blocks' host floors)."""
    if zero not in (1, 2) or dp <= 1:
        return 0.0
    gathers = [all_gather_time(tr, dp, link) for _, _, _, tr in per_block]
    scatters = [reduce_scatter_time(tr * reduce_scale, dp, link) if zero == 2 else 0.0 for _, _, _, tr in per_block]
    exposed = gather_exposure([f for f, _, _, _ in per_block], gathers, scatters, share=overlap_share(cluster),
                              host_s=host_floor(cluster))
    return exposed + sum(copy_time(tr, dp, cluster) for _, _, _, tr in per_block)


def chunk_passes(per_block, zero: int, dp: int, reshard_after_forward: bool, link: Link, cluster: Cluster, *,
                 reduce_scale: float = 1.0):
    """A chunk's compute with its ZeRO collectives per block on a GPU (pass_times), per block (forward, backward,
    parameter bytes, trained parameter bytes): (forward, backward) seconds, the (forward, backward) gathers' and the
    reduce-scatters' seconds, and FSDP2's (forward, backward) copies. `reduce_scale`: the reduced gradients' bytes per
    element over the compute dtype's (2: an fp32 reduce-scatter of bf16 gradients, FSDP2's
    MixedPrecisionPolicy(reduce_dtype=torch.float32))."""
    share = zero_divisors(zero, dp)
    again = zero >= 3 and reshard_after_forward  # the backward gathers the parameters again
    gathers = [all_gather_time(p, share.params, link) if zero >= 3 else 0.0 for _, _, p, _ in per_block]
    scatters = [reduce_scatter_time(tr * reduce_scale, share.grads, link) if zero >= 2 else 0.0
                for _, _, _, tr in per_block]
    zf, zb = pass_times([f for f, _, _, _ in per_block], [b for _, b, _, _ in per_block], gathers, scatters,
                        share=overlap_share(cluster), backward_gather=again, host_s=host_floor(cluster))
    copy_in = sum(copy_time(p, dp, cluster) for _, _, p, _ in per_block) if zero >= 3 else 0.0
    copy_out = sum(copy_time(tr * reduce_scale, dp, cluster) for _, _, _, tr in per_block) if zero >= 2 else 0.0
    copies = (copy_in, (copy_in if again else 0.0) + copy_out)
    return zf, zb, (sum(gathers), sum(gathers) if again else 0.0), sum(scatters), copies


__all__ = ["chunk_passes", "copy_time", "first_forward_gather", "gather_exposure", "host_floor", "overlap_share",
           "overlapped", "pass_times", "segment_gather_exposure", "segment_times"]
