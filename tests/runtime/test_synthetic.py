"""The synthetic dataset derived from any example batch: same keys, shapes and dtypes, deterministic, learnable."""
from __future__ import annotations

import torch

from examples.my_model import factory
from runtime.data import open_dataset
from runtime.synthetic import IGNORE, DerivedDataset, _generator


def hf_like_batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[9, 9, 9, 3, 4, 5, 6]])  # 9: an image placeholder, then text
    labels = torch.tensor([[IGNORE, IGNORE, IGNORE, 3, 4, 5, 6]])
    return {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(1, 3, 4, 4),
            "mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0]])}


def test_keys_shapes_dtypes_and_determinism():
    ds = DerivedDataset(hf_like_batch(), vocab=12, seed=3)
    a, b = ds.sample_batch([5, 6]), DerivedDataset(hf_like_batch(), vocab=12, seed=3).sample_batch([5, 6])
    for key, value in hf_like_batch().items():
        assert a[key].shape == (2, *value.shape[1:]) and a[key].dtype == value.dtype, key
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a["input_ids"][:, :3], torch.full((2, 3), 9))  # placeholders kept
    assert int(a["input_ids"][:, 3:].max()) < 12 and not bool((a["input_ids"][:, 3:] == 9).any())  # in vocab, never 9
    assert torch.equal(a["labels"][:, 3:], a["input_ids"][:, 3:]) and bool((a["labels"][:, :3] == IGNORE).all())
    assert torch.equal(a["mask"], hf_like_batch()["mask"].expand(2, -1))  # other integer tensors unchanged


def test_text_and_float_targets_follow_the_hidden_class():
    ds = DerivedDataset(hf_like_batch(), vocab=12, seed=0)
    by_class: dict[int, torch.Tensor] = {}
    for i in range(40):
        c = int(torch.randint(ds.classes, (), generator=_generator("sample", 0, i)))
        text = ds.sample_batch([i])["input_ids"][0, 3:]
        assert torch.equal(by_class.setdefault(c, text), text)  # the same class, the same text
    assert len(by_class) > 1
    _, batch = factory(1)  # examples/my_model.py: images, audio, float targets (not the zoo's keys)
    data = open_dataset(None, batch, vocab=2, seed=0)
    assert isinstance(data, DerivedDataset)
    got = data.sample_batch(range(8))
    assert got["targets"].shape == (8,) and got["images"].shape == (8, 16, 48)


def test_packed_inputs_split_by_sample():
    """Qwen2-VL-style packed patches (rows of all images, with a per-image grid): rows per sample come from the
    data, a batch of n samples concatenates n samples' rows, and the sample's rows follow its class."""
    import pytest

    from plans.errors import MmplanError
    from runtime.samples import collate, rows_per_sample

    example = {**hf_like_batch(), "pixel_values": torch.randn(6, 5), "grid": torch.tensor([[1, 2, 3]])}
    del example["mask"]
    assert rows_per_sample(example) == {"input_ids": 1, "labels": 1, "pixel_values": 6, "grid": 1}
    ds = DerivedDataset(example, vocab=12, seed=1)
    batch = ds.sample_batch([4, 5, 6])
    assert batch["pixel_values"].shape == (18, 5) and batch["grid"].shape == (3, 3) and batch["input_ids"].shape == (3, 7)
    assert torch.equal(batch["pixel_values"][6:12], ds.sample_batch([5])["pixel_values"])  # sample 5's rows
    assert rows_per_sample(batch)["pixel_values"] == 6
    with pytest.raises(MmplanError, match="different row counts"):
        collate([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(3, 3)}], {"x"})
    with pytest.raises(MmplanError, match="not a multiple"):
        rows_per_sample({"a": torch.zeros(2, 1), "b": torch.zeros(5, 1)})
