"""What the analysis pass records: each block's record, input specs and the trace state its hooks and modes share."""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from runtime.tensor_tree import tensors_in

_aten = torch.ops.aten


@dataclass
class BlockRecord:
    """What the analysis pass learns about one block (mutable while the pass runs)."""

    name: str
    module: nn.Module
    order: int = -1
    activation_bytes: int = 0
    output_bytes: int = 0
    reduces_batch: bool = False
    in_spec: Any = None  # (args, kwargs) with tensors replaced by TensorSpec, for measuring
    signature: str = ""
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    # by op class (see _FlopCount): [forward, backward]
    matmul_flops: list = field(default_factory=lambda: [0.0, 0.0])
    attention_flops: list = field(default_factory=lambda: [0.0, 0.0])
    memory_bytes: list = field(default_factory=lambda: [0.0, 0.0])
    replicated_memory_bytes: float = 0.0  # of memory_bytes[0]: forward ops outside every tensor-parallel region
    matmuls: int = 0
    ops: list = field(default_factory=lambda: [0, 0])  # aten ops dispatched for the block: [forward, backward]
    sequence: int = 0  # dim 1 of a 3-D first input (batch, sequence, hidden): sequence parallelism needs tp to divide it
    gemms: list = field(default_factory=lambda: [{}, {}])  # [fwd, bwd]: (flops, bytes) of a GEMM kernel -> count
    # forward GEMMs run inside a region but outside its Linears (QK^T and AV of a math attention), by region call:
    # call id -> {(flops, bytes): count}; those of an attention region are its core's (see _core_gemms)
    region_gemms: dict = field(default_factory=dict)
    param_shapes: frozenset = frozenset()  # shapes of the block's parameters (their gradients are not activations)
    # saved storages by tensor-parallel class (see _classify_saved): (bytes, kind, module call) in saving order
    saved: list = field(default_factory=list)
    # an nn.Embedding in the block looked up one of the block's own inputs (token ids; not a position buffer)
    embeds_input: bool = False


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    value: Any = field(default=None, compare=False)  # a small integer input's real values (lengths, cu_seqlens)


@dataclass
class Trace:
    """Shared state of the hooks and modes during the analysis pass."""

    records: dict[str, BlockRecord]
    param_storages: set[int]
    current: str | None = None
    last_finished: str | None = None
    executed: int = 0
    provenance: dict[int, frozenset] = field(default_factory=dict)  # id(tensor) -> {(src, leaf, nbytes)}
    alive: list = field(default_factory=list)  # keeps traced tensors alive so their ids stay unique
    seen_storages: set[int] = field(default_factory=set)
    saved_at: dict[int, tuple[str, int]] = field(default_factory=dict)  # storage -> (owner block, index in its saved)
    edges: dict[tuple[str, str], dict[tuple[str, int], int]] = field(default_factory=lambda: defaultdict(dict))
    heads: set[str] = field(default_factory=set)  # LM heads the runtime can make vocabulary-parallel (HeadPaths)
    max_seq: int = -1  # highest autograd-node sequence number created so far
    seq_ranges: list = field(default_factory=list)  # [(first, last, block)] autograd nodes each block call made
    glue_flops: float = 0.0
    loss: tuple[str, ...] = ()  # blocks whose outputs the forward's result derives from
    ops: set = field(default_factory=set)  # names of the FLOP-counted ops that ran
    stack: list = field(default_factory=list)  # [(module, call id)] of the submodules running inside a block
    calls: int = 0  # submodule calls so far (call ids)
    block_inputs: set = field(default_factory=set)  # ids of the tensors the running block was called with
    last_linear: dict = field(default_factory=dict)  # call id of a Linear-holding module -> its last Linear call id
    attends: set = field(default_factory=set)  # call ids of Linear-holding modules that ran an attention op
    linear_outputs: set = field(default_factory=set)  # storages nn.Linear calls produced (q, k, v, MLP hidden)
    # outputs of memory-bound ops: storage -> [tensor, block, backward, bytes, bytes memory-bound ops read,
    # materialised] (see fuse())
    produced: dict = field(default_factory=dict)
    traffic: list = field(default_factory=list)  # memory-bound ops: (block, backward, outside, reads, writes)
    softmax_grad_in_memory: bool = False  # the softmax backward reads its incoming gradient from memory (see fuse())

    def note_nodes(self, out: Any) -> None:
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                self.max_seq = max(self.max_seq, leaf.grad_fn._sequence_nr())

    def owner_of_node(self, seq: int) -> str | None:
        i = bisect.bisect_right(self.seq_ranges, (seq, float("inf"), "")) - 1
        if i >= 0 and self.seq_ranges[i][0] <= seq <= self.seq_ranges[i][1]:
            return self.seq_ranges[i][2]
        return None

    def owner(self) -> tuple[str | None, int]:
        """The block the running op works for and 0 (forward) or 1 (backward; from the autograd node)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return self.current, 0
        return self.owner_of_node(node._sequence_nr()), 1

    def count(self, flops: float, kind: str = "matmul", nbytes: float = 0.0) -> None:
        owner, backward = self.owner()
        if owner is None:
            self.glue_flops += flops
            return
        rec = self.records[owner]
        if backward:
            rec.bwd_flops += flops
        else:
            rec.fwd_flops += flops
        if kind == "matmul":
            rec.matmul_flops[backward] += flops
            rec.matmuls += 1 - backward
            shape = (flops, nbytes)
            rec.gemms[backward][shape] = rec.gemms[backward].get(shape, 0) + 1
            region = self.region_outside_linears() if not backward else None
            if region is not None:
                kernels = rec.region_gemms.setdefault(region, {})
                kernels[shape] = kernels.get(shape, 0) + 1
        else:
            rec.attention_flops[backward] += flops

    def region_outside_linears(self) -> int | None:
        """The call id of the innermost region (a Linear-holding module) the running op is in, when it is not inside
        one of that region's nn.Linear calls (a math attention's QK^T and AV); None otherwise."""
        if not self.stack or isinstance(self.stack[-1][0], nn.Linear):
            return None
        return next((c for m, c in reversed(self.stack) if holds_linear(m)), None)

    def count_bytes(self, func, args, kwargs, out) -> None:
        """Bytes a memory-bound op reads and writes, for its block; tensors of a parameter's shape (weights,
        weight gradients) are per micro-batch, not per sample, and left out."""
        owner, backward = self.owner()
        if owner is None or getattr(func, "is_view", False) or func._overloadpacket in NO_TRAFFIC:
            return
        outputs = tensors_in(out)
        if not outputs:  # metadata queries (aten.device, sizes) move nothing
            return
        rec = self.records[owner]
        outside = not backward and not any(holds_linear(m) for m, _ in self.stack)
        reads = [(self.produced.get(x.untyped_storage()._cdata), tensor_bytes(x)) for x in tensors_in((args, kwargs))
                 if tuple(x.shape) not in rec.param_shapes]
        if self.softmax_grad_in_memory and func._overloadpacket is _aten._softmax_backward_data:
            for entry, _ in reads:  # made by a kernel of its own (Megatron-LM's attention-dropout backward)
                if entry is not None:
                    entry[5] = True
        writes = []
        for x in outputs:
            if tuple(x.shape) not in rec.param_shapes:
                entry = [x, owner, backward, tensor_bytes(x), 0, False]
                self.produced[x.untyped_storage()._cdata] = entry
                writes.append(entry)
        self.traffic.append((owner, backward, outside, reads, writes))

    def note_reads(self, args, kwargs, memory_bound: bool) -> None:
        """An op reads its inputs: a memory-bound op of the same block and pass could read them in the same fused
        kernel as their producer; anything else (a GEMM, attention, another block, glue) needs them in memory."""
        where = self.owner()
        for x in tensors_in((args, kwargs)):
            entry = self.produced.get(x.untyped_storage()._cdata)
            if entry is not None:
                if memory_bound and (entry[1], entry[2]) == where:
                    entry[4] += tensor_bytes(x)  # what this read moves (a view may be part of the storage)
                else:
                    entry[5] = True

    def materialise(self, t: torch.Tensor) -> None:
        """`t` is saved for backward or leaves its block: it is written to memory whatever kernels surround it."""
        entry = self.produced.get(t.untyped_storage()._cdata)
        if entry is not None:
            entry[5] = True

    def fuse(self, fused: bool = True) -> None:
        """Memory-bound traffic as fused kernels move it: a tensor a memory-bound op makes and only memory-bound ops
        of the same block and pass read -- never saved, never an output, never a GEMM's input -- stays on chip
        when the chain is one kernel (Megatron-LM / Transformer Engine fuse bias-GeLU, bias-dropout-add,
        scale-mask-softmax and the norms). `fused=False`: as eager PyTorch moves it, one kernel per op, each op's
        write and every read (a run that executed the model so: Hugging Face models without torch.compile).
        `softmax_grad_in_memory` (set by analyse): the softmax backward is a kernel of its own that reads its incoming
        gradient from memory, so that gradient is written and read back even under `fused` -- Megatron-LM runs the
        attention dropout as a separate torch kernel after its FusedScaleMaskSoftmax (megatron/model/transformer.py
        ParallelAttention / CoreAttention: `scale_mask_softmax`, then `attention_dropout` under the RNG tracker,
        de7dc40f88 and 9aad9203aa), so the dropout's backward writes the probabilities' gradient that the fused
        softmax backward (scaled_upper_triang_masked_softmax's own kernel) reads."""
        def on_chip(entry, owner, backward) -> bool:
            return fused and entry is not None and entry[4] > 0 and not entry[5] and (entry[1], entry[2]) == (owner, backward)

        for owner, backward, outside, reads, writes in self.traffic:
            moved = sum(n for entry, n in reads if not on_chip(entry, owner, backward))
            moved += sum(entry[3] for entry in writes if not on_chip(entry, owner, backward))
            rec = self.records[owner]
            rec.memory_bytes[backward] += moved
            if outside:
                rec.replicated_memory_bytes += moved
        self.produced.clear()
        self.traffic.clear()

    def note_attention(self) -> None:
        """An attention op (softmax, SDPA) ran: the innermost Linear-holding module is an attention core."""
        for module, call in reversed(self.stack):
            if holds_linear(module):
                self.attends.add(call)
                return

    def tag(self, t: torch.Tensor, prov: frozenset) -> None:
        self.provenance[id(t)] = self.provenance.get(id(t), frozenset()) | prov
        self.alive.append(t)

    def prov_of(self, tree: Any) -> frozenset:
        leaves, _ = tree_flatten(tree)
        out: frozenset = frozenset()
        for x in leaves:
            if isinstance(x, torch.Tensor):
                out |= self.provenance.get(id(x), frozenset())
        return out


# ops that move no data (allocation, metadata); views are recognised by OpOverload.is_view
NO_TRAFFIC = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.detach, _aten.lift_fresh, _aten.alias,
               _aten._local_scalar_dense, _aten._unsafe_view, _aten.arange, _aten.scalar_tensor, _aten.zeros, _aten.ones, _aten.full}


SOFTMAX = {_aten._softmax, _aten._safe_softmax} if hasattr(_aten, "_safe_softmax") else {_aten._softmax}


def holds_linear(module: nn.Module) -> bool:
    """A tensor-parallel region (an attention, an MLP): a module with nn.Linear children."""
    return any(isinstance(c, nn.Linear) for c in module.children())


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

