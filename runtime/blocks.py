"""A model's blocks (the unit of planning) by name, by the profiler's rule; and whether it is a Hugging Face model."""
from __future__ import annotations

from torch import nn

from plans.errors import MmplanError

CONTAINERS = (nn.ModuleList, nn.Sequential)


def block_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Blocks by name, with the profiler's rule: container elements plus maximal container-free modules."""

    def has_container(m: nn.Module) -> bool:
        return any(isinstance(c, CONTAINERS) for c in m.modules())

    found: dict[str, nn.Module] = {}

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if isinstance(m, CONTAINERS) or not has_container(child):
                found[path] = child
            else:
                walk(path + ".", child)

    if isinstance(model, CONTAINERS) or not has_container(model):
        raise MmplanError(f"{type(model).__name__} has no nn.ModuleList/Sequential of layers to cut into blocks")
    walk("", model)
    if is_hf_model(model):  # parameter-free helpers (rotary tables) are glue: every stage computes them itself
        found = {n: m for n, m in found.items() if any(True for _ in m.parameters())}
    return found


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (without importing transformers when it is not loaded)."""
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(model).__mro__)
