"""The structure of a block's output: what a receiver allocates and a route moves (boundary.py, stage.py)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._pytree import TreeSpec


@dataclass(frozen=True)
class OutputSpec:
    """Structure of a block's output: pytree spec and (per-row shape, dtype) of each tensor leaf; `rows`: each
    leaf's rows per sample (empty: one, batch-major; k for a packed leaf, runtime/samples.py); `scaled`: per leaf,
    None or (input key, num, den) when the leaf's rows per sample are num/den of that packed input's, which may
    differ per sample (Qwen2-VL's vision blocks: images of different sizes; empty: none is), or (probe key, 1, 1)
    when a forward of each sample alone tells them (runtime/sample_probe.py: LLaVA-NeXT's tiles). `fixed`: the output
    does not depend on the batch (it reads no batch input, directly or through other blocks: Whisper's encoder
    position table over `arange(positions)`), so its `rows` are its whole leading sizes, whatever the samples."""

    tree: TreeSpec
    leaves: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    rows: tuple[int, ...] = ()
    fixed: bool = False
    scaled: tuple[tuple[str, int, int] | None, ...] = ()

    def rows_of(self, leaf: int) -> int:
        return self.rows[leaf] if self.rows else 1

    def varies(self, leaf: int) -> bool:
        return bool(self.scaled) and self.scaled[leaf] is not None

    def sample_rows(self, leaf: int, inputs: Mapping[str, Sequence[int]], samples: int) -> tuple[int, ...]:
        """Rows of each of `samples` samples of the leaf, given the batch's per-sample rows of its inputs and probed
        leaves (ForwardProgram.batch_rows)."""
        if not self.varies(leaf):
            return (self.rows_of(leaf),) * samples
        key, num, den = self.scaled[leaf]
        return tuple(r * num // den for r in inputs[key])
