"""Running a model on fake tensors with its integer data real, so data-dependent glue takes static shapes.

Multimodal forwards (Hugging Face LLaVA, Qwen2-VL, Qwen2-Audio) decide shapes from their inputs' *values*:
`(input_ids == image_token).sum()`, a boolean mask indexing the merged embeddings, `cu_seqlens` from
`image_grid_thw`, `.item()` / `.tolist()` on lengths. Pure FakeTensors have no values, so those ops raise
DataDependentOutputException. Here integer and boolean tensors (token ids, masks, grids, lengths — small)
stay real: an op whose tensor arguments are all real, and that makes no floating-point tensor out of
nothing, runs on the CPU for real; everything floating point (parameters, activations) stays fake. A real
boolean mask indexing a fake tensor is turned into real integer indices first, so the result's shape is
known. The shapes, FLOPs and saved tensors are then exactly those of a real run on the same example batch.

Floating-point values decide shapes too, in glue that tests inputs for padding: Idefics3 drops the images whose
pixels are all exactly 0.0 (`(pixel_values == 0.0).sum(...) != n`, then a boolean index). A fake float tensor's
equality with a constant is answered as it is for any real data (random values, activations): never equal, so
`x == c` is a real all-False tensor (`x != c` all-True) and the shapes that follow are static; a padding image
the example batch does not hold is not modelled. Only for results of at most EQUALITY_NUMEL elements (larger
ones -- attention masks compared in a model's own code -- stay fake, as before).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from runtime.tensor_tree import tensors_in

_aten = torch.ops.aten


def _is_real(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) and x.device.type != "meta"


class RealIntegers(TorchDispatchMode):
    """Enter inside a FakeTensorMode: ops on real tensors only (no floating factory) run for real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tensors_in((args, kwargs))
        if flat and all(_is_real(x) for x in flat):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if not flat and not _floating_factory(func, kwargs):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func in _EQUALITY and _generic_float(args) and _numel(args[0]) <= EQUALITY_NUMEL:
            with _disable_current_modes():
                return torch.full(tuple(args[0].shape), func in _NOT_EQUAL, dtype=torch.bool)
        if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default) and len(args) >= 2:
            args = (args[0], _int_indices(args[1]), *args[2:])
        elif func is _aten.masked_select.default and _is_real(args[1]):
            with _disable_current_modes():
                idx = list(torch.broadcast_to(args[1], args[0].shape).nonzero().unbind(1))
            return _aten.index.Tensor(args[0], idx)
        return func(*args, **kwargs)


EQUALITY_NUMEL = 1 << 24
_NOT_EQUAL = {_aten.ne.Scalar}
_EQUALITY = {_aten.eq.Scalar, *_NOT_EQUAL}


def _generic_float(args: tuple) -> bool:
    """A fake floating-point tensor compared with a Python number."""
    return (len(args) == 2 and isinstance(args[0], FakeTensor) and args[0].is_floating_point()
            and isinstance(args[1], (int, float)) and not isinstance(args[1], bool))


def _numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= int(d)
    return n


def _int_indices(indices: list) -> list:
    """Real boolean indices as real integer indices (one per dim each covers); other indices unchanged."""
    out: list = []
    for i in indices:
        if _is_real(i) and i.dtype in (torch.bool, torch.uint8):
            with _disable_current_modes():
                out.extend(i.nonzero().unbind(1))
        else:
            out.append(i)
    return out


def _floating_factory(func, kwargs: dict) -> bool:
    dtype = kwargs.get("dtype")
    if dtype is None:
        return not func.__name__.startswith(("arange", "randint", "randperm"))
    return dtype.is_floating_point or dtype.is_complex


@contextmanager
def static_fake(mode: FakeTensorMode | None = None) -> Iterator[FakeTensorMode]:
    """FakeTensorMode (created when not given) with RealIntegers inside it."""
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    with mode, RealIntegers():
        yield mode


def fake_batch(batch: dict[str, Any], mode: FakeTensorMode) -> dict[str, Any]:
    """Floating-point batch tensors as fakes; integer and boolean ones stay real (their values set shapes)."""

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
            return mode.from_tensor(v) if v.device.type != "meta" else _fake_empty(v, mode)
        if isinstance(v, torch.Tensor) and v.device.type == "meta":
            return _fake_empty(v, mode)
        return v

    return {k: tree_map(one, v) for k, v in batch.items()}


def _fake_empty(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")


def fakify_module(model: nn.Module, mode: FakeTensorMode):
    """Swap parameters and buffers for FakeTensors on CPU (tied tensors stay tied); returns restore()."""
    saved: list[tuple[dict, str, Any]] = []
    memo: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                saved.append((store, name, t))
                if id(t) not in memo:
                    d = t.detach()
                    ft = _fake_empty(d, mode) if d.device.type == "meta" else mode.from_tensor(d)
                    memo[id(t)] = nn.Parameter(ft, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else ft
                store[name] = memo[id(t)]

    def restore() -> None:
        for store, name, t in saved:
            store[name] = t

    return restore


# factories whose result is small and whose dtype may follow their data: built on the CPU, moved to meta if floating
_BY_DATA = {"tensor", "as_tensor", "asarray", "full", "arange", "range", "randint", "randperm", "scalar_tensor",
            "tril_indices", "triu_indices"}


class MetaFloats(TorchFunctionMode):
    """torch.device("meta") for floating-point tensors only: a factory building a model and its example batch
    under it puts parameters, activations and pixels on meta (nothing allocated) and integer and boolean tensors
    (token ids, grids, masks) on the CPU, real -- their values decide shapes (the module docstring), as an `hf:`
    config's inputs are. Factories with an explicit device are left alone."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils._device import _device_constructors

        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.constructors or kwargs.get("device") is not None:
            return func(*args, **kwargs)
        dtype = kwargs.get("dtype")
        if getattr(func, "__name__", "") in _BY_DATA and dtype is None:
            out = func(*args, **{**kwargs, "device": "cpu"})
            return out.to("meta") if out.is_floating_point() or out.is_complex() else out
        floating = dtype is None or dtype.is_floating_point or dtype.is_complex
        return func(*args, **{**kwargs, "device": "meta" if floating else "cpu"})
