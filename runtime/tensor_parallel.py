"""Megatron-style tensor parallelism for the zoo's transformer blocks: shard a block's weights over a tp group.

Vocabulary: "tp" is the tensor-parallel size (ranks in the group), "tp rank" a rank's index in that group,
"dim" a tensor dim. Column-parallel = the output features (dim 0 of an nn.Linear weight) are split,
row-parallel = the input features (dim 1) are split (Shoeybi et al. 2019, "Megatron-LM", section 3, fig. 3).

The plan, per tensor-parallel *region* (an attention or an MLP inside a block):

    attention  wq, wk, wv column-parallel by heads: tp rank r keeps query heads [r*H/tp, (r+1)*H/tp) and kv heads
               [r*Hkv/tp, (r+1)*Hkv/tp), which are exactly the kv heads those query heads read (GQA groups are
               contiguous: query head j reads kv head j // (H/Hkv)); wo row-parallel.
    SwiGLU     w1, w3 column-parallel, w2 row-parallel.    GELU MLP   fc1 column-parallel, fc2 row-parallel.

Every shard is one contiguous, equal chunk of the full weight along one dim, so the full weight is
torch.cat(shards in tp-rank order, dim) and numerics equal the unsharded block up to float summation order.
The attention modules read their head counts from the weight shapes (`view(B, S, -1, head_dim)` and
`attend`), so nothing else needs updating after the weights are sliced.

Communication is two autograd functions of our own, which run on gloo and NCCL alike:
    f = copy_to_tp_region      identity forward, all-reduce of the gradient backward; on every region input
                               (a forward pre-hook on the attention / MLP module: one all-reduce per region and
                               input, not one per column-parallel linear)
    g = reduce_from_tp_region  all-reduce forward, identity backward; inside each row-parallel linear, before
                               its bias, so the bias is added once, after the reduction.
Hence 2 all-reduces forward and 2 backward per transformer layer (+1 backward for a cross-attention's context).

Why replicated parameters (norms, row-parallel biases, Flamingo gates) need no gradient all-reduce: every
tensor outside the regions is bitwise identical on all tp ranks — the block input is, and each region's
output leaves through g, an all-reduce, which gloo and NCCL compute bitwise identically on every rank. In
backward the same holds for the gradients: the block output's gradient is identical by assumption (the
ranks compute the same loss, or receive the same gradient), and a region hands its input gradient back
through f, again an all-reduce. A replicated parameter sits outside every region, so it sees identical
activations and identical gradients on every tp rank and gets an identical gradient. check_tp rejects a
region holding parameters other than its sharded linears (e.g. per-head q/k norms), which would break this.

GQA with tp > kv_heads (replicating kv heads across ranks) is not supported: the replicated wk/wv would get
partial gradients needing an extra all-reduce among the ranks sharing a kv head, i.e. more process groups.
We require kv_heads % tp == 0 instead (the simpler correct option; LLaMA-2/3 70B has kv_heads = 8 = common tp).

Apply TP before building the optimizer, DDP/FSDP or anything else that holds references to the parameters:
apply_tp replaces the sharded parameters with new, smaller ones.
"""
from __future__ import annotations

import math

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plans.capabilities import (SEQUENCE_PARALLEL_KINDS, TP_DIVIDES, TP_REGIONS, TP_REPLICATED_KINDS, Style)
from plans.errors import MmplanError

from .models.flamingo import FlamingoLayer, GatedCrossAttention
from .models.layers import Attention, CrossAttention, GeluMLP, SwiGLU, TransformerLayer
from .models.projector import Projector
from .sequence_parallel import reduce_scatter_to_sequence, sequence_parallel_region
from .tp_shards import LAYOUT_ATTR, ShardInfo, TPLayout, full_parameter_names  # noqa: F401  (full_parameter_names: callers)

# The kinds plans/capabilities.py names, as the classes this runtime implements them with.
KIND_CLASSES: dict[str, type[nn.Module]] = {c.__name__: c for c in (
    TransformerLayer, FlamingoLayer, Attention, CrossAttention, SwiGLU, GeluMLP, GatedCrossAttention, nn.LayerNorm,
    Projector)}
# The TP plan as data (plans/capabilities.TP_REGIONS): region class -> {linear's attribute name: style}.
REGION_PLANS: dict[type[nn.Module], dict[str, Style]] = {KIND_CLASSES[k]: plan for k, plan in TP_REGIONS.items()}
# The dim of an nn.Linear weight each style splits (biases: dim 0 for colwise, replicated for rowwise).
_WEIGHT_DIM: dict[Style, int] = {"colwise": 0, "rowwise": 1}
# Modules that may hold parameters outside the regions (replicated ones) in a supported block.
_REPLICATED_OK = tuple(KIND_CLASSES[k] for k in TP_REPLICATED_KINDS)
_SEQUENCE_PARALLEL = tuple(KIND_CLASSES[k] for k in SEQUENCE_PARALLEL_KINDS)


# ----------------------------------------------------------------------------------------------- f and g
class _CopyToTPRegion(torch.autograd.Function):
    """f: identity forward; backward all-reduces the gradient (sums the tp ranks' partial input gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # a copy, not in place: autograd may hand the same gradient tensor to several consumers
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce forward (sums the row-parallel partial outputs); identity backward."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        if partial.is_contiguous():
            ctx.mark_dirty(partial)  # reduce in place: the matmul result is not needed by its backward
        else:
            partial = partial.contiguous()
        dist.all_reduce(partial, group=group)
        return partial

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp_region(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's f: x unchanged; its gradient is all-reduced over `group` in backward."""
    return _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Megatron's g: the sum of `partial` over `group` (all-reduce); the gradient passes through unchanged."""
    return _ReduceFromTPRegion.apply(partial, group)


class RowParallelLinear(nn.Linear):
    """An nn.Linear whose weight holds a slice of the input features: y = g(x_local W_local^T) + b.

    The bias is replicated and added after the all-reduce, so it counts once. Parameter names (weight, bias)
    stay those of the nn.Linear it replaces.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: dist.ProcessGroup | None,
                 *, sequence_parallel: bool = False) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a full-size weight
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.group = group
        self.sequence_parallel = sequence_parallel  # reduce-scatter along the sequence instead of all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(F.linear(x, self.weight), self.group)
        else:
            out = reduce_from_tp_region(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


def _region_entry_hook(group: dist.ProcessGroup | None):
    """A forward pre-hook applying f to every tensor argument of a region (x; and context for cross-attention)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def f(a: Any) -> Any:
            return copy_to_tp_region(a, group) if isinstance(a, torch.Tensor) else a

        return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}

    return hook


# ----------------------------------------------------------------------------------------------- checks
# A block may carry its own plan (Hugging Face blocks, from the model's `base_model_tp_plan`; runtime/hf.py):
# {region path inside the block: {linear attribute: style}}.
PLAN_ATTR = "_mmplan_tp_plan"


def supports_tp(block: nn.Module) -> bool:
    """True for blocks whose class says supports_tensor_parallel = True (the zoo's TransformerLayer, FlamingoLayer)
    and for blocks carrying their own plan (PLAN_ATTR)."""
    return getattr(type(block), "supports_tensor_parallel", False) is True or bool(getattr(block, PLAN_ATTR, None))


def _region_plans(block: nn.Module) -> dict[str, dict[str, Style]]:
    own = getattr(block, PLAN_ATTR, None)
    if own:
        return own
    return {name: REGION_PLANS[type(m)] for name, m in block.named_modules() if type(m) in REGION_PLANS}


def _regions(block: nn.Module) -> dict[str, nn.Module]:
    """The block's tensor-parallel regions (attentions and MLPs) by module path."""
    return {name: block.get_submodule(name) for name in _region_plans(block)}


def _listed_size(region: nn.Module, kind: str, what: str) -> int:
    """One size plans/capabilities.TP_DIVIDES lists for a region kind: (kv) heads, or the MLP's width (the out
    features of its first column-parallel linear)."""
    if what == "heads":
        return region.wq.out_features // region.head_dim
    if what == "kv_heads":
        return region.wk.out_features // region.head_dim
    first = next(attr for attr, style in TP_REGIONS[kind].items() if style == "colwise")
    return getattr(region, first).out_features


def _region_sizes(region: nn.Module, plan: dict[str, Style]) -> dict[str, int]:
    """What tp must divide in a region: the sizes plans/capabilities.TP_DIVIDES lists for a zoo region, else
    each sharded width of a block's own plan (in heads when the region has a head_dim)."""
    kind = type(region).__name__
    if type(region) in REGION_PLANS:
        return {what: _listed_size(region, kind, what) for what in TP_DIVIDES[kind]}
    head_dim = getattr(region, "head_dim", None)
    sizes = {}
    for attr, style in plan.items():
        linear = getattr(region, attr)
        width = linear.out_features if style == "colwise" else linear.in_features
        sizes[f"{attr} {'heads' if head_dim else 'width'}"] = width // head_dim if head_dim else width
    return sizes


def check_tp(block: nn.Module, tp: int) -> None:
    """Raise MmplanError unless apply_tp(block, ..., tp) can shard the block exactly.

    Names the block class and the size tp does not divide: heads, kv_heads or the MLP width.
    """
    cls = type(block).__name__
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise MmplanError(f"{cls}: tensor-parallel size must be a positive integer, got {tp!r}")
    if not supports_tp(block):
        raise MmplanError(f"{cls} does not support tensor parallelism (no supports_tensor_parallel = True)")
    if getattr(block, LAYOUT_ATTR, None) is not None:
        raise MmplanError(f"{cls}: tensor parallelism was already applied to this block")
    regions = _regions(block)
    if not regions:
        raise MmplanError(f"{cls}: found no attention or MLP to shard")
    plans = _region_plans(block)
    for path, region in regions.items():
        plan = plans[path]
        extra = [n for n, _ in region.named_parameters() if n.split(".")[0] not in plan]
        if extra:
            raise MmplanError(f"{cls}.{path}: parameters {extra} would be neither sharded nor replicated correctly")
    for path, what, size in _divided_sizes(block):
        if size % tp:
            raise MmplanError(f"{cls}: tp={tp} does not divide {path}'s {what}={size}; pick a tp that divides {size}")
    _check_replicated(block, regions)


def _divided_sizes(block: nn.Module) -> list[tuple[str, str, int]]:
    """(region path, what, size) of every size tensor parallelism must divide in the block."""
    out, plans = [], _region_plans(block)
    for path, region in _regions(block).items():
        out += [(path, what, size) for what, size in _region_sizes(region, plans[path]).items()]
    return out


def tp_divisor(block: nn.Module) -> int:
    """The greatest common divisor of the sizes tensor parallelism must divide (heads, kv heads, widths): a tp
    degree shards the block exactly only if it divides this (check_tp). 0 when the block has no such size."""
    if not supports_tp(block):
        return 0
    return math.gcd(*(size for _, _, size in _divided_sizes(block)))


def _check_replicated(block: nn.Module, regions: dict[str, nn.Module]) -> None:
    """Parameters outside the regions must sit where f/g make them identical: norms or Flamingo gates."""
    in_region = {_join(path, n) for path, r in regions.items() for n, _ in r.named_parameters()}
    for name, _ in block.named_parameters():
        if name in in_region:
            continue
        owner = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
        if not isinstance(owner, _REPLICATED_OK) and "norm" not in type(owner).__name__.lower():
            raise MmplanError(f"{type(block).__name__}: parameter {name} is outside any attention/MLP; cannot shard")


# ----------------------------------------------------------------------------------------------- apply
def _join(path: str, name: str) -> str:
    """A name inside a region at `path` ("" where the block is its own region: the projector)."""
    return f"{path}.{name}" if path else name


def _shard(p: nn.Parameter, dim: int, tp_rank: int, tp: int) -> nn.Parameter:
    """This rank's contiguous chunk of p along dim, as a new parameter owning its memory (frees the full one)."""
    piece = p.detach().chunk(tp, dim=dim)[tp_rank].clone(memory_format=torch.contiguous_format)
    return nn.Parameter(piece, requires_grad=p.requires_grad)


def supports_sequence_parallel(block: nn.Module) -> bool:
    """Blocks whose regions all read the block's sequence (self-attention and MLPs): plans/capabilities'
    SEQUENCE_PARALLEL_KINDS (the zoo's TransformerLayer)."""
    return isinstance(block, _SEQUENCE_PARALLEL)


def apply_tp(block: nn.Module, tp_group: dist.ProcessGroup | None, tp_rank: int, tp: int, *,
             sequence_parallel: bool = False) -> nn.Module:
    """Shard `block` in place over `tp_group` (this process is `tp_rank` of `tp`) and return it.

    After the forward every tp rank holds the full, identical output; after the backward the full, identical
    gradient of every block input (x, and a cross-attention's context) and of every replicated parameter.
    tp == 1 leaves the block as it is.

    sequence_parallel (runtime/sequence_parallel.py): the block then takes and returns this rank's slice of
    the sequence (B, S/tp, D); its regions all-gather on entry and reduce-scatter on exit, and its replicated
    parameters get partial gradients (sync_sequence_parallel_grads). The stage decides where runs of such
    blocks start and end (set_sequence_ends).
    """
    check_tp(block, tp)
    if sequence_parallel and not supports_sequence_parallel(block):
        raise MmplanError(f"{type(block).__name__} does not support sequence parallelism (self-attention layers only)")
    if not 0 <= tp_rank < tp:
        raise MmplanError(f"{type(block).__name__}: tp_rank={tp_rank} is outside 0..{tp - 1}")
    if tp == 1:
        return block
    if not dist.is_initialized():
        raise MmplanError(f"{type(block).__name__}: tp={tp} needs an initialised torch.distributed process group")
    group_size, group_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if (group_size, group_rank) != (tp, tp_rank):
        raise MmplanError(
            f"{type(block).__name__}: tp group has size {group_size} and this process is its rank {group_rank},"
            f" but apply_tp was told tp={tp}, tp_rank={tp_rank}"
        )
    shards: dict[str, ShardInfo] = {}
    plans = _region_plans(block)
    for path, region in _regions(block).items():
        for attr, style in plans[path].items():
            linear: nn.Linear = getattr(region, attr)
            prefix = _join(path, attr)
            dim = _WEIGHT_DIM[style]
            shards[f"{prefix}.weight"] = ShardInfo(f"{prefix}.weight", dim, tp_rank, tp, tuple(linear.weight.shape))
            weight = _shard(linear.weight, dim, tp_rank, tp)
            if style == "colwise":
                linear.weight = weight
                linear.out_features = weight.shape[0]
                if linear.bias is not None:
                    shards[f"{prefix}.bias"] = ShardInfo(f"{prefix}.bias", 0, tp_rank, tp, tuple(linear.bias.shape))
                    linear.bias = _shard(linear.bias, 0, tp_rank, tp)
            else:
                setattr(region, attr, RowParallelLinear(weight, linear.bias, tp_group, sequence_parallel=sequence_parallel))
        if sequence_parallel:
            sequence_parallel_region(region, tp_group)
        else:
            region.register_forward_pre_hook(_region_entry_hook(tp_group), with_kwargs=True)
    setattr(block, LAYOUT_ATTR, TPLayout(tp, tp_rank, shards, sequence_parallel))
    return block
