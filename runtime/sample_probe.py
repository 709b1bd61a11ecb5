"""Rows per sample of the block outputs that no input's rows explain: a forward of each sample alone tells them.

LLaVA-NeXT's vision tower sees each image's tiles -- how many, the sample's `image_sizes` decide (transformers'
image_size_to_num_patches: the base tile and the best-fit grid pinpoint's) -- and pixel_values is padded to the
batch's most tiles, so its blocks' outputs have rows per sample that no input's rows are a multiple of
(runtime/samples.py explains packed inputs by their grids). A sample's rows are what a block outputs when the
model runs on that sample alone: one forward on fake tensors (integer inputs real, runtime/fake_exec.py) of a
meta-device copy of the model (the runtime's own model is partly hollow or sharded by then), once per distinct
*shape key*: the sample's shapes and the values of its integer inputs other than per-token ones (token ids,
labels, masks: as long as a labels input), which are what glue derives shapes from (image sizes, grids, aspect
ratios). Token ids decide values, not shapes, here: a model whose block output shapes follow its token ids'
values is outside this rule.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from plans.errors import MmplanError
from runtime.fake_exec import fake_batch, fakify_module, static_fake
from runtime.samples import split_samples

PROBE = "probe:"  # the prefix of a probed leaf's key among the per-sample rows (OutputSpec.scaled)
IGNORE = -100  # the label HF's losses skip: what marks a labels input (and its length, the per-token length)


def probe_key(block: str, leaf: int) -> str:
    return f"{PROBE}{block}#{leaf}"


def shape_key(sample: Mapping[str, Any]) -> tuple:
    """What decides a sample's block output shapes (see the module docstring)."""
    tensors = {k: v for k, v in sample.items() if isinstance(v, torch.Tensor)}
    per_token = {v.shape[1] for v in tensors.values() if v.dim() >= 2 and not v.is_floating_point()
                 and bool((v == IGNORE).any())}
    out = []
    for k, v in tensors.items():
        values = () if v.is_floating_point() or (v.dim() >= 2 and v.shape[1] in per_token) else tuple(v.flatten().tolist())
        out.append((k, tuple(v.shape), values))
    return tuple(out)


def meta_copy(model: nn.Module) -> nn.Module:
    """The model with its floating-point parameters and buffers on the meta device (no memory; integer buffers,
    which glue may read, copied as they are)."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if (t.is_floating_point() or t.is_complex()) and id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


class SampleProbe:
    """Rows per sample of the probed leaves (`leaves`: block -> its leaf indices) of a batch's samples."""

    def __init__(self, model: nn.Module, leaves: dict[str, tuple[int, ...]], constants: Mapping[str, Any],
                 known: dict[tuple, dict[str, int]] | None = None):
        self.leaves, self.constants = leaves, dict(constants)
        self.keys = tuple(probe_key(b, i) for b, idx in leaves.items() for i in idx)
        self.model = meta_copy(model)
        self.cache: dict[tuple, dict[str, int]] = dict(known or {})  # shape key -> probed key -> rows
        self.forwards = 0  # probes run (each one fake forward)

    def rows(self, batch: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """Probed key -> the rows of each of the batch's samples."""
        per = [self._sample(s) for s in split_samples(batch)]
        return {key: tuple(p[key] for p in per) for key in self.keys}

    def _sample(self, sample: dict[str, Any]) -> dict[str, int]:
        key = shape_key(sample)
        if key not in self.cache:
            self.cache[key] = self._forward(sample)
        return self.cache[key]

    def _forward(self, sample: dict[str, Any]) -> dict[str, int]:
        found: dict[str, int] = {}
        handles = []
        for block, idx in self.leaves.items():
            def hook(module, args, output, block=block, idx=idx):
                if probe_key(block, idx[0]) in found:  # a block called twice: its first call (as recorded)
                    return
                flat = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                for i in idx:
                    found[probe_key(block, i)] = int(flat[i].shape[0]) if flat[i].dim() else 1
            handles.append(self.model.get_submodule(block).register_forward_hook(hook))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        restore = fakify_module(self.model, mode)  # on the CPU, as the sample: floats as meta, integers copied
        sample = {k: (v.to("meta") if v.is_floating_point() or v.is_complex() else v.cpu())
                  if isinstance(v, torch.Tensor) else v for k, v in sample.items()}
        try:
            with static_fake(mode), torch.no_grad():
                self.model(**{**self.constants, **fake_batch(sample, mode)})
        except Exception as e:
            raise MmplanError(f"the forward of one sample alone (to find its rows of {', '.join(list(self.leaves)[:2])}) "
                              f"failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        finally:
            restore()
            for h in handles:
                h.remove()
        self.forwards += 1
        return {k: found.get(k, 0) for k in self.keys}  # a block the sample does not run (no image): no rows
