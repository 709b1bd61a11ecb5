"""Training data: a learnable synthetic multimodal dataset, the user-dataset hook, and a background prefetcher."""

from __future__ import annotations

import hashlib
import importlib
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from plans.errors import MmplanError
from runtime.samples import collate, packed_keys, rows_per_sample

KNOWN_KEYS = ("images", "mels", "tokens", "targets")


@runtime_checkable
class BatchSource(Protocol):
    """What the trainer reads: a batch (dict of tensors, batch dim 0) for a list of global sample indices."""

    def sample_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]: ...


def step_indices(step: int, global_batch: int) -> range:
    """Global sample indices of optimizer step `step`: step * global_batch ... (step + 1) * global_batch - 1."""
    if step < 0 or global_batch < 1:
        raise ValueError(f"step must be >= 0 and global_batch >= 1, got step={step}, global_batch={global_batch}")
    return range(step * global_batch, (step + 1) * global_batch)


def _seed_of(*parts: object) -> int:
    """A 63-bit seed that mixes all parts (no collisions like seed * K + index would have)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(_seed_of(*parts))


@dataclass(frozen=True, slots=True)
class _Layout:
    """Per-sample shapes and dtypes of the example batch, and which task the batch describes."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]

    @property
    def has_encoder(self) -> bool:
        return "images" in self.shapes or "mels" in self.shapes

    @property
    def task(self) -> str:
        """Task: "lm" (encoders + text targets), "text" (text-only LM), "clip" (images + captions) or "encode"."""
        if "targets" in self.shapes:
            return "lm" if self.has_encoder else "text"
        return "clip" if "tokens" in self.shapes else "encode"


def _layout(example_batch: Mapping[str, torch.Tensor]) -> _Layout:
    unknown = sorted(set(example_batch) - set(KNOWN_KEYS))
    if unknown:
        raise MmplanError(f"SyntheticDataset knows {', '.join(KNOWN_KEYS)}; the example batch also has {unknown}")
    if not example_batch:
        raise MmplanError("SyntheticDataset needs an example batch with at least one of " + ", ".join(KNOWN_KEYS))
    shapes = {k: tuple(v.shape[1:]) for k, v in example_batch.items()}
    dtypes = {k: v.dtype for k, v in example_batch.items()}
    if "targets" in shapes and "tokens" not in shapes:
        raise MmplanError("SyntheticDataset: the example batch has targets but no tokens")
    return _Layout(shapes, dtypes)


class SyntheticDataset:
    """Samples that can only be predicted by seeing their hidden class; identical for a given (seed, index).

    Each sample draws a class c from a generator seeded by (seed, index). Images and mels are a per-class
    prototype (fixed by the seed) plus Gaussian noise. What the text does depends on the batch:
      - "lm" (an encoder + tokens + targets): targets are class c's fixed token sequence, tokens are
        uniform random (no class information), so the loss falls below ln(classes) only if the encoders
        learn to see the class;
      - "text" (tokens + targets, no encoder): tokens are class c's sequence with a few noise tokens,
        targets its clean next tokens, so a text-only model learns too;
      - "clip" (images + tokens): tokens are class c's caption with a few noise tokens.
    """

    def __init__(
        self,
        example_batch: Mapping[str, torch.Tensor],
        vocab: int,
        seed: int,
        classes: int = 8,
        *,
        noise: float = 1.0,
        token_noise: float = 0.125,
    ) -> None:
        if vocab < 2 or classes < 1:
            raise MmplanError(
                f"SyntheticDataset needs vocab >= 2 and classes >= 1, got vocab={vocab}, classes={classes}"
            )
        self.layout = _layout(example_batch)
        self.vocab, self.seed, self.classes = vocab, seed, classes
        self.noise, self.token_noise = noise, token_noise
        self.prototypes = self._prototypes()

    def _prototypes(self) -> dict[str, torch.Tensor]:
        """Per-class patterns (classes, *sample shape): images, mels, and a token sequence one longer than S."""
        gen = _generator("prototypes", self.seed)
        protos = {}
        for key in ("images", "mels"):
            if key in self.layout.shapes:
                protos[key] = torch.randn(self.classes, *self.layout.shapes[key], generator=gen)
        if "tokens" in self.layout.shapes:
            (seq,) = self.layout.shapes["tokens"]
            protos["text"] = torch.randint(self.vocab, (self.classes, seq + 1), generator=gen)
        return protos

    def sample_class(self, index: int) -> int:
        """The hidden class of sample `index`."""
        return int(torch.randint(self.classes, (), generator=_generator("sample", self.seed, int(index))))

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """One sample (no batch dim); draws in a fixed order from its own generator."""
        gen = _generator("sample", self.seed, int(index))
        c = int(torch.randint(self.classes, (), generator=gen))
        out = {}
        for key in ("images", "mels"):
            if key in self.layout.shapes:
                noise = torch.randn(self.layout.shapes[key], generator=gen)
                out[key] = (self.prototypes[key][c] + self.noise * noise).to(self.layout.dtypes[key])
        if "tokens" in self.layout.shapes:
            out.update(self._text(c, gen))
        return out

    def _text(self, c: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        seq = self.prototypes["text"][c]  # (S + 1,)
        (length,) = self.layout.shapes["tokens"]
        random_tokens = torch.randint(self.vocab, (length,), generator=gen)
        task = self.layout.task
        if task == "lm":
            return {"tokens": random_tokens, "targets": seq[1:].clone()}
        noisy = torch.rand(length, generator=gen) < self.token_noise
        tokens = torch.where(noisy, random_tokens, seq[:length])
        return {"tokens": tokens, "targets": seq[1:].clone()} if task == "text" else {"tokens": tokens}

    def sample_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The samples of `indices` stacked along a new batch dim 0."""
        samples = [self.sample(i) for i in indices]
        if not samples:
            raise MmplanError("sample_batch needs at least one index")
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def load_user_dataset(spec: str, example_batch: Mapping[str, torch.Tensor], vocab: int, seed: int) -> BatchSource:
    """Load a user dataset from "package.module:factory".

    Contract: `factory(seed=seed)` returns an object with `sample_batch(indices: Sequence[int]) -> dict[str,
    Tensor]` that is deterministic in the global indices (every rank asks only for its own slice of
    step_indices(step, global_batch)). Its batches must have every key of the model's example batch with the
    same per-sample shapes and dtypes, and token ids in [0, vocab). This is checked on sample 0 here.
    """
    factory = _import_factory(spec)
    try:
        dataset = factory(seed=seed)
    except Exception as exc:
        raise MmplanError(f"dataset factory {spec!r} failed: {type(exc).__name__}: {_one_line(exc)}") from exc
    if not callable(getattr(dataset, "sample_batch", None)) and callable(getattr(dataset, "__getitem__", None)):
        packed = packed_keys(example_batch)
        dataset = MapDataset(dataset, packed)  # a torch Dataset of dicts (one sample each)
    if not callable(getattr(dataset, "sample_batch", None)):
        raise MmplanError(f"dataset factory {spec!r} returned {type(dataset).__name__}, which has no sample_batch() "
                          "and is not a torch Dataset of dicts")
    _check_batch(spec, dataset, example_batch, vocab)
    return dataset


class MapDataset:
    """A torch-style Dataset (`__getitem__(i)` -> dict of per-sample tensors, `__len__`) as a BatchSource:
    global sample i is item i modulo its length, samples stacked along a new dim 0 (the rows of `packed` keys
    concatenated, runtime/samples.py)."""

    def __init__(self, items: Any, packed: set[str] = frozenset()) -> None:
        self.items, self.packed = items, set(packed)
        try:
            self.size = len(items)
        except TypeError:
            self.size = None
        if self.size == 0:
            raise MmplanError("the dataset is empty")

    def sample_batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        samples = [self.items[int(i) % self.size if self.size else int(i)] for i in indices]
        return collate(samples, self.packed)


def open_dataset(spec: str | None, example_batch: Mapping[str, torch.Tensor], vocab: int, seed: int,
                 model=None) -> BatchSource:
    """SyntheticDataset for None or "synthetic", else load_user_dataset(spec, ...). Given the model, a dataset
    derived from its example batch keeps each input's ids below the embedding it feeds (synthetic.input_limits)."""
    if spec in (None, "", "synthetic"):
        if not set(example_batch) <= set(KNOWN_KEYS):  # any other model: derived from its example batch
            from runtime.synthetic import DerivedDataset, input_limits

            limits = input_limits(model, example_batch) if model is not None else None
            return DerivedDataset(example_batch, vocab=vocab, seed=seed, limits=limits)
        return SyntheticDataset(example_batch, vocab=vocab, seed=seed)
    return load_user_dataset(spec, example_batch, vocab, seed)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _import_factory(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise MmplanError(f"dataset {spec!r} must look like package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise MmplanError(
            f"cannot import dataset module {module_name!r}: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise MmplanError(f"dataset module {module_name!r} has no callable {attr!r}")
    return factory


def _check_batch(spec: str, dataset: Any, example_batch: Mapping[str, torch.Tensor], vocab: int) -> None:
    """Sample 0 of the user dataset must match the example batch's keys, per-sample shapes, dtypes and vocab."""
    try:
        batch = dataset.sample_batch([0])
    except Exception as exc:
        raise MmplanError(
            f"dataset {spec!r}: sample_batch([0]) failed: {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    if not isinstance(batch, Mapping):
        raise MmplanError(f"dataset {spec!r}: sample_batch must return a dict of tensors, got {type(batch).__name__}")
    missing = sorted(set(example_batch) - set(batch))
    if missing:
        raise MmplanError(f"dataset {spec!r}: batches lack {missing} (the model needs {sorted(example_batch)})")
    rows = rows_per_sample(example_batch)  # 1 per sample, or a packed input's k (runtime/samples.py)
    packed = packed_keys(example_batch)
    for key, want in example_batch.items():
        if key not in rows:
            continue
        got = batch[key]
        lead = got.shape[0] if key in packed and isinstance(got, torch.Tensor) and got.dim() else rows[key]  # packed:
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (lead, *want.shape[1:]) or got.dtype != want.dtype:  # any size
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise MmplanError(
                f"dataset {spec!r}: {key} of one sample is {shape} {getattr(got, 'dtype', '')}, "
                f"the model needs {(rows[key], *want.shape[1:])} {want.dtype}"
            )
    for key in ("tokens", "targets"):
        if (
            key in example_batch
            and not batch[key].is_floating_point()  # ids; a float "targets" (regression) has no vocabulary
            and batch[key].numel()
            and not 0 <= int(batch[key].min()) <= int(batch[key].max()) < vocab
        ):
            raise MmplanError(f"dataset {spec!r}: {key} ids must lie in [0, {vocab})")


class _Failure:
    """A producer exception in transit to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


class Prefetcher:
    """Produces the items of an iterable from a background thread, `depth` ahead; a context manager.

    Producer exceptions re-raise in the consumer. A consumer waits at most `timeout_s` for one item.
    close() stops the thread (bounded join; the thread is a daemon in case the source itself hangs).
    """

    def __init__(self, source: Iterable[Any], depth: int = 2, *, timeout_s: float = 300.0) -> None:
        if depth < 1:
            raise ValueError(f"Prefetcher depth must be >= 1, got {depth}")
        self.timeout_s = timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(iter(source),), name="mmplan-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        """Put unless stopped; False once close() was called."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(_Failure(exc))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        try:
            item = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise MmplanError(f"data producer gave no batch within {self.timeout_s:g} s") from None
        if item is _END or isinstance(item, _Failure):
            self._done = True
            self.close()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.exc
        return item

    @property
    def alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the producer and wait (at most timeout_s) for its thread to end."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __enter__(self) -> Prefetcher:  # noqa: PYI034
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
