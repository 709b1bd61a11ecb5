"""The cluster a plan is solved for, as data: device spec, links, tiers' capacities (catalog in cost_models/catalog.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from plans.errors import FormatError
from plans.serial import OMIT_DEFAULT

# Compute dtypes a device may list a peak for (plan.json's Training.dtype is one of fp32 | bf16 | fp16).
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
BACKENDS = ("nccl", "gloo")  # torch.distributed backends the runtime knows


def _positive(value: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FormatError(f"{what} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Link:
    """An alpha-beta link: time(bytes) = latency_s + bytes / bandwidth (bytes/s, one direction).

    collective_s: the fixed cost of one collective call beyond its ring's hops (cost_models/comm.py) -- on a CPU
    host gloo hands every call to its worker thread and wakes the peers' threads, measured by `mmplan calibrate`
    at ~1 ms on a 2-core machine against ~0.2 ms for a send; 0 in the GPU catalog (NCCL's launch cost is
    microseconds)."""

    bandwidth: float
    latency_s: float = 0.0
    collective_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})

    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise FormatError(f"link bandwidth must be > 0, got {self.bandwidth}")
        if not (isinstance(self.latency_s, (int, float)) and math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise FormatError(f"link latency must be >= 0, got {self.latency_s}")
        if isinstance(self.collective_s, bool) or not (isinstance(self.collective_s, (int, float))
                                                       and math.isfinite(self.collective_s) and self.collective_s >= 0):
            raise FormatError(f"link collective cost must be >= 0, got {self.collective_s}")

    def time(self, nbytes: float) -> float:
        """Seconds to move nbytes over this link (Hockney's alpha-beta model)."""
        return self.latency_s + nbytes / self.bandwidth


@dataclass(frozen=True, slots=True)
class Device:
    """One accelerator (or one CPU rank on `local-cpu`)."""

    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per dtype ("fp32", "bf16", "fp16"; see DTYPES)
    memory_bytes: int  # device memory per rank (the GPU tier)
    memory_bandwidth: float  # bytes/s
    # Achieved fraction of peak as a function of the work of one kernel launch: (flops, efficiency)
    # points, interpolated in log(flops); calibrated by `mmplan calibrate`.
    efficiency: tuple[tuple[float, float], ...] = ((1e6, 0.05), (1e9, 0.4), (1e12, 0.7))

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FormatError(f"device name must be a non-empty string, got {self.name!r}")
        if not self.peak_flops:
            raise FormatError(f"device {self.name}: peak_flops must list at least one dtype of {', '.join(DTYPES)}")
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPES:
                raise FormatError(f"device {self.name}: unknown dtype {dtype!r} in peak_flops; known: {', '.join(DTYPES)}")
            _positive(flops, f"device {self.name}: peak_flops[{dtype}]")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise FormatError(f"device {self.name}: memory_bytes must be an integer > 0, got {self.memory_bytes!r}")
        _positive(self.memory_bandwidth, f"device {self.name}: memory_bandwidth")
        if not self.efficiency:
            raise FormatError(f"device {self.name}: efficiency needs at least one (flops, efficiency) point")
        previous = 0.0
        for point in self.efficiency:
            if len(point) != 2:
                raise FormatError(f"device {self.name}: efficiency points must be (flops, efficiency) pairs, got {point!r}")
            flops, eff = point
            _positive(flops, f"device {self.name}: efficiency point flops")
            if flops <= previous:
                raise FormatError(f"device {self.name}: efficiency points must have strictly increasing flops, got {flops!r} after {previous!r}")
            if not (isinstance(eff, (int, float)) and 0 < eff <= 1):
                raise FormatError(f"device {self.name}: efficiency must be in (0, 1], got {eff!r} at {flops!r} flops")
            previous = flops


@dataclass(frozen=True, slots=True)
class Cluster:
    """nodes x gpus_per_node identical ranks; per-node host memory and NVMe shared by the node's ranks."""

    name: str
    nodes: int
    gpus_per_node: int
    device: Device
    intra_node: Link  # GPU<->GPU inside a node (NVLink), per direction
    inter_node: Link  # between nodes: one GPU's NIC (InfiniBand per GPU), per direction (comm.collective_link)
    host_to_device: Link  # PCIe host<->device per GPU
    nvme: Link  # NVMe read/write per node
    host_memory_bytes: int  # per node
    nvme_bytes: int  # per node
    backend: str = "nccl"  # torch.distributed backend the runtime uses there ("nccl" | "gloo")
    # The runtime's own costs, measured by `mmplan calibrate` (0: not measured; cost_models/overhead.py applies them):
    # the optimizer step per parameter tensor and per byte of parameters it updates, and the fixed cost of a step
    # (Python, metrics, logging) beyond its forward, backward, communication and optimizer work.
    optimizer_tensor_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    optimizer_byte_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    step_overhead_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    # how much slower compute runs with every local rank busy than in one process alone (>= 1): what a profile
    # measured in one process (`mmplan profile --measure`) is scaled by (1: not measured)
    compute_slowdown: float = field(default=1.0, metadata={OMIT_DEFAULT: True})
    # ZeRO's own costs under the runtime's FSDP2 (runtime/zero.py), beyond its collectives: per sharded block and
    # micro-batch (the pre-forward / post-backward hooks, DTensor views), per byte of a sharded block's parameters
    # and micro-batch (the copy-in / copy-out of the flat all-gather and reduce-scatter buffers), and per sharded
    # parameter tensor in the optimizer step (DTensor dispatch). 0: not measured.
    zero_block_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    zero_byte_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    zero_tensor_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    # The host's cost of running the model op by op (0: not measured): per aten op dispatched in a forward (Python,
    # the dispatcher, recording the autograd graph) and in a backward (the autograd engine), with no arithmetic
    # in it; and per tensor autograd saves, the runtime's memory accounting of it (runtime/activations.py): its
    # saved-tensor hook in the forward, the release of what it held in the backward. Blocks of a model made of
    # small ops are bound by these, not by their FLOPs.
    forward_op_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    backward_op_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    saved_tensor_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    released_tensor_s: float = field(default=0.0, metadata={OMIT_DEFAULT: True})

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise FormatError(f"cluster {self.name}: nodes and gpus_per_node must be >= 1, got {self.nodes} and {self.gpus_per_node}")
        for what in ("host_memory_bytes", "nvme_bytes"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FormatError(f"cluster {self.name}: {what} must be an integer > 0, got {value!r}")
        for what in ("optimizer_tensor_s", "optimizer_byte_s", "step_overhead_s", "zero_block_s", "zero_byte_s",
                     "zero_tensor_s", "forward_op_s", "backward_op_s", "saved_tensor_s",
                     "released_tensor_s"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise FormatError(f"cluster {self.name}: {what} must be a finite number >= 0, got {value!r}")
        if isinstance(self.compute_slowdown, bool) or not isinstance(self.compute_slowdown, (int, float)) \
                or not math.isfinite(self.compute_slowdown) or self.compute_slowdown < 1:
            raise FormatError(f"cluster {self.name}: compute_slowdown must be a finite number >= 1, got {self.compute_slowdown!r}")
        if self.backend not in BACKENDS:
            raise FormatError(f"cluster {self.name}: backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node
