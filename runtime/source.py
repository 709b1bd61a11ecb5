"""Turns a MODEL argument (zoo name, architecture TOML, or `package.module:factory`) into a model factory."""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plans.errors import MmplanError
from runtime.hf import example_inputs, for_training, hf_source
from runtime.model_source import Factory, ModelSource

_MICRO_BATCH: ContextVar[int] = ContextVar("micro_batch", default=1)  # for inputs built after the factory returns


def is_factory(spec: str) -> bool:
    """True when `spec` names Python code to import (`package.module:factory`), not a zoo name, a TOML file or an
    `hf:` config (data: a transformers config builds a stock class, it runs no code of its own)."""
    return ":" in spec and not spec.endswith(".toml") and not spec.startswith("hf:")


def resolve(spec: str) -> ModelSource:
    """Zoo name | path to an architecture .toml | `hf:CONFIG` (runtime/hf.py) | `package.module:factory`."""
    if spec.startswith("hf:"):
        return hf_source(spec)
    if is_factory(spec):
        return ModelSource(spec, _import_factory(spec), None)
    from runtime.models import zoo

    if spec.endswith(".toml"):
        try:
            is_dir, is_file = Path(spec).is_dir(), Path(spec).is_file()
        except (OSError, ValueError) as e:  # a name too long for the file system, a NUL byte
            raise MmplanError(f"architecture file {spec[:80]!r}: {getattr(e, 'strerror', None) or e}") from None
        if is_dir:
            raise MmplanError(f"architecture file {spec} is a directory, not a .toml file")
        if not is_file:
            what = "is not a regular file" if Path(spec).exists() else "does not exist"
            raise MmplanError(f"architecture file {spec} {what}")
        try:
            config = zoo.resolve(spec)
        except (ValueError, KeyError, OSError) as e:
            message = _one_line(e)  # load_arch_toml starts its messages with the path already
            raise MmplanError(f"architecture file {spec}: {message.removeprefix(f'{spec}: ')}") from None
        # the spec (the file's path) names the model, so a plan can rebuild it
        return ModelSource(spec, lambda mb: zoo.build(config, micro_batch=mb), config.dtype)
    if spec in zoo.names():
        config = zoo.resolve(spec)
        return ModelSource(spec, lambda mb: zoo.build(config, micro_batch=mb), config.dtype)
    raise MmplanError(f"unknown model {spec!r}; known zoo models: {', '.join(zoo.names())} "
                      "(or give a .toml architecture file or package.module:factory)")


def _import_factory(spec: str) -> Factory:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # like `python -m`: the user's own modules import from where they stand
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import error of any kind is the user's to fix
        raise MmplanError(f"cannot import {module_name!r} for factory {spec}: {_one_line(e)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise MmplanError(f"{module_name!r} has no callable {attr!r} (factory {spec})")
    takes_batch = bool(inspect.signature(factory).parameters)

    def call(micro_batch: int):
        _MICRO_BATCH.set(micro_batch)
        try:
            out = factory(micro_batch) if takes_batch else factory()
        except Exception as e:
            raise MmplanError(f"factory {spec} raised {type(e).__name__}: {_one_line(e)}") from None
        return _check_factory_output(spec, out)

    return call


def _check_factory_output(spec: str, out: Any) -> tuple[nn.Module, dict[str, Any]]:
    if isinstance(out, nn.Module) and hasattr(out, "config"):  # a transformers model: inputs from its config
        return for_training(out), example_inputs(out.config, micro_batch=_MICRO_BATCH.get())
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module) and isinstance(out[1], dict)):
        raise MmplanError(f"factory {spec} must return (nn.Module, dict of example inputs) or a transformers model, got {type(out).__name__}")
    return out


def call_factory(source: ModelSource, micro_batch: int) -> tuple[nn.Module, dict[str, Any]]:
    """Run a factory, turning its failures into one clear MmplanError."""
    try:
        model, batch = source.factory(micro_batch)
    except MmplanError:
        raise
    except Exception as e:
        raise MmplanError(f"building model {source.name} failed: {type(e).__name__}: {_one_line(e)}") from None
    if not any(isinstance(v, torch.Tensor) for v in batch.values()):
        raise MmplanError(f"model {source.name}: the example batch holds no tensors")
    return model, batch


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def model_dtype(model: nn.Module) -> tuple[str, str]:
    """(dtype, where it was read) of a factory's model: a transformers config's `dtype`, else its floating-point
    parameters' dtype when they share one, else fp32."""
    config = getattr(model, "config", None)
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named.removeprefix("torch."), None)
    if named in _DTYPE_NAMES:
        return _DTYPE_NAMES[named], "its config's dtype"
    found = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if len(found) == 1 and next(iter(found)) in _DTYPE_NAMES:
        return _DTYPE_NAMES[found.pop()], "its parameters' dtype"
    return "fp32", "the default"


def model_loss(out: Any) -> torch.Tensor | None:
    """The loss in a forward's result: the tensor itself, or its `.loss` (the transformers convention)."""
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__
