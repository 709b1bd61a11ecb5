"""The runtime's own costs that `mmplan calibrate` measures (Cluster.optimizer_tensor_s, optimizer_byte_s,
step_overhead_s, zero_block_s, zero_byte_s, zero_tensor_s, forward_op_s, backward_op_s, saved_tensor_s,
released_tensor_s), applied to the simulated step here and nowhere else: the optimizer step's update, the fixed
per-step cost of the runtime (Python, metrics, logging), what ZeRO's FSDP2 costs beyond its collectives, and the
host's work of running a block op by op. Clusters without them (0) are timed as before."""
from __future__ import annotations

from cost_models.memory import DTYPE_BYTES, StateTiers
from cost_models.offload import optimizer_step_time
from plans.cluster import Cluster
from plans.graph import Block


def calibrated(cluster: Cluster) -> bool:
    """Whether the cluster carries measured optimizer costs."""
    return cluster.optimizer_byte_s > 0 or cluster.optimizer_tensor_s > 0


def optimizer_time(params: float, memory: StateTiers, cluster: Cluster, *, dtype: str = "bf16",
                   optimizer: str = "adam", tensors: float = 0.0) -> float:
    """Seconds of one rank's optimizer step over `params` parameters in `tensors` tensors.

    Without measured costs: the memory-bandwidth model (offload.optimizer_step_time). With them, the measured
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


def host_time(block: Block, cluster: Cluster, *, measured: bool) -> tuple[float, float]:
    """(forward, backward) seconds the host spends running `block` op by op, beyond its arithmetic: each aten op's
    dispatch (Python, the dispatcher, the autograd graph: Cluster.forward_op_s; the autograd engine's per op in the
    backward: backward_op_s) and the runtime's accounting of each tensor the forward saves (its saved-tensor hook,
    saved_tensor_s; the release of what it held, in the backward, released_tensor_s). The counts are per call,
    whatever the batch and tp degree (every tp rank dispatches every op). A `measured` block time (`profile
    --measure`) already holds its ops' dispatch, so only the accounting, which the profiler does not run, is added
    to it. Profiles without the counts, and clusters without the costs, get 0."""
    hook, release = block.saved_tensors * cluster.saved_tensor_s, block.saved_tensors * cluster.released_tensor_s
    if measured:
        return hook, release
    return block.fwd_ops * cluster.forward_op_s + hook, block.bwd_ops * cluster.backward_op_s + release


def with_host(device_s: float, host_s: float, cluster: Cluster) -> float:
    """A block's time given its device work and its host work: on a CPU (gloo ranks) one core does both, one after
    the other; a GPU runs the kernels while the host issues the next ones, so the slower of the two bounds it."""
    return device_s + host_s if cluster.backend == "gloo" else max(device_s, host_s)


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


__all__ = ["calibrated", "host_time", "measured_compute_scale", "optimizer_tensor_time", "optimizer_time", "step_overhead",
           "with_host", "zero_block_time", "zero_optimizer_time"]
