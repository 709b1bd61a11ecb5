"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2): under tensor parallelism, the parts of a transformer layer outside its attention and
MLP regions (norms, residual adds, dropout) run on a 1/tp slice of the sequence instead of on replicas.

Shapes: block inputs and outputs are (B, S, D); the sequence dim is 1 and tp rank r holds positions
[r*S/tp, (r+1)*S/tp). Per region (attention or MLP) of a sequence-parallel block:

    entry  g-bar = gather_for_region: all-gather along the sequence forward, reduce-scatter of the gradient
           backward (each tp rank's region computed a partial gradient of the full input);
    exit   the row-parallel linear reduce-scatters its partial outputs (instead of g's all-reduce); backward
           all-gathers the gradient.
Same communication volume as TP's two all-reduces (an all-reduce is a reduce-scatter plus an all-gather).

Padding (as Megatron-LM pads): where tp does not divide S, the run carries S' = ceil(S/tp)*tp positions, the last
S' - S zeros appended where the run slices its input. Every region entry drops them after its all-gather (attention
and the MLP see exactly the S real positions: no mask needed) and its row-parallel exit pads its partial sums again
before the reduce-scatter; the run's exit drops them. Norms and residual adds compute garbage (finite) values on
the padded positions, which nothing reads: every gradient flowing back into them is zero (the exits' backward pads
with zeros, the region entries' backward too), so they add nothing to any parameter's gradient and the loss and
gradients equal the unpadded ones. The true S reaches the regions of a run through a SequenceRun the run's blocks
share (set at the run's entry, read while one of its blocks runs its forward, a full recompute included).

Memory: the region's column-parallel linears save their input, the *gathered* (B, S, D) tensor; as in
Megatron-LM (which re-gathers in the backward) we save only this rank's sequence slice and all-gather it
again when the backward unpacks it (`_RegatherSaved`, chained onto whatever saved-tensor hooks are active,
so the memory tiers still see and place the slice). So a layer saves sbh(34/t + 5as/(ht)) in Table 2's terms.

Between consecutive sequence-parallel blocks of one stage the block outputs stay sliced; where a block's
input comes from elsewhere (glue, another stage, a block that is not sequence-parallel) it is sliced on
entry (`scatter_to_sequence`, no communication), and where its output leaves the run (a route, glue, the
loss, a non-SP block) it is all-gathered (`gather_from_sequence`), so everything outside a run is replicated
on the tp ranks as plain tensor parallelism has it. Parameters outside the regions (norm weights, row-parallel
biases) now see only their slice of the sequence: their gradients are partial and are all-reduced over the
tp group once per step (`sync_sequence_parallel_grads`), before the data-parallel reduction.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.grad_buckets import all_reduce_grads
from runtime.tp_shards import full_parameter_names

SEQ_DIM = 1  # (B, S, D)


# ----------------------------------------------------------------------------------------------- padding
def padded_length(length: int, tp: int) -> int:
    """The sequence length rounded up to a multiple of tp (what each run of sequence-parallel blocks carries)."""
    return -(-length // tp) * tp


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """x with zero positions appended along the sequence up to `length` (x itself when it is that long)."""
    short = length - x.shape[SEQ_DIM]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[SEQ_DIM] = short
    return torch.cat([x, x.new_zeros(shape)], dim=SEQ_DIM)


def _strip(x: torch.Tensor, length: int | None) -> torch.Tensor:
    """The first `length` positions of x along the sequence, contiguous (x itself when it has no padding)."""
    if length is None or x.shape[SEQ_DIM] == length:
        return x
    return x.narrow(SEQ_DIM, 0, length).contiguous()


class SequenceRun:
    """The true sequence length of one run of sequence-parallel blocks: set where the run slices its input, read by
    every region of the run (a slice of a padded sequence does not say how much of it is padding)."""

    __slots__ = ("length",)

    def __init__(self) -> None:
        self.length: int | None = None


_RUNNING: list[SequenceRun] = []  # the runs whose blocks are in their forward now (innermost last)


def _true_length(local: int, tp: int) -> int:
    """The unpadded length of a sequence whose slices hold `local` positions: the running run's, else local * tp."""
    length = _RUNNING[-1].length if _RUNNING else None
    return length if length is not None and padded_length(length, tp) == local * tp else local * tp


# ----------------------------------------------------------------------------------------------- collectives
def split_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This tp rank's contiguous slice of x along the sequence, as a tensor of its own (not a view); a sequence tp
    does not divide is padded with zeros to the next multiple first (Megatron-LM pads likewise)."""
    tp = dist.get_world_size(group)
    x = _pad(x, padded_length(x.shape[SEQ_DIM], tp))
    return x.chunk(tp, dim=SEQ_DIM)[dist.get_rank(group)].contiguous()


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, length: int | None = None) -> torch.Tensor:
    """The tp ranks' slices concatenated along the sequence, in tp-rank order; the padding past `length` dropped."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return _strip(torch.cat(parts, dim=SEQ_DIM), length)


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of x over the tp ranks, this rank keeping its slice of the (zero-padded) sequence."""
    tp = dist.get_world_size(group)
    x = _pad(x, padded_length(x.shape[SEQ_DIM], tp))
    flat = x.transpose(0, SEQ_DIM).contiguous()  # (S, B, D): the collective splits dim 0
    out = flat.new_empty((flat.shape[0] // tp, *flat.shape[1:]))
    _reduce_scatter(out, flat, group=group)
    return out.transpose(0, SEQ_DIM).contiguous()  # (B, S/tp, D)


class _ScatterToSequence(torch.autograd.Function):
    """Replicated (B, S, D) -> this rank's (B, ceil(S/tp), D); backward all-gathers the slices' gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.length = group, x.shape[SEQ_DIM]
        return split_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_sequence(grad, ctx.group, ctx.length), None


class _GatherFromSequence(torch.autograd.Function):
    """Slices -> the full sequence, padding dropped. Backward: a region's entry reduce-scatters (its tp ranks computed
    partial gradients of the full input); a run's exit just slices (the gradient from replicated code is identical).
    The padded positions get zero gradients either way, so they change no parameter's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, reduce: bool, length: int | None) -> torch.Tensor:
        ctx.group, ctx.reduce = group, reduce
        return all_gather_sequence(x, group, length)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce:
            return reduce_scatter_sequence(grad, ctx.group), None, None, None
        return split_sequence(grad, ctx.group), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Partial (B, S, D) sums -> this rank's slice of their (padded) sum; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.length = group, partial.shape[SEQ_DIM]
        return reduce_scatter_sequence(partial, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_gather_sequence(grad, ctx.group, ctx.length), None


def scatter_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: Any, *, reduce_grad: bool, length: int | None = None) -> torch.Tensor:
    return _GatherFromSequence.apply(x, group, reduce_grad, length)


def reduce_scatter_to_sequence(partial: torch.Tensor, group: Any) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(partial, group)


# ----------------------------------------------------------------------------------------------- saved slices
class _Regather:
    """What autograd holds for a saved view of a region's gathered input: this rank's slice (packed by the
    hooks underneath) and the view's geometry; the gathered tensor is rebuilt once per backward, shared by
    the region's linears, and dropped after the last of them unpacked it."""

    __slots__ = ("full", "group", "inner", "length", "unpack", "views")

    def __init__(self, inner: Any, unpack: Any, group: Any, length: int | None) -> None:
        self.inner, self.unpack, self.group, self.length = inner, unpack, group, length
        self.full: torch.Tensor | None = None
        self.views = 0

    def take(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        if self.full is None:
            self.full = all_gather_sequence(self.unpack(self.inner), self.group, self.length)
        full = self.full
        self.views -= 1
        if self.views <= 0:
            self.full = None
        return full.as_strided(size, stride, offset)


class _RegatherSaved:
    """Saved-tensor hooks, chained onto the active ones, that store views of `full` (the all-gather of
    `local`) as `local` plus their geometry, and all-gather again when the backward needs them."""

    def __init__(self, full: torch.Tensor, local: torch.Tensor, group: Any, length: int | None = None) -> None:
        self.full, self.local, self.group, self.pushed = full, local.detach(), group, False
        self.length = length

    def __enter__(self) -> None:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        hooks = top(True) if top is not None else None
        inner_pack, inner_unpack = hooks if hooks is not None else (_identity, _identity)
        key = self.full.untyped_storage()._cdata
        holder: list[_Regather] = []

        def pack(t: torch.Tensor) -> Any:
            try:
                same = t.untyped_storage()._cdata == key
            except (RuntimeError, NotImplementedError):
                same = False
            if not same or not self.full.is_contiguous():
                return ("t", inner_pack(t))
            if not holder:
                holder.append(_Regather(inner_pack(self.local), inner_unpack, self.group, self.length))
            holder[0].views += 1
            return ("g", holder[0], t.size(), t.stride(), t.storage_offset())

        def unpack(packed: Any) -> torch.Tensor:
            if packed[0] == "t":
                return inner_unpack(packed[1])
            _, h, size, stride, offset = packed
            return h.take(size, stride, offset)

        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        self.pushed = True

    def __exit__(self, *exc: object) -> None:
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pushed = False
        self.full = self.local = None


def _identity(t: Any) -> Any:
    return t


def sequence_parallel_region(region: nn.Module, group: Any) -> None:
    """Make `region` (an attention or MLP whose row-parallel linear reduce-scatters) take a sequence slice:
    all-gather on entry, save only the slice for its linears (re-gathered in the backward)."""
    inner = region.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        length = _true_length(x.shape[SEQ_DIM], dist.get_world_size(group))
        full = gather_from_sequence(x, group, reduce_grad=True, length=length)  # padding dropped: attention sees S
        with _RegatherSaved(full, x, group, length):
            return inner(full, *args, **kwargs)

    region.forward = forward  # an instance attribute: nn.Module.__call__ finds it first


# ----------------------------------------------------------------------------------------------- runs
def set_sequence_ends(block: nn.Module, group: Any, *, scatter_in: bool, gather_out: bool,
                      run: SequenceRun | None = None) -> None:
    """Where `block` starts or ends a run of sequence-parallel blocks: slice its replicated input, gather its
    output for replicated consumers. Inside a run, block outputs stay sliced. `run`, shared by the run's blocks,
    carries the true sequence length from the run's entry to its regions and its exit (padding: a sequence tp does
    not divide); without one a block knows the length only where it slices its input."""
    inner = block.forward
    run = run if run is not None else SequenceRun()

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if scatter_in:
            run.length = x.shape[SEQ_DIM]
            x = scatter_to_sequence(x, group)
        _RUNNING.append(run)
        try:
            out = inner(x, *args, **kwargs)
        finally:
            _RUNNING.pop()
        if not gather_out:
            return out
        length = run.length if run.length is not None else out.shape[SEQ_DIM] * dist.get_world_size(group)
        return gather_from_sequence(out, group, reduce_grad=False, length=length)

    block.forward = forward


def sequence_runs(program: Any, blocks: Iterable[str], capable: set[str], leaving: set[str]) -> dict[str, tuple[bool, bool]]:
    """block -> (scatter_in, gather_out) for the sequence-parallel blocks of a stage.

    A block's output stays sliced only when its one and only reader is the next sequence-parallel block, which
    takes it as its first argument, and no route carries it out of the stage (`leaving`); every other output
    is gathered, and a block whose input is not such a sliced output slices it itself.
    """
    by_node = {program.blocks[b]: b for b in blocks if b in program.blocks}
    inner_out: set[str] = set()
    for node, b in by_node.items():
        # no fx graph (a model running its own forward, runtime/forward_program.py): every block gathers and slices
        if b not in capable or b in leaving or len(getattr(node, "users", ())) != 1:
            continue
        (user,) = node.users
        reader = by_node.get(user)
        if reader in capable and user.args and user.args[0] is node and node not in user.args[1:] \
                and node not in user.kwargs.values():
            inner_out.add(b)
    sliced_in = {by_node[next(iter(program.blocks[b].users))] for b in inner_out}
    return {b: (b not in sliced_in, b not in inner_out) for b in blocks if b in capable}


def sequence_parallel_params(block: nn.Module) -> list[nn.Parameter]:
    """The replicated parameters of a sequence-parallel block (norms, row-parallel biases): partial gradients."""
    infos = full_parameter_names(block)
    return [p for n, p in block.named_parameters() if infos[n].dim is None]


def sync_sequence_parallel_grads(params: list[nn.Parameter], group: Any) -> None:
    """Sum the partial gradients of sequence-parallel replicated parameters over the tp group (one flat
    all-reduce); afterwards every tp rank holds the full, identical gradient."""
    all_reduce_grads(params, group)
