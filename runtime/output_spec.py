"""The structure of a block's output: what a receiver allocates and a route moves (boundary.py, stage.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import TreeSpec


@dataclass(frozen=True)
class OutputSpec:
    """Structure of a block's output: pytree spec and (per-row shape, dtype) of each tensor leaf; `rows`: each
    leaf's rows per sample (empty: one, batch-major; k for a packed leaf, runtime/samples.py). `fixed`: the output
    does not depend on the batch (it reads no batch input, directly or through other blocks: Whisper's encoder
    position table over `arange(positions)`), so its `rows` are its whole leading sizes, whatever the samples."""

    tree: TreeSpec
    leaves: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    rows: tuple[int, ...] = ()
    fixed: bool = False

    def rows_of(self, leaf: int) -> int:
        return self.rows[leaf] if self.rows else 1
