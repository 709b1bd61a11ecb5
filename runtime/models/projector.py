"""Encoder-to-LLM projector: Linear-GELU-Linear, optionally merging consecutive tokens first."""

from __future__ import annotations

import torch
from torch import nn


class Projector(nn.Module):
    """Maps encoder tokens (B, N, enc_dim) to LLM tokens (B, N / merge, out_dim).

    With merge > 1, each group of `merge` consecutive tokens is concatenated into one (B, N / merge,
    merge * enc_dim) before fc1, as Qwen2-VL's merger does for 2x2 patches (its vision encoder orders
    the patches so that each 2x2 window is consecutive).

    Tensor parallelism (runtime/tensor_parallel.py): the projector is one region, fc1 column-parallel, fc2
    row-parallel, as a transformer layer's MLP (plans/capabilities.py TP_REGIONS).
    """

    supports_tensor_parallel = True

    def __init__(self, in_dim: int, out_dim: int, *, hidden: int | None = None, merge: int = 1) -> None:
        super().__init__()
        self.merge = merge
        self.fc1 = nn.Linear(merge * in_dim, hidden or out_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden or out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        x = x.reshape(B, N // self.merge, self.merge * D)  # (B, N / merge, merge * D)
        return self.fc2(self.act(self.fc1(x)))
