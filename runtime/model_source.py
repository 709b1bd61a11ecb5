"""Where a model comes from: a display name, a factory(micro_batch) -> (model, example batch), a default dtype."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

Factory = Callable[[int], tuple[nn.Module, dict[str, Any]]]


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: its display name, a factory(micro_batch) -> (model, batch), default dtype (None:
    the built model's own, runtime.source.model_dtype)."""

    name: str
    factory: Factory
    default_dtype: str | None = "fp32"
