"""Which rows of a batch tensor belong to which sample: batch-major tensors and packed ones.

Most inputs are batch-major (dim 0 = samples). Some models take *packed* inputs instead: Qwen2-VL's
`pixel_values` are (patches of all images, patch dim), with `image_grid_thw` (one row per image) saying
how the patches divide; their vision blocks' outputs are packed the same way. The rule here is derived
from the data, not from the model's name: in a batch of B samples, B is the smallest leading dimension of
its tensors other than grids and empty ones (a sample, or all of them, may have no image), and
- a *grid* is an integer (R, 3) tensor of (t, h, w) per image (Qwen2-VL's `image_grid_thw` / `video_grid_thw`).
  Whose images its rows are is per-sample metadata: a *token-type* tensor (an integer (B, L) input named
  `*token_type_ids`: 0 on text, m > 0 on a modality's tokens, HF v5's `mm_token_type_ids`) has one run of m per
  image in the sample's tokens -- the model's own rule (its get_rope_index takes one grid row per run) -- so
  sample i has as many rows of the grid whose R is the batch's total runs of m; without one, R / B rows each.
  A tensor whose rows are the grid's t·h·w sum has the t·h·w of sample i's images as sample i's rows: images
  of different sizes, and different numbers of images, per sample;
- a tensor of B rows is batch-major (one row per sample);
- any other tensor of k·B rows holds k rows per sample.
So a batch of n samples is built by concatenating the samples' rows (`collate`), and sample ranges map to
row ranges through the per-sample counts (`sample_rows`, `row_range`). A block output's rows per sample are
found from the data flow the same way (runtime/forward_program.py: a fixed multiple of a packed input's), or,
where no input's rows explain them (LLaVA-NeXT's tiles, which image_sizes decide), by a forward of that sample
alone (runtime/sample_probe.py).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from plans.errors import MmplanError


def batch_samples(batch: Mapping[str, Any]) -> int:
    """The number of samples in `batch`: its tensors' smallest leading dimension, grids aside (see above)."""
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()]
    dims = [v.shape[0] for v in tensors if not _is_grid(v) and v.shape[0]] or [v.shape[0] for v in tensors if v.shape[0]]
    if not dims:
        raise MmplanError("a batch needs at least one tensor with a batch dimension (dim 0)")
    return min(dims)


def _is_grid(v: torch.Tensor) -> bool:
    return v.dim() == 2 and v.shape[1] == 3 and not v.is_floating_point() and v.dtype != torch.bool


def _readable(v: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return v.device.type != "meta" and not isinstance(v, FakeTensor)


def _runs(types: torch.Tensor) -> dict[int, tuple[int, ...]]:
    """Per nonzero value m of a (B, L) token-type tensor: each sample's number of runs of m."""
    starts = torch.ones_like(types, dtype=torch.bool)
    starts[:, 1:] = types[:, 1:] != types[:, :-1]
    out = {}
    for m in sorted(int(x) for x in types.unique() if int(x) > 0):
        out[m] = tuple(int(c) for c in (starts & (types == m)).sum(dim=1))
    return out


def _grids(batch: Mapping[str, Any], n: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Grid key -> (its rows per sample, the t·h·w sum per sample) for every readable grid whose rows can be told
    apart (see the module docstring)."""
    runs: list[dict[int, tuple[int, ...]]] = [
        _runs(v) for k, v in batch.items() if isinstance(v, torch.Tensor) and k.endswith("token_type_ids")
        and v.dim() == 2 and v.shape[0] == n and not v.is_floating_point() and _readable(v)]
    out = {}
    for j, (k, v) in enumerate((k, v) for k, v in batch.items() if isinstance(v, torch.Tensor) and _is_grid(v)):
        if not _readable(v):
            continue
        total = v.shape[0]
        found = [r for by_value in runs for m, r in by_value.items() if sum(r) == total]
        preferred = [r for by_value in runs for m, r in by_value.items() if sum(r) == total and m == j + 1]
        counts = (preferred or found or [None])[0]
        if counts is None:
            if total % n:
                continue
            counts = (total // n,) * n
        per_image = v.long().prod(dim=1).tolist()
        starts = [sum(counts[:i]) for i in range(n)]
        out[k] = (tuple(counts), tuple(sum(per_image[a:a + c]) for a, c in zip(starts, counts)))
    return out


def sample_rows(batch: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Rows of each sample of every tensor of `batch` with a leading dimension (see the module docstring)."""
    n = batch_samples(batch)
    grids = _grids(batch, n)
    out = {}
    for k, v in batch.items():
        if not (isinstance(v, torch.Tensor) and v.dim()):
            continue
        rows = v.shape[0]
        if k in grids:
            out[k] = grids[k][0]
            continue
        if rows == n:
            out[k] = (1,) * n
            continue
        grid = next((g for _, g in grids.values() if sum(g) == rows), None)
        if grid is not None:
            out[k] = grid
        elif rows % n == 0:
            out[k] = (rows // n,) * n
        else:
            raise MmplanError(f"input {k!r} has {rows} rows, not a multiple of the batch's {n} samples nor the t·h·w "
                              "of an image grid: cannot tell which rows belong to which sample")
    return out


def grid_rows(batch: Mapping[str, Any]) -> set[str]:
    """The keys whose rows per sample an image grid gives (the grids, and tensors of their t·h·w rows): the only
    packed inputs a block output's rows may be a fixed multiple of (runtime/forward_program._rows); k·B rows of
    k images each say nothing of what a block makes of them (LLaVA-NeXT's tiles per image follow its size)."""
    grids = _grids(batch, batch_samples(batch))
    sums = {sum(g) for _, g in grids.values()}
    return set(grids) | {k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() and k not in grids
                         and v.shape[0] in sums and v.shape[0] != batch_samples(batch)}


def rows_per_sample(batch: Mapping[str, Any]) -> dict[str, int]:
    """Rows of the batch's first sample of every tensor with a leading dimension (1 for a batch-major tensor)."""
    return {k: rows[0] for k, rows in sample_rows(batch).items()}


def packed_keys(batch: Mapping[str, Any]) -> set[str]:
    """The keys whose samples have other than one row each, and every grid (one row per image, however many)."""
    grids = {k for k, v in batch.items() if isinstance(v, torch.Tensor) and _is_grid(v)}
    return {k for k, rows in sample_rows(batch).items() if any(r != 1 for r in rows) or k in grids}


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


def model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch as the model's forward takes it: a packed input with no rows at all (a batch, or a micro-batch or
    data-parallel shard of one, in which no sample has an image) left out, as a processor leaves a text-only batch's
    pixel_values and grid out (a stock vision tower cannot run on zero images: Qwen2-VL's position ids concatenate
    one tensor per image). The blocks that then do not run have no rows in this batch (ForwardProgram.run_stage)."""
    return {k: v for k, v in batch.items() if not (isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 0)}


def check_traceable(batch: Mapping[str, Any], what: str) -> None:
    """A traced example must run every block, so no input of it may have no rows at all (samples without images:
    the trace would not see the vision blocks, whose outputs then have no recorded shape)."""
    empty = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == 0]
    if empty:
        raise MmplanError(f"{what}: the example batch's {', '.join(map(repr, empty))} has no rows (no sample of it has "
                          "an image), so its trace would not see the blocks that read it: give its first sample an "
                          "image (later samples and the data may have none)")


def collate(samples: Sequence[Mapping[str, Any]], packed: set[str]) -> dict[str, Any]:
    """One batch from per-sample dicts: a packed key's rows concatenated (each sample (k_i, ...); samples may have
    different k_i, e.g. images of different sizes, as long as the batch tells them apart: `sample_rows`), any
    other key stacked along a new dim 0."""
    if not samples:
        raise MmplanError("a batch needs at least one sample")
    out = {}
    for k in samples[0]:
        values = [torch.as_tensor(s[k]) for s in samples]
        shapes = {tuple(v.shape[1:]) if k in packed else tuple(v.shape) for v in values}  # what must agree
        if len(shapes) > 1:
            raise MmplanError(f"input {k!r}: samples of shapes {' and '.join(map(str, sorted(shapes)[:2]))} cannot form "
                              "one batch; pad them to one shape (LLaVA-NeXT: pixel_values to the batch's most tiles, "
                              "as its processor does, image_sizes telling each image's)")
        out[k] = torch.cat(values) if k in packed else torch.stack(values)
    rows = sample_rows(out)  # the batch must tell the samples' rows apart as they were (or refuses)
    if any(rows.get(k) != tuple(len(s[k]) for s in samples) for k in packed):
        raise MmplanError(f"samples of packed input(s) {sorted(packed)} have different row counts and the batch has no "
                          "image grid (with a token-type input for images per sample) saying whose rows are whose "
                          "(runtime/samples.py)")
    return out
