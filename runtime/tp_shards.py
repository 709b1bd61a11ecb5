"""What tensor parallelism did to a block's parameters: each one's shard of the full tensor (ShardInfo, TPLayout)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

@dataclass(frozen=True, slots=True)
class ShardInfo:
    """How one local parameter maps to the unsharded block's parameter of the same name.

    full = torch.cat([shard of tp rank 0, ..., shard of tp rank parts-1], dim); dim None means replicated
    (every tp rank holds the full tensor, index 0 and parts 1).
    """

    full_name: str
    dim: int | None
    index: int
    parts: int
    full_shape: tuple[int, ...]

    def full_slice(self) -> tuple[slice, ...]:
        """The index of this shard inside the full tensor: full[info.full_slice()] == local."""
        if self.dim is None:
            return (slice(None),)
        size = self.full_shape[self.dim] // self.parts
        return (slice(None),) * self.dim + (slice(self.index * size, (self.index + 1) * size),)


@dataclass(frozen=True, slots=True)
class TPLayout:
    """What apply_tp did to a block: its tp size, this rank's tp rank, and every sharded parameter's ShardInfo."""

    tp: int
    tp_rank: int
    shards: dict[str, ShardInfo]
    sequence_parallel: bool = False


LAYOUT_ATTR = "_mmplan_tp_layout"


def full_parameter_names(block: nn.Module) -> dict[str, ShardInfo]:
    """Every local parameter name -> ShardInfo (full name, sharded dim or None, shard index, parts, full shape).

    Works on blocks with and without TP applied (then all are replicated). Names are unchanged by apply_tp,
    so full_name == local name; it is spelled out so checkpoint code need not rely on that.
    """
    layout: TPLayout | None = getattr(block, LAYOUT_ATTR, None)
    shards = layout.shards if layout is not None else {}
    return {
        name: shards.get(name, ShardInfo(name, None, 0, 1, tuple(p.shape))) for name, p in block.named_parameters()
    }
