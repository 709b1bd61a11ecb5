"""Time to move bytes between the GPU and the cpu / nvme tiers, what of it hides behind compute, the optimizer step there."""
from __future__ import annotations

from typing import NamedTuple

from cost_models.memory import DTYPE_BYTES, StateTiers, optimizer_bytes_per_param, zero_divisors
from plans.cluster import Cluster


def transfer_time(nbytes: float, tier: str, cluster: Cluster, *, copies: float = 1) -> float:
    """Seconds for one rank to move `nbytes` between its GPU and `tier` ("gpu" | "cpu" | "nvme") in `copies`
    separate copies (the runtime moves tensor by tensor: runtime/param_tiers.py one copy per parameter tensor,
    runtime/activations.py one per saved storage, and one file per storage on NVMe).

    cpu: the rank's host<->device link (PCIe), alpha per copy + bytes / bandwidth. nvme: the data crosses PCIe
    and the node's NVMe, which all gpus_per_node ranks of the node stream to at once, so the rank gets
    nvme.bandwidth / gpus_per_node (ZeRO-Infinity's bandwidth-centric partitioning, Rajbhandari et al.
    2021, section 6.1); the slower of the two bounds it, the higher latency is paid per copy.
    """
    if nbytes <= 0 or tier == "gpu":
        return 0.0
    pcie, calls = cluster.host_to_device, max(1.0, copies)
    if tier == "cpu":
        return calls * pcie.latency_s + nbytes / pcie.bandwidth
    if tier == "nvme":
        nvme_share = cluster.nvme.bandwidth / cluster.gpus_per_node
        return calls * max(pcie.latency_s, cluster.nvme.latency_s) + nbytes / min(pcie.bandwidth, nvme_share)
    raise ValueError(f"unknown tier {tier!r}; expected 'gpu', 'cpu' or 'nvme'")


def overlaps_compute(cluster: Cluster) -> bool:
    """Whether asynchronous transfers and collectives run beside compute on the cluster's ranks.

    On GPUs (nccl) they do: NCCL kernels and copy engines work next to the compute stream. On CPU ranks (gloo)
    they take the cores the compute uses, so nothing hides -- measured on the 2-core reference machine:
    ZeRO-3's prefetched gathers made tiny-vlm dp2 slower than ZeRO-0 (0.36 vs 0.22 s per step), prefetch on a
    side thread was slower than none (0.183 vs 0.141 s), and the bucketed gradient all-reduce's overlap was
    within the noise (session notes of issues 11 and 13)."""
    return cluster.backend == "nccl"


def exposed(transfer_s: float, overlappable_s: float) -> float:
    """The part of an asynchronous transfer that does not hide behind concurrent compute: max(0, t - c).

    With prefetch on a side stream (ZeRO-Offload, Ren et al. 2021 section 4.2; the compute-storage
    co-optimisation seed paper's asynchronous transfer), a transfer overlapping `overlappable_s` seconds
    of compute only extends the step by what is left over.
    """
    return max(0.0, transfer_s - overlappable_s)


class Streaming(NamedTuple):
    """Seconds per operation a stage spends moving its model states between tiers."""

    params_in: float  # before every forward and every backward
    grads_out: float  # after every backward


def state_streaming(param_bytes: float, *, dp: int, zero: int, memory: StateTiers, cluster: Cluster,
                    tensors: float = 1, trained_tensors: float | None = None) -> Streaming:
    """Streaming of a stage holding `param_bytes` of parameters per rank in `tensors` tensors (`trained_tensors`
    of them with gradients; default: all): parameters living off the GPU are streamed in, their ZeRO share,
    before every forward and backward, one copy per tensor; gradients living off the GPU are streamed out, their
    ZeRO share, after every backward, one copy per trained tensor (ZeRO-Infinity, Rajbhandari et al. 2021,
    sections 5-6; zero_divisors). 0 for a state on the GPU."""
    share = zero_divisors(zero, dp)
    grads = tensors if trained_tensors is None else trained_tensors
    return Streaming(transfer_time(param_bytes / share.params, memory.params, cluster, copies=tensors),
                     transfer_time(param_bytes / share.grads, memory.grads, cluster, copies=grads))


def offload_accounting(storages: float, cluster: Cluster) -> float:
    """The host's extra work, per micro-batch, for `storages` activation storages offloaded and brought back,
    beyond the saved-tensor hook every storage pays (overhead.host_time): the copy brought back for the
    backward is accounted in the device tier and released once more (runtime/activations.py _Copy), the work
    Cluster.saved_tensor_s and released_tensor_s measure per storage (planner/profiler/host_probe.py)."""
    return storages * (cluster.saved_tensor_s + cluster.released_tensor_s)


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
