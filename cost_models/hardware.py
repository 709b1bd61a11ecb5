"""Device performance: the GEMM efficiency curve, memory-bound streaming, fused attention, SMs and peaks."""
from __future__ import annotations

import bisect
import math

from plans.cluster import Device
from plans.errors import MmplanError

# Memory-bound kernels (norms, softmax, elementwise, copies) stream at a fraction of the datasheet HBM bandwidth:
# BabelStream's Triad (Deakin et al. 2018, "Evaluating attainable memory bandwidth of parallel programming models
# via BabelStream"; published runs: A100-SXM4-40GB ~1.4 TB/s of 1.555, H100 SXM ~3.0 TB/s of 3.35) reaches ~90 %.
_GPU_STREAM_FRACTION = 0.90
# Fused attention (flash attention) as its own kernel, fraction of the dense bf16 peak over forward + backward:
# FlashAttention-2 reaches 50-73 % of peak on A100 (Dao 2023, abstract and Figure 4: ~60 % fwd+bwd at head dim
# 128); on H100 FlashAttention-2 reaches ~35 % and FlashAttention-3 / cuDNN 60-75 % (Shah et al. 2024, Figures
# 1-3); we take the middle, 0.5, for Hopper. Used only for the FLOPs the profile attributes to fused attention.
_GPU_ATTENTION_FRACTION = {"a100": 0.60, "hopper": 0.50}
# PyTorch's own SDPA kernel (F.scaled_dot_product_attention's flash backend, what eager PyTorch runs: torchtitan without
# TransformerEngine) is FlashAttention-2 (aten/src/ATen/native/transformers/cuda/flash_attn/, vendored from
# Dao-AILab/flash-attention 2.x), which uses no Hopper-specific instructions: "FlashAttention-2 achiev[es] only 35%
# utilization on the H100 GPU" (Shah et al. 2024, FlashAttention-3, abstract). On A100 it is the 0.60 above.
_SDPA_ATTENTION_FRACTION = {"a100": 0.60, "hopper": 0.35}


def efficiency(device: Device, flops: float) -> float:
    """Achieved fraction of peak for a kernel of `flops` FLOPs: the device's points interpolated linearly in
    log(flops), clamped to the first / last point outside their range."""
    points = device.efficiency
    if not flops > points[0][0]:  # also catches NaN and 0
        return points[0][1]
    if flops >= points[-1][0]:
        return points[-1][1]
    i = bisect.bisect_right([f for f, _ in points], flops)  # points[i-1].flops <= flops < points[i].flops
    (f0, e0), (f1, e1) = points[i - 1], points[i]
    t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
    return e0 + t * (e1 - e0)


def _family(device: Device) -> str | None:
    """The catalog family a device belongs to by name ("a100", "hopper"), None for others (CPUs, custom)."""
    name = device.name.lower()
    if "a100" in name:
        return "a100"
    if "h100" in name or "h200" in name or "hopper" in name:
        return "hopper"
    return None


def stream_bandwidth(device: Device) -> float:
    """Bytes/s a memory-bound kernel achieves: the datasheet bandwidth x BabelStream's attainable fraction on GPUs
    of the catalog; a device described otherwise (local-cpu, `mmplan calibrate`) gives its measured figure."""
    return device.memory_bandwidth * (_GPU_STREAM_FRACTION if _family(device) else 1.0)


# Streaming multiprocessors per GPU (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020: 108 SMs on A100;
# NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022: 132 SMs on H100 SXM5; H200 is the same GH100 part).
_SM_COUNT = {"a100": 108, "hopper": 132}


def sm_count(device: Device) -> int | None:
    """Streaming multiprocessors of a catalog GPU (_SM_COUNT); None for other devices (CPUs, custom)."""
    family = _family(device)
    return _SM_COUNT[family] if family else None


def attention_efficiency(device: Device, flops: float, kernel: str = "fused") -> float:
    """Fraction of peak a fused attention kernel achieves: "fused", the framework's own (TransformerEngine / cuDNN /
    FlashAttention-3 class, _GPU_ATTENTION_FRACTION), or "sdpa", PyTorch's SDPA flash backend (FlashAttention-2,
    _SDPA_ATTENTION_FRACTION); on other devices the GEMM curve (a CPU runs attention as its own matmuls)."""
    family = _family(device)
    if not family:
        return efficiency(device, flops)
    return (_SDPA_ATTENTION_FRACTION if kernel == "sdpa" else _GPU_ATTENTION_FRACTION)[family]


def peak_flops(device: Device, dtype: str) -> float:
    """The device's dense peak FLOP/s for a compute dtype, or a clear error when it has none."""
    try:
        return device.peak_flops[dtype]
    except KeyError:
        raise MmplanError(f"device {device.name} has no peak FLOP/s for dtype {dtype}; it lists "
                          f"{', '.join(device.peak_flops)}") from None
