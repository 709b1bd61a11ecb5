"""Which rows of a batch tensor belong to which sample: batch-major tensors and packed ones.

Most inputs are batch-major (dim 0 = samples). Some models take *packed* inputs instead: Qwen2-VL's
`pixel_values` are (patches of all images, patch dim), with `image_grid_thw` (one row per image) saying
how the patches divide; their vision blocks' outputs are packed the same way. The rule here is derived
from the data, not from the model's name: in a batch of B samples, B is the smallest leading dimension of
its tensors, and a tensor whose leading dimension is k·B holds k rows per sample, sample i's rows being
[i·k, (i+1)·k). So a batch of n samples is built by concatenating the samples' rows (`collate`), and sample
ranges map to row ranges by multiplying by k. Samples of one key must all have the same number of rows
(images of one size): the runtime's receive buffers are sized from it; `collate` refuses otherwise.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from plans.errors import MmplanError


def batch_samples(batch: Mapping[str, Any]) -> int:
    """The number of samples in `batch`: its tensors' smallest leading dimension."""
    dims = [v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()]
    if not dims:
        raise MmplanError("a batch needs at least one tensor with a batch dimension (dim 0)")
    return min(dims)


def rows_per_sample(batch: Mapping[str, Any]) -> dict[str, int]:
    """Rows per sample of every tensor of `batch` with a leading dimension (1 for a batch-major tensor)."""
    n = batch_samples(batch)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim():
            if v.shape[0] % n:
                raise MmplanError(f"input {k!r} has {v.shape[0]} rows, not a multiple of the batch's {n} samples: "
                                  "cannot tell which rows belong to which sample")
            out[k] = v.shape[0] // n
    return out


def collate(samples: Sequence[Mapping[str, Any]], packed: set[str]) -> dict[str, Any]:
    """One batch from per-sample dicts: a packed key's rows concatenated (each sample (k, ...) with the same k),
    any other key stacked along a new dim 0."""
    if not samples:
        raise MmplanError("a batch needs at least one sample")
    out = {}
    for k in samples[0]:
        values = [torch.as_tensor(s[k]) for s in samples]
        if k in packed:
            if len({v.shape[0] for v in values}) > 1:
                raise MmplanError(f"samples of packed input {k!r} have different row counts "
                                  f"({sorted({v.shape[0] for v in values})}): mmplan needs the same count per sample")
            out[k] = torch.cat(values)
        else:
            out[k] = torch.stack(values)
    return out
