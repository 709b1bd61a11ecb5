"""The runtime's own costs that `mmplan calibrate` measures (Cluster.optimizer_tensor_s, optimizer_byte_s,
step_overhead_s, zero_block_s, zero_byte_s, zero_tensor_s), applied to the simulated step here and nowhere else: the optimizer
step's update, the fixed per-step cost of the runtime (Python, metrics, logging) and what ZeRO's FSDP2 costs beyond
its collectives. Clusters without them (0) are timed as before."""
from __future__ import annotations

from cost_models.compute import optimizer_step_time
from cost_models.memory import DTYPE_BYTES, StateTiers
from plans.cluster import Cluster


def calibrated(cluster: Cluster) -> bool:
    """Whether the cluster carries measured optimizer costs."""
    return cluster.optimizer_byte_s > 0 or cluster.optimizer_tensor_s > 0


def optimizer_time(params: float, memory: StateTiers, cluster: Cluster, *, dtype: str = "bf16",
                   optimizer: str = "adam", tensors: float = 0.0) -> float:
    """Seconds of one rank's optimizer step over `params` parameters in `tensors` tensors.

    Without measured costs: the memory-bandwidth model (compute.optimizer_step_time). With them, the measured
    update (tensors x per-tensor + parameter bytes x per-byte: torch's Adam makes several elementwise passes over
    every state tensor, so a CPU rank updates ~10x slower than one pass at the memory bandwidth) replaces the
    modelled one when the state is in the device tier; in the cpu/nvme tiers the slower of the two is taken (the
    transfers there are modelled, the update measured)."""
    modelled = optimizer_step_time(params, memory, cluster, dtype=dtype, optimizer=optimizer)
    if not calibrated(cluster):
        return modelled
    measured = params * DTYPE_BYTES[dtype] * cluster.optimizer_byte_s + tensors * cluster.optimizer_tensor_s
    return measured if memory.optimizer == "gpu" else max(modelled, measured)


def optimizer_tensor_time(memory: StateTiers, cluster: Cluster) -> float:
    """The per-tensor part of optimizer_time where it is additive (measured costs, state in the device tier):
    optimizer_time(p, tensors=T) == optimizer_time(p) + T * this there; 0 elsewhere (the max of the cpu/nvme
    tiers: a lower estimate, for callers that sum tensors separately -- the solver's segments)."""
    return cluster.optimizer_tensor_s if calibrated(cluster) and memory.optimizer == "gpu" else 0.0


def measured_compute_scale(cluster: Cluster) -> float:
    """What block times measured in one process (`mmplan profile --measure`) are multiplied by when every rank of the
    cluster computes at once (Cluster.compute_slowdown: the ranks share caches, memory bandwidth and, on a loaded
    machine, the cores)."""
    return cluster.compute_slowdown


def zero_block_time(blocks, zero: int, cluster: Cluster, param_bytes=0.0):
    """Seconds per micro-batch (forward + backward) that ZeRO's FSDP2 costs a rank beyond its collectives for
    `blocks` sharded blocks holding `param_bytes` of (tp-local, unsharded) parameters (runtime/zero.py: one
    fully_shard unit per block with parameters): the hooks and DTensor views per block (Cluster.zero_block_s), the
    copy-in / copy-out of the flat all-gather and reduce-scatter buffers per byte (Cluster.zero_byte_s). Works on
    numpy arrays of blocks and bytes too (the solver's segments)."""
    return blocks * cluster.zero_block_s + param_bytes * cluster.zero_byte_s if zero else 0.0


def zero_optimizer_time(tensors: float, zero: int, cluster: Cluster) -> float:
    """What the optimizer step costs a rank beyond optimizer_time when its `tensors` parameter tensors are ZeRO
    shards (DTensors: each elementwise op is dispatched through DTensor; Cluster.zero_tensor_s)."""
    return tensors * cluster.zero_tensor_s if zero else 0.0


def step_overhead(cluster: Cluster) -> float:
    """The runtime's fixed seconds per step beyond forward, backward, communication and optimizer work."""
    return cluster.step_overhead_s


__all__ = ["calibrated", "measured_compute_scale", "optimizer_tensor_time", "optimizer_time", "step_overhead", "zero_block_time",
           "zero_optimizer_time"]
