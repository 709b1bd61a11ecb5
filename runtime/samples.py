"""Which rows of a batch tensor belong to which sample: batch-major tensors and packed ones.

Most inputs are batch-major (dim 0 = samples). Some models take *packed* inputs instead: Qwen2-VL's
`pixel_values` are (patches of all images, patch dim), with `image_grid_thw` (one row per image) saying
how the patches divide; their vision blocks' outputs are packed the same way. The rule here is derived
from the data, not from the model's name: in a batch of B samples, B is the smallest leading dimension of
its tensors, and
- a tensor of B rows is batch-major (one row per sample);
- a *grid* (an integer (B·c, 3) tensor of (t, h, w) per image, c images per sample: Qwen2-VL's
  `image_grid_thw` / `video_grid_thw`) gives a tensor whose rows are the sum of the grid's t·h·w the rows of
  its images: sample i's rows are the t·h·w of its c images — images of different sizes per sample;
- any other tensor of k·B rows holds k rows per sample.
So a batch of n samples is built by concatenating the samples' rows (`collate`), and sample ranges map to
row ranges through the per-sample counts (`sample_rows`, `row_range`). A block output's rows per sample are
found from the data flow the same way (runtime/forward_program.py: a fixed multiple of a packed input's).
Not derived: a different number of images per sample (the grid alone cannot tell whose images are whose).
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


def _grid_rows(batch: Mapping[str, Any], n: int) -> list[tuple[int, ...]]:
    """Per-sample t·h·w sums of every grid of the batch (see the module docstring)."""
    out = []
    for v in batch.values():
        if (isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == 3 and not v.is_floating_point()
                and v.shape[0] % n == 0 and v.device.type != "meta" and not _is_fake(v)):
            per_image = v.long().prod(dim=1).view(n, -1).sum(dim=1)
            out.append(tuple(int(x) for x in per_image))
    return out


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def sample_rows(batch: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Rows of each sample of every tensor of `batch` with a leading dimension (see the module docstring)."""
    n = batch_samples(batch)
    grids = _grid_rows(batch, n)
    out = {}
    for k, v in batch.items():
        if not (isinstance(v, torch.Tensor) and v.dim()):
            continue
        rows = v.shape[0]
        if rows == n:
            out[k] = (1,) * n
            continue
        grid = next((g for g in grids if sum(g) == rows), None)
        if grid is not None:
            out[k] = grid
        elif rows % n == 0:
            out[k] = (rows // n,) * n
        else:
            raise MmplanError(f"input {k!r} has {rows} rows, not a multiple of the batch's {n} samples nor the t·h·w "
                              "of an image grid: cannot tell which rows belong to which sample")
    return out


def rows_per_sample(batch: Mapping[str, Any]) -> dict[str, int]:
    """Rows of the batch's first sample of every tensor with a leading dimension (1 for a batch-major tensor)."""
    return {k: rows[0] for k, rows in sample_rows(batch).items()}


def packed_keys(batch: Mapping[str, Any]) -> set[str]:
    """The keys whose samples have other than one row each."""
    return {k for k, rows in sample_rows(batch).items() if any(r != 1 for r in rows)}


def row_range(rows: Sequence[int], start: int, stop: int) -> tuple[int, int]:
    """The rows of samples [start, stop) of a tensor whose samples have `rows` rows each."""
    first = sum(rows[:start])
    return first, first + sum(rows[start:stop])


def split_samples(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The batch's samples, each a dict of its rows (a batch-major key keeps its dim 0 of one row); non-tensor
    entries as they are."""
    rows = sample_rows(batch)
    out = []
    for i in range(batch_samples(batch)):
        sample = {}
        for k, v in batch.items():
            if k in rows:
                a, b = row_range(rows[k], i, i + 1)
                sample[k] = v[a:b]
            else:
                sample[k] = v
        out.append(sample)
    return out


def collate(samples: Sequence[Mapping[str, Any]], packed: set[str]) -> dict[str, Any]:
    """One batch from per-sample dicts: a packed key's rows concatenated (each sample (k_i, ...); samples may have
    different k_i, e.g. images of different sizes, as long as the batch tells them apart: `sample_rows`), any
    other key stacked along a new dim 0."""
    if not samples:
        raise MmplanError("a batch needs at least one sample")
    out = {}
    for k in samples[0]:
        values = [torch.as_tensor(s[k]) for s in samples]
        out[k] = torch.cat(values) if k in packed else torch.stack(values)
    if any(len(rows) != len(samples) for rows in sample_rows(out).values()):  # or refuses rows it cannot tell apart
        raise MmplanError(f"samples of packed input(s) {sorted(packed)} have different row counts and the batch has no "
                          "image grid saying whose rows are whose (runtime/samples.py)")
    return out
