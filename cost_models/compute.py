"""Time of a block's forward and backward for a micro-batch and tp degree, and of the optimizer step."""
from __future__ import annotations

import re

from dataclasses import dataclass

from cost_models.comm import all_reduce_time
from cost_models.hardware import efficiency, peak_flops
from cost_models.memory import DTYPE_BYTES, StateTiers, optimizer_bytes_per_param
from cost_models.offload import transfer_time
from plans.cluster import Cluster, Link
from plans.graph import Block, Profile


@dataclass(frozen=True, slots=True)
class OpTime:
    """One micro-batch through some blocks on one rank, in seconds: compute, and the blocking TP collectives."""

    fwd: float = 0.0
    fwd_comm: float = 0.0
    bwd: float = 0.0  # includes the recomputed forward of recompute blocks
    bwd_comm: float = 0.0

    def __add__(self, other: "OpTime") -> "OpTime":
        return OpTime(self.fwd + other.fwd, self.fwd_comm + other.fwd_comm, self.bwd + other.bwd, self.bwd_comm + other.bwd_comm)


def measured_on(profile: Profile, cluster: Cluster) -> bool:
    """Whether the profile's fwd_ms / bwd_ms were measured on the cluster's device.

    Names are compared by their model token: the profiler records "cpu" or CUDA's device name (e.g.
    "NVIDIA H100 80GB HBM3"), the catalog says "local-cpu" or "h100-sxm".
    """
    if profile.measured_on is None:
        return False
    measured, device = profile.measured_on.lower(), cluster.device.name.lower()
    if measured == device:
        return True
    token = re.match(r"[a-z0-9]*", device.removeprefix("local-")).group()  # "h100", "cpu", "a100"
    return bool(token) and token in re.findall(r"[a-z0-9]+", measured)


def measured_ms(ms: float, per_sample: float | None, samples: float, measured_micro_batch: int) -> float:
    """Measured time at `samples`: affine in the batch when the profile measured a slope (two batch sizes),
    else proportional to it. Never below a tenth of the measured time (noise can make a slope negative)."""
    if per_sample is None:
        return ms * samples / measured_micro_batch
    return max(ms + per_sample * (samples - measured_micro_batch), 0.1 * ms * min(1.0, samples / measured_micro_batch))


def block_time(
    block: Block,
    samples: float,
    tp: int,
    cluster: Cluster,
    *,
    dtype: str = "bf16",
    measured_micro_batch: int | None = None,
    recompute: bool = False,
    tp_link: Link | None = None,
) -> OpTime:
    """Forward and backward of `block` for `samples` samples on one of its `tp` shards.

    Compute: with `measured_micro_batch` (the profile's micro-batch, when it was measured on this
    device) the measured fwd_ms / bwd_ms at `samples` (measured_ms: affine in the batch); else
    FLOPs x samples / tp / (peak[dtype] x efficiency(FLOPs of the shard)). tp divides only blocks that
    support it; both paths assume compute splits evenly over the tp shards.
    TP communication: Megatron's f/g operators all-reduce the layer's output twice in the forward and
    twice in the backward (Narayanan et al. 2021, section 3.1; Shoeybi et al. 2019, Figure 3), over the TP
    link (inside a node). Recompute runs the forward again before the backward (Chen et al. 2016),
    its all-reduces included.
    """
    t = tp if block.supports_tp else 1
    if measured_micro_batch is not None and block.fwd_ms is not None and block.bwd_ms is not None:
        fwd = measured_ms(block.fwd_ms, block.fwd_ms_per_sample, samples, measured_micro_batch) / t / 1e3
        bwd = measured_ms(block.bwd_ms, block.bwd_ms_per_sample, samples, measured_micro_batch) / t / 1e3
    else:
        peak = peak_flops(cluster.device, dtype)
        f, b = block.fwd_flops * samples / t, block.bwd_flops * samples / t  # FLOPs of this shard
        fwd = f / (peak * efficiency(cluster.device, f)) if f > 0 else 0.0
        bwd = b / (peak * efficiency(cluster.device, b)) if b > 0 else 0.0
    comm = 0.0
    if t > 1:
        comm = 2 * all_reduce_time(block.output_bytes * samples, t, tp_link or cluster.intra_node)
    if recompute:
        return OpTime(fwd=fwd, fwd_comm=comm, bwd=bwd + fwd, bwd_comm=2 * comm)
    return OpTime(fwd=fwd, fwd_comm=comm, bwd=bwd, bwd_comm=comm)


def optimizer_step_time(params: float, memory: StateTiers, cluster: Cluster, *, dtype: str = "bf16", optimizer: str = "adam") -> float:
    """Seconds of the optimizer step on one rank updating `params` parameters (its ZeRO shard).

    The update is elementwise and memory-bound: it reads and writes the optimizer state (K bytes per
    parameter, ZeRO section 3.1), reads the gradient and writes the parameter, once each, at the memory
    bandwidth of the tier holding the optimizer state. On cpu (ZeRO-Offload, Ren et al. 2021) the
    gradients go down and the parameters come back over PCIe when they live on the GPU; the Cluster has
    no host-DRAM bandwidth, so the CPU update is timed at the host<->device bandwidth (a conservative
    proxy: DDR per GPU is of the same order). On nvme the optimizer state is also read and written back
    through the node's NVMe (ZeRO-Infinity).
    """
    width = DTYPE_BYTES[dtype]
    state = optimizer_bytes_per_param(dtype, optimizer) * params  # bytes
    touched = 2 * state + 2 * width * params
    if memory.optimizer == "gpu":
        return touched / cluster.device.memory_bandwidth
    t = touched / cluster.host_to_device.bandwidth
    if memory.grads == "gpu":
        t += transfer_time(width * params, "cpu", cluster)
    if memory.params == "gpu":
        t += transfer_time(width * params, "cpu", cluster)
    if memory.optimizer == "nvme":
        t += transfer_time(2 * state, "nvme", cluster)
    return t
