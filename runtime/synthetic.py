"""A learnable synthetic dataset derived from any model's example batch (same keys, shapes and dtypes).

Used by `mmplan run` without `--data` when the example batch is not the zoo's (images / mels / tokens /
targets). Each sample has a hidden class c, drawn from a generator seeded by (seed, index), so a sample is
the same on every rank and in every run. Per key of the example batch (per-sample shape = its shape
without dim 0):
- a floating-point *input* is class c's fixed prototype plus Gaussian noise;
- a floating-point *target* (its name says target/label/score, or it has at most one value per sample) is
  class c's fixed value: a regression the model can only learn by seeing the inputs;
- integer *token ids* (an integer key whose text positions a labels key repeats — the Hugging Face
  convention, `labels` = `input_ids` with -100 on image / audio placeholders): the placeholders stay as in
  the example, the text positions are class c's fixed sequence (ids in [0, vocab), never a placeholder id);
  the labels repeat them (-100 where the example has -100), so the next token depends on the inputs;
- integer token ids without labels (CLIP's captions: a key named *ids*, not *type_ids* / *position_ids*) are
  class c's fixed sequence;
- any other integer tensor (attention masks, grids, lengths) is the example's, unchanged; non-tensor entries
  (`return_loss=True`) are passed along as they are.
Packed inputs (Qwen2-VL's patches, runtime/samples.py) are per sample their first k rows, concatenated in a batch.
Deterministic in the global sample index, like runtime/data.py's SyntheticDataset.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence

import torch

from plans.errors import MmplanError
from runtime.samples import collate, rows_per_sample

IGNORE = -100  # the label HF's losses skip


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _is_target(key: str, shape: tuple[int, ...]) -> bool:
    return bool(re.search(r"target|label|score", key.lower())) or (len(shape) <= 1 and (not shape or shape[0] <= 1))


class DerivedDataset:
    """See the module docstring."""

    def __init__(self, example_batch: Mapping[str, torch.Tensor], vocab: int, seed: int, classes: int = 8,
                 noise: float = 0.5) -> None:
        tensors = {k: v for k, v in example_batch.items() if isinstance(v, torch.Tensor)}
        self.constants = {k: v for k, v in example_batch.items() if not isinstance(v, torch.Tensor)}  # return_loss=True
        if not tensors or any(v.dim() == 0 for v in tensors.values()):
            raise MmplanError("a synthetic dataset needs an example batch of tensors with a batch dimension (dim 0)")
        rows = rows_per_sample(tensors)  # packed inputs (Qwen2-VL's patches): sample 0 is their first k rows
        self.packed = {k for k, r in rows.items() if r > 1}
        self.example = {k: v[:rows[k]].clone()[None] if k in self.packed else v[:1].clone() for k, v in tensors.items()}
        self.vocab, self.seed, self.classes, self.noise = vocab, seed, classes, noise
        self.labels_of = self._pair_labels()  # token key -> its labels key
        labelled = set(self.labels_of) | set(self.labels_of.values())
        self.free_tokens = [k for k, v in self.example.items()  # token ids with no labels (CLIP's captions)
                            if not v.is_floating_point() and "ids" in k.lower() and not re.search(r"type_ids|position_ids", k.lower())
                            and k not in labelled and v.dim() == 2]
        gen = _generator("prototypes", seed)
        self.prototypes: dict[str, torch.Tensor] = {}
        for k, v in self.example.items():
            if v.is_floating_point():
                self.prototypes[k] = torch.randn(classes, *v.shape[1:], generator=gen)
        placeholders = {int(x) for k in self.labels_of for x in self.example[k][0][self._fixed(k)].unique()}
        allowed = torch.tensor([i for i in range(vocab) if i not in placeholders])
        if not len(allowed):
            raise MmplanError(f"a synthetic dataset needs token ids besides the placeholders {sorted(placeholders)}")
        for k in self.labels_of:
            n = int((~self._fixed(k)).sum())
            self.prototypes[k] = allowed[torch.randint(len(allowed), (classes, n), generator=gen)]
        for k in self.free_tokens:
            self.prototypes[k] = allowed[torch.randint(len(allowed), (classes, self.example[k].shape[1]), generator=gen)]

    def _pair_labels(self) -> dict[str, str]:
        out = {}
        ints = [k for k, v in self.example.items() if not v.is_floating_point()]
        for lab in ints:
            if not re.search(r"label|target", lab.lower()):
                continue
            for tok in ints:
                if tok != lab and self.example[tok].shape == self.example[lab].shape:
                    keep = self.example[lab] != IGNORE
                    if bool(keep.any()) and torch.equal(self.example[tok][keep], self.example[lab][keep]):
                        out[tok] = lab
                        break
        return out

    def _fixed(self, token_key: str) -> torch.Tensor:
        """Placeholder positions of a token key (per sample): where its labels are ignored."""
        return (self.example[self.labels_of[token_key]] == IGNORE)[0]

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        gen = _generator("sample", self.seed, int(index))
        c = int(torch.randint(self.classes, (), generator=gen))
        out: dict[str, torch.Tensor] = {}
        labels = set(self.labels_of.values())
        for k, v in self.example.items():
            shape = tuple(v.shape[1:])
            if v.is_floating_point():
                value = self.prototypes[k][c].clone()
                if not _is_target(k, shape):
                    value = value + self.noise * torch.randn(shape, generator=gen)
                out[k] = value.to(v.dtype)
            elif k in self.free_tokens:
                out[k] = self.prototypes[k][c].to(v.dtype)
            elif k in self.labels_of:
                tokens = v[0].clone()
                tokens[~self._fixed(k)] = self.prototypes[k][c].to(v.dtype)
                out[k] = tokens
            elif k not in labels:
                out[k] = v[0].clone()
        for tok, lab in self.labels_of.items():
            out[lab] = torch.where(self.example[lab][0] == IGNORE, self.example[lab][0], out[tok])
        return out

    def sample_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        samples = [self.sample(i) for i in indices]
        if not samples:
            raise MmplanError("sample_batch needs at least one index")
        return {**collate(samples, self.packed), **self.constants}
