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
  the example, the text positions are class c's fixed sequence (ids below both the head's classes `vocab` and
  the rows of the embedding the key feeds; never a placeholder id); the labels repeat them (-100 where the
  example has -100), so the next token depends on the inputs;
- integer ids without labels (CLIP's captions, Mllama's aspect-ratio ids: a key named *ids*, not *type_ids* /
  *position_ids*) are class c's fixed sequence, below the rows of the embedding the key feeds (`limits`, found by
  one fake forward: input_limits) or `vocab` where none is known;
- labels without token ids (an encoder-decoder's transcript: Whisper shifts its labels into the decoder's
  input) are class c's fixed sequence below `vocab`;
- any other integer tensor (attention masks, grids, lengths) is the example's, unchanged; non-tensor entries
  (`return_loss=True`) are passed along as they are.
Packed inputs (Qwen2-VL's patches, runtime/samples.py) are per sample its template's rows, concatenated in a batch;
the example's samples of distinct shapes or placeholder positions (images of different sizes or counts; LLaVA-NeXT's
padded tiles have one shape, but their image tokens differ) are the templates, sample i taking template i mod
their count.
Deterministic in the global sample index, like runtime/data.py's SyntheticDataset. A sample whose ids fall
outside the embedding an input feeds is a one-line error naming the input (never an IndexError in the model).
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence

import torch

from plans.errors import MmplanError
from runtime.samples import collate, packed_keys, split_samples

IGNORE = -100  # the label HF's losses skip


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _is_target(key: str, shape: tuple[int, ...]) -> bool:
    return bool(re.search(r"target|label|score", key.lower())) or (len(shape) <= 1 and (not shape or shape[0] <= 1))


class DerivedDataset:
    """See the module docstring. The example batch's samples of distinct shapes (images of different sizes) are
    templates: sample i takes the shapes, placeholders and grids of template i mod their count."""

    def __init__(self, example_batch: Mapping[str, torch.Tensor], vocab: int, seed: int, classes: int = 8,
                 noise: float = 0.5, limits: Mapping[str, int] | None = None) -> None:
        tensors = {k: v for k, v in example_batch.items() if isinstance(v, torch.Tensor)}
        self.constants = {k: v for k, v in example_batch.items() if not isinstance(v, torch.Tensor)}  # return_loss=True
        if not tensors or any(v.dim() == 0 for v in tensors.values()):
            raise MmplanError("a synthetic dataset needs an example batch of tensors with a batch dimension (dim 0)")
        self.vocab, self.seed, self.classes = vocab, seed, classes
        self.limits = dict(limits or {})  # input key -> rows of the embedding it feeds
        self.packed = packed_keys(tensors)  # Qwen2-VL's patches: a sample's rows follow its image grid
        templates: dict[tuple, dict[str, torch.Tensor]] = {}
        for sample in split_samples(tensors):  # one per distinct shapes and placeholder positions (LLaVA-NeXT's
            templates.setdefault(_signature(sample), sample)  # images of different sizes: tokens, not shapes)
        avoid = _placeholders(tensors)  # every template's text avoids every placeholder (one with no image too)
        self.templates = [_Template({k: v.clone()[None] if k in self.packed else v.clone() for k, v in t.items()},
                                    vocab, seed, classes, noise, limits, salt=i, avoid=avoid)
                          for i, t in enumerate(templates.values())]

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        return self.templates[int(index) % len(self.templates)].sample(index)

    def has_rows(self, index: int) -> bool:
        """Whether sample `index` has rows of every packed input (an image; runtime/samples.model_inputs)."""
        example = self.templates[int(index) % len(self.templates)].example
        return all(example[k].shape[1] for k in self.packed)

    def sample_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        samples = [self.sample(i) for i in indices]
        if not samples:
            raise MmplanError("sample_batch needs at least one index")
        return {**collate(samples, self.packed), **self.constants}


def _signature(sample: Mapping[str, torch.Tensor]) -> tuple:
    """What tells one template from another: every key's shape; where a batch has labels (IGNORE on placeholders),
    also the token ids at the placeholders and the values of its other integer inputs (grids, image sizes)."""
    masks = {tuple(v.shape): v == IGNORE for v in sample.values() if not v.is_floating_point() and bool((v == IGNORE).any())}
    out = []
    for k, v in sample.items():
        values: tuple = ()
        if masks and not v.is_floating_point():
            mask = masks.get(tuple(v.shape[:2]))
            values = tuple(v[mask].tolist()) if mask is not None and v.dim() == 2 else tuple(v.flatten().tolist())
        out.append((k, tuple(v.shape), values))
    return tuple(out)


def _placeholders(example: Mapping[str, torch.Tensor]) -> frozenset[int]:
    """The ids at the placeholders (where the labels are IGNORE) of every token key of the example's samples."""
    tensors = {k: v for k, v in example.items() if isinstance(v, torch.Tensor)}
    out: set[int] = set()
    for tok, lab in _pair_labels(tensors).items():
        out |= {int(x) for x in tensors[tok][tensors[lab] == IGNORE].unique()}
    return frozenset(out)


def _pair_labels(example: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Token key -> its labels key: an integer key whose non-IGNORE positions the labels key repeats."""
    out = {}
    ints = [k for k, v in example.items() if not v.is_floating_point()]
    for lab in ints:
        if not re.search(r"label|target", lab.lower()):
            continue
        for tok in ints:
            if tok != lab and example[tok].shape == example[lab].shape:
                keep = example[lab] != IGNORE
                if bool(keep.any()) and torch.equal(example[tok][keep], example[lab][keep]):
                    out[tok] = lab
                    break
    return out


class _Template:
    """The samples of one template (one sample's shapes) of a DerivedDataset."""

    def __init__(self, example: dict[str, torch.Tensor], vocab: int, seed: int, classes: int, noise: float,
                 limits: Mapping[str, int] | None, salt: int, avoid: frozenset[int] = frozenset()) -> None:
        self.example = example
        self.vocab, self.seed, self.classes, self.noise = vocab, seed, classes, noise
        self.limits = dict(limits or {})  # input key -> rows of the embedding it feeds
        self.labels_of = _pair_labels(self.example)  # token key -> its labels key
        labelled = set(self.labels_of) | set(self.labels_of.values())
        self.free_tokens = [k for k, v in self.example.items()  # ids with no labels (CLIP's captions), or labels alone
                            if not v.is_floating_point() and v.dim() == 2 and k not in labelled
                            and (("ids" in k.lower() and not re.search(r"type_ids|position_ids", k.lower()))
                                 or re.search(r"label", k.lower()))]
        gen = _generator("prototypes", seed) if not salt else _generator("prototypes", seed, salt)
        self.prototypes: dict[str, torch.Tensor] = {}
        for k, v in self.example.items():
            if v.is_floating_point():
                self.prototypes[k] = torch.randn(classes, *v.shape[1:], generator=gen)
        placeholders = {int(x) for k in self.labels_of for x in self.example[k][0][self._fixed(k)].unique()} | avoid
        for k in self.labels_of:
            n = int((~self._fixed(k)).sum())
            allowed = self._allowed(k, min(vocab, self.limits.get(k, vocab)), placeholders)
            self.prototypes[k] = allowed[torch.randint(len(allowed), (classes, n), generator=gen)]
        for k in self.free_tokens:
            bound = min(vocab, self.limits.get(k, vocab)) if re.search(r"label", k.lower()) else self.limits.get(k, vocab)
            allowed = self._allowed(k, bound, placeholders)
            self.prototypes[k] = allowed[torch.randint(len(allowed), (classes, self.example[k].shape[1]), generator=gen)]

    @staticmethod
    def _allowed(key: str, bound: int, placeholders: set[int]) -> torch.Tensor:
        allowed = torch.tensor([i for i in range(bound) if i not in placeholders])
        if not len(allowed):
            raise MmplanError(f"synthetic input {key!r}: no ids below {bound} besides the placeholders {sorted(placeholders)}")
        return allowed

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
        self._check(out, index)
        return out

    def _check(self, sample: Mapping[str, torch.Tensor], index: int) -> None:
        """Every id of an input below the rows of the embedding it feeds: one line naming the input, not an
        IndexError deep in the model."""
        for k, rows in self.limits.items():
            v = sample.get(k)
            if v is None or v.is_floating_point() or not v.numel():
                continue
            low, high = int(v.min()), int(v.max())
            if low < 0 or high >= rows:
                raise MmplanError(f"synthetic sample {index}: input {k!r} holds id {high if high >= rows else low}, outside "
                                  f"[0, {rows}) of the embedding it feeds")



def input_limits(model, example: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Input key -> rows of the smallest nn.Embedding that looks up that input (or a view of it), from one forward
    on fake tensors (integer inputs stay real: runtime/fake_exec.py). {} where the model does not run so."""
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from runtime.fake_exec import fake_batch, fakify_module, static_fake

    keys = {v.untyped_storage().data_ptr(): k for k, v in example.items()
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.device.type != "meta" and v.numel()}
    found: dict[str, int] = {}

    def hook(module, args):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) and not x.is_floating_point() and x.device.type != "meta":
            key = keys.get(x.untyped_storage().data_ptr())
            if key is not None:
                found[key] = min(found.get(key, module.num_embeddings), module.num_embeddings)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, nn.Embedding)]
    restore = fakify_module(model, mode)
    try:
        with static_fake(mode), torch.no_grad():
            model(**fake_batch(dict(example), mode))
    except Exception:  # the limits are a check; a model that does not run on fakes is checked by the run itself
        return {}
    finally:
        restore()
        for h in handles:
            h.remove()
    return found
