"""GPU memory a rank uses beyond its tensors: cuBLAS workspaces, NCCL buffers, the CUDA context and the caching
allocator's fragmentation -- each from a cited figure, on GPU (nccl) clusters only; CPU ranks have none of them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plans.cluster import Cluster
from plans.errors import MmplanError

MiB = 2**20

# PyTorch's cuBLAS workspace per (handle, stream): CUBLAS_WORKSPACE_CONFIG's default ":4096:2:16:8" (2 x 4096 KiB +
# 8 x 16 KiB = 8,519,680 bytes), 32 MiB (":4096:8") on Hopper (aten/src/ATen/cuda/CublasHandlePool.cpp,
# parseChosenWorkspaceSize; the CUBLAS_WORKSPACE_CONFIG variable is documented in PyTorch's "Reproducibility" notes).
# It is allocated through the caching allocator, so torch.cuda.max_memory_allocated counts it.
CUBLAS_WORKSPACE = {"hopper": 32 * MiB, "other": 4096 * 1024 * 2 + 16 * 1024 * 8}
# Two handles in training: the forward's thread and the autograd engine's device thread each get their own handle
# (handles are per thread, CublasHandlePool.cpp's per-thread pool), so each its own workspace.
CUBLAS_HANDLES = 2
# NCCL_BUFFSIZE: "the size of the buffer used by NCCL when communicating data between pairs of GPUs", default
# 4194304 (4 MiB) (NCCL documentation, Environment Variables, NCCL_BUFFSIZE): one buffer per channel and connection,
# a ring channel having two (its previous and its next rank; the LL / LL128 protocols' smaller buffers are left out).
NCCL_BUFFSIZE = 4 * MiB
NCCL_RING_PEERS = 2
# Channels of a collective communicator: 24 (one thread block each) measured for an NCCL all-gather on an H100
# (NVIDIA developer forums thread 337991, "the concurrent ncclAllGather kernel launches 24 blocks"; the figure
# cost_models/fsdp.py's SM share uses too). Point-to-point (pipeline) communicators: NCCL_NCHANNELS_PER_NET_PEER's
# default 2 channels per peer (NCCL documentation, Environment Variables).
NCCL_CHANNELS = 24
NCCL_P2P_CHANNELS = 2
# The CUDA context of one process: 723 MiB after the first CUDA tensor (PyTorch forums, "What is the reason for
# pytorch's GPU memory 'floor'?", discuss.pytorch.org/t/73021: "goes from zero to 723 MiB"; ~700-800 MB in
# discuss.pytorch.org/t/81330). Lazy module loading (CUDA >= 11.7) makes it smaller; this is the published figure.
CUDA_CONTEXT = 723 * MiB
# Fragmentation of PyTorch's caching allocator: 15 % of reserved memory on average over eight LLMs on A100-80GB
# (GMLake, Guo et al., ASPLOS 2024, abstract: "reduce an average of 9.2 GB (up to 25 GB) GPU memory usage and 15 %
# (up to 33 %) fragmentation"), i.e. reserved = allocated / (1 - 0.15).
FRAGMENTATION = 0.15

Seen = Literal["allocated", "reserved", "device"]  # what a measurement counts (see GpuOverhead.seen_by)


@dataclass(frozen=True, slots=True)
class GpuOverhead:
    """Bytes one GPU rank holds beyond its tensors (0 on CPU ranks), by what counts them."""

    cublas: float = 0.0  # cuBLAS workspaces (through the caching allocator)
    nccl: float = 0.0  # NCCL communicator buffers (cudaMalloc'd by NCCL, outside the allocator)
    context: float = 0.0  # the CUDA context (outside the allocator)
    fragmentation: float = 0.0  # share of reserved memory the caching allocator leaves unusable

    def seen_by(self, tensors: float, seen: Seen = "device") -> float:
        """GPU bytes a measurement of a rank holding `tensors` bytes of tensors reports: "allocated"
        (torch.cuda.max_memory_allocated: tensors and cuBLAS workspaces), "reserved" (max_memory_reserved: that over
        (1 - fragmentation)), "device" (what nvidia-smi shows and what must fit: reserved + NCCL + CUDA context)."""
        if seen not in ("allocated", "reserved", "device"):
            raise MmplanError(f"seen must be allocated, reserved or device, got {seen!r}")
        allocated = tensors + self.cublas
        if seen == "allocated":
            return allocated
        reserved = allocated / (1 - self.fragmentation)
        return reserved if seen == "reserved" else reserved + self.nccl + self.context


def nccl_buffer_bytes(*, tp: int, dp: int, pp: int, cp: int = 1) -> float:
    """NCCL's buffers on one rank: a collective communicator for each of its tp, dp and cp groups of more than one
    rank (channels x ring peers x NCCL_BUFFSIZE) and, with pp > 1, the pipeline's point-to-point one (its p2p
    channels x its two neighbours x NCCL_BUFFSIZE)."""
    collective = sum(n > 1 for n in (tp, dp, cp)) * NCCL_CHANNELS * NCCL_RING_PEERS * NCCL_BUFFSIZE
    return collective + (NCCL_P2P_CHANNELS * NCCL_RING_PEERS * NCCL_BUFFSIZE if pp > 1 else 0)


def gpu_overhead(cluster: Cluster, *, tp: int, dp: int, pp: int, cp: int = 1) -> GpuOverhead:
    """One rank's GpuOverhead on `cluster` for a layout of tp x dp x pp (x cp): the terms above on a GPU (nccl)
    cluster; none on CPU ranks (gloo: the runtime's measured accounting is exact there, tests/cost_models)."""
    if cluster.backend != "nccl":
        return GpuOverhead()
    hopper = any(k in cluster.device.name.lower() for k in ("h100", "h200", "h800", "gh200"))
    return GpuOverhead(cublas=CUBLAS_HANDLES * CUBLAS_WORKSPACE["hopper" if hopper else "other"],
                       nccl=nccl_buffer_bytes(tp=tp, dp=dp, pp=pp, cp=cp), context=CUDA_CONTEXT,
                       fragmentation=FRAGMENTATION)


__all__ = ["GpuOverhead", "Seen", "gpu_overhead", "nccl_buffer_bytes"]
