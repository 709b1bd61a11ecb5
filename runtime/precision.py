"""The plan's training precision in the runtime: the model's parameters, activations and gradients in the plan's
dtype (Training.dtype), the optimizer on fp32 master copies of low-precision parameters (param_tiers.TieredAdam).

This is the mixed precision the cost model counts (cost_models/memory.py, Rajbhandari et al. 2020, section 3.1):
2 B of bf16 parameters and 2 B of bf16 gradients per parameter, 12 B of optimizer state (fp32 master, momentum,
variance); activations and the tensors pipeline stages exchange in bf16. Gradients accumulate over micro-batches
and are all-reduced in bf16 (as the cost model prices them: 2 B per element). fp16 is not run: it needs loss
scaling, which the runtime does not implement.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from plans.errors import MmplanError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype the runtime trains a plan of `dtype` ("fp32" / "bf16") in."""
    if dtype not in DTYPES:
        raise MmplanError(f"the runtime trains fp32 and bf16 plans, not {dtype!r} (fp16 needs loss scaling, which it does "
                          f"not implement): profile and solve with --dtype bf16 or fp32")
    return DTYPES[dtype]


def to_precision(model: nn.Module, example: Mapping[str, Any], dtype: str) -> tuple[nn.Module, dict[str, Any]]:
    """The model's floating-point parameters and buffers, and the example's floating-point inputs, in `dtype`."""
    target = torch_dtype(dtype)
    model.to(target)  # also a factory's own dtype (a Hugging Face config's torch_dtype) to the plan's
    return model, cast_inputs(example, target)


def cast_inputs(batch: Mapping[str, Any], target: torch.dtype) -> dict[str, Any]:
    """Floating-point tensors of a batch in `target` (token ids and other integer inputs as they are)."""
    return {k: v.to(target) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != target else v
            for k, v in batch.items()}


def low_precision(t: torch.Tensor) -> bool:
    """Whether a parameter is trained with an fp32 master copy (its own dtype narrower than fp32)."""
    return t.is_floating_point() and t.element_size() < 4
