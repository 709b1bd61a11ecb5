"""Tests of the synthetic dataset (deterministic, learnable only through the encoders), Prefetcher and the user hook."""

import math
import sys
import threading
import time

import pytest
import torch

from plans.errors import MmplanError
from runtime.data import (
    Prefetcher,
    SyntheticDataset,
    load_user_dataset,
    open_dataset,
    step_indices,
)
from runtime.models import ArchConfig, DecoderConfig, zoo


def _dataset(name: str, seed: int = 0, **kwargs) -> SyntheticDataset:
    arch = zoo.resolve(name)
    vocab = arch.clip.vocab if arch.kind == "clip" else arch.decoder.vocab
    return SyntheticDataset(zoo.build(name, 2)[1], vocab=vocab, seed=seed, **kwargs)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sample_is_the_same_in_any_batch_and_any_instance():
    ds = _dataset("tiny-avlm", seed=3)
    one_batch = ds.sample_batch([3, 7, 5])
    two_batches = [ds.sample_batch([5]), _dataset("tiny-avlm", seed=3).sample_batch([7, 3])]
    assert set(one_batch) == {"images", "mels", "tokens", "targets"}
    for key in one_batch:
        assert torch.equal(one_batch[key][0], two_batches[1][key][1])
        assert torch.equal(one_batch[key][1], two_batches[1][key][0])
        assert torch.equal(one_batch[key][2], two_batches[0][key][0])


def test_shapes_and_dtypes_follow_the_example_batch():
    example = zoo.build("tiny-avlm", 2, dtype=torch.bfloat16)[1]
    batch = SyntheticDataset(example, vocab=256, seed=0).sample_batch(range(5))
    for key, value in example.items():
        assert batch[key].shape == (5, *value.shape[1:]) and batch[key].dtype == value.dtype
    assert 0 <= int(batch["tokens"].min()) and int(batch["targets"].max()) < 256


def test_different_seeds_give_different_samples():
    a, b = _dataset("tiny-avlm", seed=0).sample_batch(range(8)), _dataset("tiny-avlm", seed=1).sample_batch(range(8))
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_step_indices():
    assert step_indices(0, 4) == range(4) and step_indices(3, 16) == range(48, 64)
    with pytest.raises(ValueError):
        step_indices(-1, 4)


def _class_accuracy(features: torch.Tensor, classes: torch.Tensor, n_classes: int) -> float:
    """Nearest-class-mean accuracy on the second half, class means fitted on the first half."""
    half = len(classes) // 2
    means = torch.stack([features[:half][classes[:half] == c].mean(0) for c in range(n_classes)])
    predicted = torch.cdist(features[half:], means).argmin(1)
    return (predicted == classes[half:]).float().mean().item()


def test_prompt_tokens_carry_no_class_but_images_and_targets_do():
    ds = _dataset("tiny-vlm", seed=0)
    indices = range(1600)
    batch = ds.sample_batch(indices)
    classes = torch.tensor([ds.sample_class(i) for i in indices])
    assert classes.bincount(minlength=8).min() > 150

    def one_hot(ids):  # (N, S) -> (N, S * vocab)
        return torch.nn.functional.one_hot(ids, ds.vocab).flatten(1).float()

    assert _class_accuracy(one_hot(batch["tokens"]), classes, 8) < 0.2  # chance is 1/8
    assert _class_accuracy(one_hot(batch["targets"]), classes, 8) == 1.0
    assert _class_accuracy(batch["images"].flatten(1), classes, 8) > 0.95


def test_text_only_targets_are_the_next_tokens_of_a_class_sequence(one_thread):
    arch = ArchConfig(name="t", decoder=DecoderConfig(type="gpt", hidden=64, layers=2, heads=4, vocab=256, text_seq=16))
    ds = SyntheticDataset(zoo.build(arch, 2)[1], vocab=256, seed=0)
    batch = ds.sample_batch(range(200))
    agree = (batch["tokens"][:, 1:] == batch["targets"][:, :-1]).float().mean().item()
    assert 0.8 < agree < 1.0  # a few noise tokens in the prompt; the targets stay clean
    _assert_learns(arch, steps=40, min_drop=0.5)


def test_clip_captions_carry_the_class(one_thread):
    ds = _dataset("tiny-clip", seed=0)
    assert set(ds.sample_batch([0])) == {"images", "tokens"}
    _assert_learns("tiny-clip", steps=60, min_drop=0.4)


@pytest.fixture
def one_thread():
    """One intra-op thread: faster on the shared 2-core box (no spinning against other jobs), and reproducible."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _assert_learns(spec, steps: int, min_drop: float, floor: float | None = None) -> tuple[float, float, float]:
    """Train from torch.manual_seed(0) with Adam 3e-3 at global batch 16; compare held-out losses."""
    torch.manual_seed(0)
    model, example = zoo.build(spec, 2)
    arch = zoo.resolve(spec)
    vocab = arch.clip.vocab if arch.kind == "clip" else arch.decoder.vocab
    ds = SyntheticDataset(example, vocab=vocab, seed=0)
    held_out = ds.sample_batch(range(10**6, 10**6 + 64))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)

    def evaluate() -> float:
        with torch.no_grad():
            return model(**held_out).item()

    start, began = evaluate(), time.monotonic()
    for step in range(steps):
        loss = model(**ds.sample_batch(step_indices(step, 16)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    end = evaluate()
    assert end <= (1 - min_drop) * start, f"held-out loss {start:.3f} -> {end:.3f} in {steps} steps"
    if floor is not None:
        assert end < floor, f"held-out loss {end:.3f} not below {floor:.3f}"
    return start, end, time.monotonic() - began


def test_tiny_vlm_learns_the_class_through_its_vision_tower(one_thread):
    # Without seeing the class the best possible loss is ln(classes): each target position has 8 equally
    # likely values. Beating it proves the image carries the class and the model learned to read it.
    start, end, seconds = _assert_learns("tiny-vlm", steps=200, min_drop=0.5, floor=0.75 * math.log(8))
    print(f"tiny-vlm held-out loss {start:.2f} -> {end:.2f} in 200 steps, {seconds:.1f} s")


def test_unknown_keys_and_bad_sizes_are_rejected():
    with pytest.raises(MmplanError, match="labels"):
        SyntheticDataset({"labels": torch.zeros(2, 3)}, vocab=10, seed=0)
    with pytest.raises(MmplanError, match="vocab"):
        SyntheticDataset({"tokens": torch.zeros(2, 3, dtype=torch.long)}, vocab=1, seed=0)


# ----------------------------------------------------------------------------------------------- Prefetcher
def test_prefetcher_yields_in_order_and_runs_ahead():
    produced = []

    def source():
        for i in range(10):
            produced.append(i)
            yield i

    with Prefetcher(source(), depth=2) as prefetcher:
        deadline = time.monotonic() + 2
        while len(produced) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert len(produced) == 3  # two queued, one waiting to be put
        assert list(prefetcher) == list(range(10))
    assert not prefetcher.alive


def test_prefetcher_overlaps_production_with_consumption():
    def slow_source():
        for i in range(8):
            time.sleep(0.05)
            yield i

    start = time.monotonic()
    with Prefetcher(slow_source()) as prefetcher:
        for _ in prefetcher:
            time.sleep(0.05)
    assert time.monotonic() - start < 0.65  # 0.8 s without overlap, ~0.45 s with


def test_prefetcher_reraises_producer_errors():
    def failing():
        yield 1
        raise ValueError("bad shard 7")

    prefetcher = Prefetcher(failing())
    assert next(prefetcher) == 1
    with pytest.raises(ValueError, match="bad shard 7"):
        next(prefetcher)
    with pytest.raises(StopIteration):
        next(prefetcher)
    assert not prefetcher.alive


def test_prefetcher_close_stops_an_endless_producer():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    before = threading.active_count()
    prefetcher = Prefetcher(endless(), depth=3)
    assert [next(prefetcher) for _ in range(5)] == [0, 1, 2, 3, 4]
    prefetcher.close()
    assert not prefetcher.alive and threading.active_count() == before
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_prefetcher_consumer_wait_is_bounded():
    def stuck():
        time.sleep(0.5)
        yield 0

    with Prefetcher(stuck(), timeout_s=0.1) as prefetcher, pytest.raises(MmplanError, match="no batch within"):
        next(prefetcher)


# ----------------------------------------------------------------------------------------------- user datasets
USER_MODULE = """
import torch
from runtime.data import SyntheticDataset

class Ones:
    def __init__(self, seed, shape=(16,), dtype=torch.long):
        self.seed, self.shape, self.dtype = seed, shape, dtype
    def sample_batch(self, indices):
        n = len(indices)
        return {"tokens": torch.ones(n, *self.shape, dtype=self.dtype), "targets": torch.ones(n, *self.shape, dtype=self.dtype)}

def good(seed):
    return Ones(seed)

def wrong_shape(seed):
    return Ones(seed, shape=(8,))

def no_sample_batch(seed):
    return object()

def raises(seed):
    raise RuntimeError("no data\\nhere")
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "mmplan_user_data.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mmplan_user_data"
    sys.modules.pop("mmplan_user_data", None)


def _text_example() -> dict:
    return {"tokens": torch.zeros(2, 16, dtype=torch.long), "targets": torch.zeros(2, 16, dtype=torch.long)}


def test_user_dataset_factory_gets_the_seed(user_module):
    ds = load_user_dataset(f"{user_module}:good", _text_example(), vocab=256, seed=5)
    assert ds.seed == 5 and ds.sample_batch([0, 1])["tokens"].shape == (2, 16)
    assert isinstance(open_dataset(None, _text_example(), 256, 0), SyntheticDataset)
    assert open_dataset(f"{user_module}:good", _text_example(), 256, 0).seed == 0


@pytest.mark.parametrize(
    "factory, message",
    [
        ("no_colon", "package.module:factory"),
        ("no_such_module_xyz:f", "cannot import"),
        ("{m}:missing", "no callable 'missing'"),
        ("{m}:raises", "failed: RuntimeError: no data here"),
        ("{m}:no_sample_batch", "no sample_batch"),
        ("{m}:wrong_shape", r"tokens of one sample is \(1, 8\)"),
    ],
)
def test_user_dataset_errors_are_one_line(user_module, factory, message):
    with pytest.raises(MmplanError, match=message) as info:
        load_user_dataset(factory.format(m=user_module), _text_example(), vocab=256, seed=0)
    assert "\n" not in str(info.value)


def test_user_dataset_token_ids_must_fit_the_vocab(user_module):
    with pytest.raises(MmplanError, match=r"ids must lie in \[0, 1\)"):
        load_user_dataset(f"{user_module}:good", _text_example(), vocab=1, seed=0)
