"""The profiling pass: runs the real model once and records blocks, FLOPs, saved activations and data flow.

How each figure is obtained (one forward + backward of the model at `micro_batch`):
- blocks: elements of every nn.ModuleList/Sequential, plus each maximal submodule holding no such container;
  blocks that never run in the forward are dropped;
- FLOPs: torch.utils.flop_counter's per-op formulas, counted by a dispatch mode; a forward op counts for the
  block running, a backward op for the block whose forward created its autograd node (known from the node's
  sequence number: each block's forward creates a contiguous range of them);
- activation bytes: saved_tensors_hooks attribute every storage autograd saves to the block running
  (parameters and buffers excluded, each storage counted once, for the first block that saves it;
  tensors saved by glue code between blocks count for the last block that ran);
- edges: a TorchFunctionMode propagates, through the glue code between blocks, which block outputs each
  tensor derives from; a block's inputs then name the blocks (and batch inputs) that feed it.
With `measure`, each distinct block is timed alone on the device at the micro-batch and at twice it (an
affine fit: small blocks are overhead-bound); when the whole model is on the device (`device="cpu"`) the
whole model's forward + backward is measured too, at both batch sizes, and spread over the blocks in
proportion to their isolated times — what a block costs in context (caches, glue), not in a tight loop.
On `device="meta"` the model is built on the meta device and run on FakeTensors with CPU dispatch, so no
memory is allocated and the kernels (hence FLOPs and saved tensors) are exactly those a real CPU run uses.
"""
from __future__ import annotations

import bisect
import copy
import functools
import hashlib
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any, Callable, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                          UnsupportedOperatorException)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from runtime.program import block_modules, is_frozen, module_structure
from runtime.fake_exec import fake_batch, fakify_module, static_fake
from runtime.source import ModelSource, call_factory, model_loss
from runtime.tensor_parallel import supports_tp, tp_divisor
from runtime.vocab_parallel import HeadPaths
from plans.errors import MmplanError
from plans.graph import Block, Edge, InputEdge, Profile, ProfileOptions, profile_fingerprint

Device = Literal["meta", "cpu", "cuda"]
Progress = Callable[[str, float], None]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_aten = torch.ops.aten

# FLOP formulas by op (torch's, from torch.utils.flop_counter). It has none for the CPU flash-attention
# kernel that SDPA dispatches to on CPU and under FakeTensorMode: it is the same attention maths, so use
# torch's SDPA formulas (which count the full S x S score matrix even when causal).
_FLOP_FORMULAS = {
    **flop_registry,
    _aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop,
}
_GLUE = "(glue)"  # FLOPs of tensor code between blocks (e.g. the loss); not part of any block


def discover_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Blocks in definition order: container elements plus maximal container-free submodules."""
    return list(block_modules(model).items())


def freeze_blocks(model: nn.Module, patterns: Sequence[str], name: str = "the model") -> None:
    """`--freeze`: stop the parameters of every block matching one of `patterns` (fnmatch on block names) from
    requiring grad, so the profile measures what training them frozen costs. A pattern matching no block, or
    patterns leaving no block to train, are errors."""
    if not patterns:
        return
    blocks = block_modules(model)
    for pattern in patterns:
        matched = [b for b in blocks if fnmatchcase(b, pattern)]
        if not matched:
            raise MmplanError(f"--freeze {pattern!r} matches no block of {name} (blocks: {_names_hint(list(blocks))})")
        for b in matched:
            blocks[b].requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise MmplanError(f"--freeze {' '.join(patterns)} freezes every parameter of {name}: nothing would train")


def _names_hint(names: list[str]) -> str:
    return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


def default_group(block_name: str) -> str:
    """Module groups are the model's top-level children; a top-level block is its own group."""
    return block_name.split(".", 1)[0]


def parse_group_overrides(specs: list[str]) -> list[tuple[str, str]]:
    """`PATTERN=GROUP` items (fnmatch on block names, later items win) -> [(pattern, group)]."""
    out = []
    for spec in specs:
        pattern, sep, group = spec.partition("=")
        if not sep or not pattern or not group:
            raise MmplanError(f"--group expects PATTERN=GROUP (e.g. 'llm.head=head'), got {spec!r}")
        out.append((pattern, group))
    return out


@dataclass
class _BlockRecord:
    """What the analysis pass learns about one block (mutable while the pass runs)."""

    name: str
    module: nn.Module
    order: int = -1
    activation_bytes: int = 0
    output_bytes: int = 0
    reduces_batch: bool = False
    in_spec: Any = None  # (args, kwargs) with tensors replaced by _TensorSpec, for measuring
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


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    value: Any = field(default=None, compare=False)  # a small integer input's real values (lengths, cu_seqlens)


@dataclass
class _Trace:
    """Shared state of the hooks and modes during the analysis pass."""

    records: dict[str, _BlockRecord]
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
        return next((c for m, c in reversed(self.stack) if _holds_linear(m)), None)

    def count_bytes(self, func, args, kwargs, out) -> None:
        """Bytes a memory-bound op reads and writes, for its block; tensors of a parameter's shape (weights,
        weight gradients) are per micro-batch, not per sample, and left out."""
        owner, backward = self.owner()
        if owner is None or getattr(func, "is_view", False) or func._overloadpacket in _NO_TRAFFIC:
            return
        outputs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if not outputs:  # metadata queries (aten.device, sizes) move nothing
            return
        rec = self.records[owner]
        outside = not backward and not any(_holds_linear(m) for m, _ in self.stack)
        reads = [(self.produced.get(x.untyped_storage()._cdata), _nbytes(x)) for x in tree_flatten((args, kwargs))[0]
                 if isinstance(x, torch.Tensor) and tuple(x.shape) not in rec.param_shapes]
        if self.softmax_grad_in_memory and func._overloadpacket is _aten._softmax_backward_data:
            for entry, _ in reads:  # made by a kernel of its own (Megatron-LM's attention-dropout backward)
                if entry is not None:
                    entry[5] = True
        writes = []
        for x in outputs:
            if tuple(x.shape) not in rec.param_shapes:
                entry = [x, owner, backward, _nbytes(x), 0, False]
                self.produced[x.untyped_storage()._cdata] = entry
                writes.append(entry)
        self.traffic.append((owner, backward, outside, reads, writes))

    def note_reads(self, args, kwargs, memory_bound: bool) -> None:
        """An op reads its inputs: a memory-bound op of the same block and pass could read them in the same fused
        kernel as their producer; anything else (a GEMM, attention, another block, glue) needs them in memory."""
        where = self.owner()
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                entry = self.produced.get(x.untyped_storage()._cdata)
                if entry is not None:
                    if memory_bound and (entry[1], entry[2]) == where:
                        entry[4] += _nbytes(x)  # what this read moves (a view may be part of the storage)
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
            if _holds_linear(module):
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


class _Provenance(TorchFunctionMode):
    """Outside blocks, every op's outputs derive from the union of its inputs' sources."""

    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.trace.note_nodes(out)
        if self.trace.current is None:
            prov = self.trace.prov_of((args, kwargs))
            if prov:
                for leaf in tree_flatten(out)[0]:
                    if isinstance(leaf, torch.Tensor):
                        self.trace.tag(leaf, prov)
        return out


def dispatched(func) -> bool:
    """Whether an op that reached a dispatch mode is one the host dispatches in a real run (Block.fwd_ops / bwd_ops,
    planner/profiler/host_probe.py): every aten op, not prim's metadata queries, which only a fake tensor answers."""
    return func.namespace != "prim"


class _FlopCount(TorchDispatchMode):
    """Counts every op's work for its block (see the module docstring), by op class: GEMM FLOPs, fused-attention
    FLOPs (halved under a causal mask, which flash kernels skip), and bytes of every other op (memory-bound)."""

    def __init__(self, trace: _Trace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        owner, backward = self.trace.owner()
        if owner is not None and dispatched(func):
            self.trace.records[owner].ops[backward] += 1
        packet = func._overloadpacket
        formula = _FLOP_FORMULAS.get(packet)
        if not getattr(func, "is_view", False) and packet not in _NO_TRAFFIC:
            self.trace.note_reads(args, kwargs, memory_bound=formula is None)
        if formula is not None:
            self.trace.ops.add(packet.__name__)
            flops = formula(*args, **kwargs, out_val=out)
            if "attention" in packet.__name__:
                self.trace.note_attention()
                bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
                self.trace.count(flops / 2 if bound.get("is_causal") else flops, "attention")
                # the op's model FLOPs stay torch's full count in fwd_flops / bwd_flops
                owner, backward = self.trace.owner()
                if owner is not None and bound.get("is_causal"):
                    rec = self.trace.records[owner]
                    if backward:
                        rec.bwd_flops += flops / 2
                    else:
                        rec.fwd_flops += flops / 2
            else:  # a GEMM: its FLOPs and the bytes it reads and writes (its shape, for the roofline)
                nbytes = sum(_nbytes(x) for x in (*tree_flatten((args, kwargs))[0], *tree_flatten(out)[0])
                             if isinstance(x, torch.Tensor))
                self.trace.count(flops, nbytes=nbytes)
        else:
            if packet in _SOFTMAX:
                self.trace.note_attention()
            self.trace.count_bytes(func, args, kwargs, out)
        return out


# ops that move no data (allocation, metadata); views are recognised by OpOverload.is_view
_NO_TRAFFIC = {_aten.empty, _aten.empty_like, _aten.empty_strided, _aten.detach, _aten.lift_fresh, _aten.alias,
               _aten._local_scalar_dense, _aten._unsafe_view, _aten.arange, _aten.scalar_tensor, _aten.zeros, _aten.ones, _aten.full}
_SOFTMAX = {_aten._softmax, _aten._safe_softmax} if hasattr(_aten, "_safe_softmax") else {_aten._softmax}


def _holds_linear(module: nn.Module) -> bool:
    """A tensor-parallel region (an attention, an MLP): a module with nn.Linear children."""
    return any(isinstance(c, nn.Linear) for c in module.children())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _spec(tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    mapped = [_TensorSpec(tuple(x.shape), x.dtype, x.requires_grad, _small_integers(x)) if isinstance(x, torch.Tensor) else x
              for x in leaves]
    return mapped, spec


def _small_integers(x: torch.Tensor) -> torch.Tensor | None:
    """A copy of an integer tensor's values when they are real and small: a block measured alone gets them back
    (Qwen2-VL's vision blocks split by cu_seqlens; zeros there would not even run)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if x.is_floating_point() or isinstance(x, FakeTensor) or x.device.type == "meta" or x.numel() > 1 << 16:
        return None
    return x.detach().cpu().clone()


def _signature(module: nn.Module, in_spec: Any) -> str:
    """Equal for blocks of identical structure fed identically shaped inputs; independent of the batch size,
    the dtype and the device, so it (and the profile's fingerprint) describes the model, not the profiling run."""
    leaves, _ = in_spec
    parts = [type(module).__qualname__, repr(module)]
    parts += [f"{n}:{tuple(p.shape)}" for n, p in module.named_parameters()]
    parts += [f"{n}:{tuple(b.shape)}" for n, b in module.named_buffers()]
    for x in leaves:
        if isinstance(x, _TensorSpec):
            parts.append(f"T{x.shape[1:]}:{x.dtype.is_floating_point}:{x.requires_grad}")
        else:
            parts.append(repr(x) if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__)
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def _install_hooks(trace: _Trace) -> list:
    handles = []
    for rec in trace.records.values():

        def pre(module, args, kwargs, rec=rec):
            if rec.order < 0:
                rec.order = trace.executed
                trace.executed += 1
                rec.in_spec = _spec((args, kwargs))
                first = args[0] if args else next(iter(kwargs.values()), None)
                if isinstance(first, torch.Tensor) and first.dim() == 3:
                    rec.sequence = int(first.shape[1])
            for src, leaf, nbytes in trace.prov_of((args, kwargs)):
                trace.edges[(src, rec.name)][(src, leaf)] = nbytes
            trace.current = rec.name
            trace.seq_ranges.append([trace.max_seq + 1, None, rec.name])

        def post(module, args, kwargs, output, rec=rec):
            trace.note_nodes(output)
            trace.seq_ranges[-1][1] = trace.max_seq
            trace.seq_ranges[-1] = tuple(trace.seq_ranges[-1])
            trace.current = None
            trace.last_finished = rec.name
            leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
            rec.reduces_batch = bool(leaves) and all(x.dim() == 0 for x in leaves)
            for i, leaf in enumerate(leaves):
                rec.output_bytes += _nbytes(leaf)
                trace.materialise(leaf)
                trace.provenance.pop(id(leaf), None)
                trace.tag(leaf, frozenset({(rec.name, i, _nbytes(leaf))}))

        handles.append(rec.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(rec.module.register_forward_hook(post, with_kwargs=True))
        rec.param_shapes = frozenset(tuple(p.shape) for p in rec.module.parameters())
        for sub in rec.module.modules():
            if sub is not rec.module:
                handles.append(sub.register_forward_pre_hook(functools.partial(_enter, trace)))
                handles.append(sub.register_forward_hook(functools.partial(_leave, trace)))
    return handles


def _enter(trace: _Trace, module: nn.Module, args) -> None:
    """A submodule of a block starts: push it; a Linear becomes its region's last Linear so far."""
    trace.calls += 1
    if isinstance(module, nn.Linear):
        region = next((c for m, c in reversed(trace.stack) if _holds_linear(m)), None)
        if region is not None:
            trace.last_linear[region] = trace.calls
    trace.stack.append((module, trace.calls))


def _leave(trace: _Trace, module: nn.Module, args, output) -> None:
    trace.stack.pop()
    if isinstance(module, nn.Linear) and isinstance(output, torch.Tensor):
        trace.linear_outputs.add(output.untyped_storage()._cdata)
        trace.alive.append(output)


def _saved_kind(trace: _Trace, key: int) -> tuple:
    """Where a tensor is saved, for _classify_saved: in a Linear (its input), inside a region, or outside."""
    if not trace.stack:
        return ("outside",)
    module, call = trace.stack[-1]
    if isinstance(module, nn.Linear):
        region = next((c for m, c in reversed(trace.stack[:-1]) if _holds_linear(m)), None)
        return ("linear", call, region)
    region = next((c for m, c in reversed(trace.stack) if _holds_linear(m)), None)
    if region is None:
        return ("outside",)
    return ("region", region, key in trace.linear_outputs)


def _classify_saved(trace: _Trace, rec: "_BlockRecord") -> tuple[int, int]:
    """(replicated, attention core) bytes of a block's saved activations, as Megatron's tensor parallelism stores
    them (Korthikanti et al. 2022, section 4.1; the runtime's plan in runtime/tensor_parallel.py):
    - the region (an attention or MLP module: one holding nn.Linear children) runs sharded: what it saves is
      sharded, except the input its column-parallel Linears save -- a region's last Linear is the row-parallel
      one, whose input is sharded; the others read the region's whole input;
    - what is saved outside every region (norms, residual path, dropout there) is replicated;
    - inside an attention region (one that ran softmax or fused attention), what is saved and was not made by
      a Linear (q, k, v are) is the attention core: scores, softmax, attention dropout, rotary."""
    replicated = core = 0
    for nbytes, kind in rec.saved:
        if kind[0] == "outside" or (kind[0] == "linear" and (kind[2] is None or trace.last_linear.get(kind[2]) != kind[1])):
            replicated += nbytes
        elif kind[0] == "region" and not kind[2] and kind[1] in trace.attends:
            core += nbytes
    return replicated, core


def _core_gemms(trace: _Trace, rec: "_BlockRecord") -> dict:
    """The forward GEMM kernels of a block's attention cores: those run inside an attention region (one that ran
    softmax or fused attention) but outside its Linears -- a math attention's QK^T and AV, which selective
    recompute reruns with the softmax (Korthikanti et al. 2022, section 5)."""
    kernels: dict = {}
    for call, shapes in rec.region_gemms.items():
        if call in trace.attends:
            for shape, n in shapes.items():
                kernels[shape] = kernels.get(shape, 0) + n
    return kernels


def _pack_hook(trace: _Trace):
    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        owner = trace.current or trace.last_finished
        if key not in trace.param_storages and key not in trace.seen_storages and owner is not None:
            trace.seen_storages.add(key)
            trace.records[owner].activation_bytes += storage.nbytes()
            kind = _saved_kind(trace, key) if trace.current == owner else ("outside",)
            trace.saved_at[key] = (owner, len(trace.records[owner].saved))
            trace.records[owner].saved.append((storage.nbytes(), kind))
        elif key in trace.saved_at and trace.current == trace.saved_at[key][0]:
            # saved again, by a Linear: a tensor the attention core saved (its output, the input of the output
            # projection) stays saved for that Linear when selective recompute drops the core's tensors
            kind = _saved_kind(trace, key)
            owner, i = trace.saved_at[key]
            nbytes, first = trace.records[owner].saved[i]
            if kind[0] == "linear" and first[0] == "region":
                trace.records[owner].saved[i] = (nbytes, kind)
        trace.materialise(t)
        return t

    return pack


def _scalar_loss(out: Any) -> torch.Tensor:
    loss = model_loss(out)  # a tensor, or an output object's `.loss` (transformers)
    if loss is not None and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.float().sum()
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise MmplanError("the model's forward returned no floating-point tensor to take a loss from")
    loss = leaves[0]
    return loss if loss.dim() == 0 else loss.float().sum()


def _cast(model: nn.Module, batch: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    model.to(dtype)
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def analyse(model: nn.Module, batch: dict[str, Any], *, fake: bool, fused: bool = True,
            softmax_grad_in_memory: bool = False) -> tuple[list[_BlockRecord], _Trace]:
    """One forward + backward of the model with every probe installed (`fused`, `softmax_grad_in_memory`: _Trace.fuse)."""
    records = {name: _BlockRecord(name, module) for name, module in discover_blocks(model)}
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    restore = lambda: None  # noqa: E731
    if fake:  # integer inputs stay real: data-dependent glue (token masks, grids) gets static shapes
        restore = fakify_module(model, mode)
        batch = fake_batch(batch, mode)
    try:
        storages = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        trace = _Trace(records, storages, softmax_grad_in_memory=softmax_grad_in_memory)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                trace.tag(value, frozenset({(f"input:{key}", 0, _nbytes(value))}))
        handles = _install_hooks(trace)
        heads = HeadPaths()  # the runtime's own rule for a vocabulary-parallel head (runtime/vocab_parallel.py)
        handles += [rec.module.register_forward_hook(functools.partial(lambda n, m, a, o: heads.watch(n, m, o), name))
                    for name, rec in records.items()]
        try:
            with ExitStack() as stack:
                stack.enter_context(heads)
                stack.enter_context(static_fake(mode) if fake else nullcontext())
                stack.enter_context(torch.enable_grad())
                stack.enter_context(_FlopCount(trace))
                with torch.autograd.graph.saved_tensors_hooks(_pack_hook(trace), lambda t: t), _Provenance(trace):
                    try:
                        out = model(**batch)
                    except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as e:
                        where = (f"block {trace.current}" if trace.current else
                                 f"the glue after block {trace.last_finished}" if trace.last_finished else "the glue before any block")
                        raise MmplanError(f"cannot profile on the meta device: {where} runs {e.func if hasattr(e, 'func') else e}, "
                                          "whose output depends on floating-point tensor values; profile with --device cpu") from None
                    found = model_loss(out)
                    read = out if found is None else found
                    trace.loss = tuple(sorted({src for src, _, _ in trace.prov_of(read) if not src.startswith("input:")}))
                    loss = _scalar_loss(out)
                trace.heads = heads.found()
                if loss.requires_grad:
                    loss.backward()
            trace.fuse(fused)
        finally:
            for h in handles:
                h.remove()
        for rec in records.values():
            if rec.in_spec is not None:
                rec.signature = _signature(rec.module, rec.in_spec)
        ran = sorted((r for r in records.values() if r.order >= 0), key=lambda r: r.order)
        return ran, trace
    finally:
        restore()


def _materialise(module: nn.Module, device: torch.device) -> nn.Module:
    """A real copy of one block on `device` (random weights when the model was built on meta)."""
    block = copy.deepcopy(module)
    if any(t.device.type == "meta" for t in (*block.parameters(), *block.buffers())):
        block = block.to_empty(device=device)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
            for b in block.buffers():
                b.zero_()
        return block
    return block.to(device)


def _make_inputs(in_spec: Any, device: torch.device, batch_scale: int = 1) -> tuple[tuple, dict]:
    """Random inputs of the recorded shapes; batch_scale multiplies dim 0 (the batch) of every tensor."""
    leaves, spec = in_spec
    out = []
    for x in leaves:
        if isinstance(x, _TensorSpec):
            if batch_scale != 1 and x.shape:
                x = _TensorSpec((x.shape[0] * batch_scale, *x.shape[1:]), x.dtype, x.requires_grad)
            if x.value is not None and tuple(x.value.shape) == x.shape:
                t = x.value.to(device)
            elif x.dtype.is_floating_point:
                t = torch.randn(x.shape, dtype=x.dtype, device=device).requires_grad_(x.requires_grad)
            elif x.dtype == torch.bool:
                t = torch.ones(x.shape, dtype=x.dtype, device=device)
            else:
                t = torch.zeros(x.shape, dtype=x.dtype, device=device)
            out.append(t)
        else:
            out.append(x)
    args, kwargs = spec.unflatten(out)
    return args, kwargs


def measure_block(module: nn.Module, in_spec: Any, device: torch.device, reps: int = 5,
                  batch_scale: int = 1) -> tuple[float, float]:
    """Forward and backward milliseconds of one block on a real device: the best of `reps` (noise on a shared
    machine only ever adds time, and these times serve as proportions, see _in_context)."""
    block = _materialise(module, device)
    args, kwargs = _make_inputs(in_spec, device, batch_scale)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    for i in range(reps + 2):  # two warm-up repetitions
        sync()
        t0 = time.perf_counter()
        out = block(*args, **kwargs)
        sync()
        t1 = time.perf_counter()
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        sync()
        t2 = time.perf_counter()
        if i >= 2:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
        del out, outs
        for p in (*block.parameters(), *(a for a in args if isinstance(a, torch.Tensor))):
            p.grad = None
    return min(fwd), min(bwd)


def _in_context(timings: dict, records: list, model: nn.Module, batch: dict[str, Any], device: torch.device,
                micro_batch: int, reps: int) -> tuple[dict, float]:
    """Spread the whole model's measured forward + backward, at the micro-batch and at twice it (an affine fit
    in the batch), over the blocks in proportion to their isolated times (forward/backward split as measured).
    The isolated times give the proportions only: alone, small blocks run faster than in context, and their
    batch slopes are too noisy to use. Also returns the relative spread of the whole-model time (measure_model)."""
    doubled = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
    (at_1, spread), (at_2, _) = measure_model(model, [batch, doubled], device, reps)
    slope = max(at_2 - at_1, 0.0) / micro_batch  # ms per extra sample, whole model
    total = sum(timings[r.signature][0] + timings[r.signature][1] for r in records)
    out = {}
    for key, (f, b, *_rest) in timings.items():
        share = (f + b) / total if total > 0 else 0.0
        fwd_part = f / (f + b) if f + b > 0 else 0.5
        out[key] = (share * at_1 * fwd_part, share * at_1 * (1 - fwd_part),
                    share * slope * fwd_part, share * slope * (1 - fwd_part))
    return out, spread


# measure_model: repetitions per round, the most rounds, and the change of the median between two rounds below
# which it counts as stable (other jobs on a shared machine come and go: a single short round can be off by 2x)
ROUND_REPS, MAX_ROUNDS, STABLE = 3, 8, 0.03


def measure_model(model: nn.Module, batches: list[dict[str, Any]], device: torch.device,
                  reps: int = ROUND_REPS) -> list[tuple[float, float]]:
    """(median milliseconds, relative spread) of one forward + backward of the whole model (glue, caches and all)
    for each batch. The batches are timed in alternation, `reps` each per round, so that a change of load hits
    them alike (their difference is the batch slope); rounds repeat until every batch's median over all rounds
    moves by less than STABLE from one round to the next (at most MAX_ROUNDS). Spread = interquartile range /
    median."""
    model = model.to(device)
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once(batch: dict[str, Any]) -> float:
        sync()
        t0 = time.perf_counter()
        _scalar_loss(model(**batch)).backward()
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        model.zero_grad(set_to_none=True)
        return ms

    for batch in batches:  # warm-up
        once(batch)
        once(batch)
    times: list[list[float]] = [[] for _ in batches]
    previous: list[float] | None = None
    for _ in range(MAX_ROUNDS):
        for _ in range(max(1, reps)):
            for i, batch in enumerate(batches):
                times[i].append(once(batch))
        medians = [statistics.median(t) for t in times]
        if previous is not None and all(abs(m - p) <= STABLE * p for m, p in zip(medians, previous)):
            break
        previous = medians
    out = []
    for t in times:
        q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3
        median = statistics.median(t)
        out.append((median, (q[2] - q[0]) / median if median > 0 else 0.0))
    return out


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def profile_model(
    source: ModelSource,
    *,
    micro_batch: int = 1,
    device: Device = "meta",
    dtype: str | None = None,
    measure: bool = False,
    groups: list[tuple[str, str]] = (),
    reps: int = 5,
    progress: Progress | None = None,
    freeze: Sequence[str] = (),
    fused: bool = True,
    softmax_grad_in_memory: bool = False,
) -> Profile:
    """Profile a model: see the module docstring for what is measured and how. `fused=False` counts memory-bound
    traffic as eager PyTorch moves it (_Trace.fuse; bench/fidelity_bench.py's Hugging Face rows);
    `softmax_grad_in_memory=True`, the softmax backward as a kernel of its own reading its incoming gradient from
    memory (Megatron-LM's separate attention-dropout kernel: _Trace.fuse; the bench's Megatron rows)."""
    note = progress or (lambda step, frac: None)
    if micro_batch < 1:
        raise MmplanError(f"--micro-batch must be >= 1, got {micro_batch}")
    dtype = dtype or source.default_dtype
    if dtype not in DTYPES:
        raise MmplanError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MmplanError("--device cuda: no CUDA device is available here (use --device meta or cpu)")
    if measure and device == "meta":
        raise MmplanError("--measure needs a real device: add --device cpu or --device cuda")
    fake = device != "cpu"  # cuda: analyse on fake tensors (the model may not fit), measure blocks on the GPU
    note("building model", 0.0)
    with torch.device("meta") if fake else nullcontext():
        model, batch = call_factory(source, micro_batch)
    batch = _cast(model, batch, DTYPES[dtype])
    freeze_blocks(model, freeze, source.name)
    note("tracing forward and backward", 0.1)
    try:
        records, trace = analyse(model, batch, fake=fake, fused=fused, softmax_grad_in_memory=softmax_grad_in_memory)
    except MmplanError:
        raise
    except Exception as e:
        raise MmplanError(f"profiling {source.name} failed in its forward/backward: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    timings: dict[str, tuple[float, ...]] = {}
    spread, threads = 0.0, 0
    if measure:
        with _rank_threads(device) as threads:
            timings, spread = _measure(records, model, batch, device, micro_batch, reps, fake, note)
    note("done", 1.0)
    options = ProfileOptions(groups=tuple(tuple(g) for g in groups), device=device, measure=measure, freeze=tuple(freeze),
                             threads=threads)
    auto = _auto_groups(records, trace, batch)
    _check_overrides(groups, [r.name for r in records], auto)
    profile = _assemble(source.name, dtype, micro_batch, records, trace, groups, timings,
                        _device_name(torch.device(device)) if measure else None, options, auto,
                        adopted=_adopted_parameters(model, batch, records))
    return replace(profile, measure_spread=round(spread, 4)) if measure else profile


@contextmanager
def _rank_threads(device: str):
    """On the CPU, time as `mmplan run`'s ranks run: with the torch threads it gives each rank
    (runtime.launch.RANK_THREADS; the caller's setting is restored afterwards) and keeping freed memory in the
    process (runtime.host_memory, which stays in force). Yields the number of threads the measurement runs with."""
    from runtime.host_memory import keep_freed_memory
    from runtime.launch import RANK_THREADS

    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(RANK_THREADS)
        keep_freed_memory()
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _measure(records, model, batch, device, micro_batch, reps, fake, note) -> tuple[dict, float]:
    """Block timings (profile_model's `measure`) and the relative spread of the whole-model time (0 on cuda)."""
    timings: dict[str, tuple[float, ...]] = {}
    spread = 0.0
    target = torch.device(device)
    distinct = list({r.signature: r for r in records}.values())
    for i, rec in enumerate(distinct):
        note(f"measuring {rec.name}", 0.3 + 0.7 * i / len(distinct))
        try:
            f1, b1 = measure_block(rec.module, rec.in_spec, target, reps)
        except Exception as e:  # one line naming the block, never a traceback
            raise MmplanError(f"--measure: block {rec.name} ({type(rec.module).__name__}) fails alone on random inputs of "
                              f"its profiled shapes: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        try:
            f2, b2 = measure_block(rec.module, rec.in_spec, target, reps, batch_scale=2)
        except Exception:  # integer inputs that describe the batch (cu_seqlens) do not double: proportional
            f2, b2 = 2 * f1, 2 * b1
        timings[rec.signature] = (f1, b1, (f2 - f1) / micro_batch, (b2 - b1) / micro_batch)
    if not fake:  # the whole model is on the device: fit the block times to the in-context times
        timings, spread = _in_context(timings, records, model, batch, torch.device(device), micro_batch, reps)
    return timings, spread


def _tp_divisor(module: nn.Module) -> int:
    """runtime/tensor_parallel.tp_divisor; 1 (tp 1 only) for a block whose tensor-parallel plan cannot be read."""
    try:
        return tp_divisor(module)
    except Exception:  # a plan naming modules the block does not have: check_tp refuses every tp > 1 too
        return 1


def _adopted_parameters(model: nn.Module, batch: dict[str, Any], records) -> dict[str, list[nn.Parameter]]:
    """Trained parameters outside every block (CLIP's logit_scale) by the block the runtime makes own and train
    them (runtime/forward_program.py, stage.adopt_free_parameters): counted in that block's parameters. Only for
    models the runtime runs by their own forward (Hugging Face); one extra fake forward, only when there are any."""
    from runtime.hf import is_hf_model

    inside = {id(p) for r in records for p in r.module.parameters()}
    if not is_hf_model(model) or not any(p.requires_grad and id(p) not in inside for p in model.parameters()):
        return {}
    from runtime.forward_program import ForwardProgram

    owner = ForwardProgram(model, batch, {r.name: r.module for r in records}).free_owner
    out: dict[str, list[nn.Parameter]] = {}
    for name, block in owner.items():
        out.setdefault(block, []).append(model.get_parameter(name))
    return out


def _auto_groups(records, trace, batch) -> dict[str, str]:
    """Block -> group by modality (planner/profiler/groups.py), or {} where the top-level children are the groups."""
    from planner.profiler.groups import modality_groups

    integer = {k for k, v in batch.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()}
    edges = [(s, d) for s, d in trace.edges if not s.startswith("input:")]
    inputs = [(s.removeprefix("input:"), d) for s, d in trace.edges if s.startswith("input:")]
    return modality_groups([r.name for r in records], {r.name: r.module for r in records}, edges, inputs, integer) or {}


def _check_overrides(overrides, names: list[str], auto: dict[str, str]) -> None:
    """A --group pattern must match a block (by name) or a group (by its automatic name)."""
    for pattern, _ in overrides:
        if not any(fnmatchcase(n, pattern) for n in names) and not any(fnmatchcase(g, pattern) for g in set(auto.values())):
            raise MmplanError(f"--group {pattern}=...: the pattern matches no block (nor group); blocks are named like "
                              f"{names[0]!r} ... {names[-1]!r}")


def _assemble(name, dtype, mb, records, trace, overrides, timings, measured_on, options, auto=None,
              adopted=None) -> Profile:
    from planner.profiler.groups import contiguous_order

    groups = {}
    for rec in records:
        group = (auto or {}).get(rec.name) or default_group(rec.name)
        for pattern, g in overrides:  # a pattern names blocks, or a whole automatic group
            if fnmatchcase(rec.name, pattern) or fnmatchcase(group, pattern):
                group = g
        groups[rec.name] = group
    by_name = {r.name: r for r in records}
    flow = [(s, d) for s, d in trace.edges if not s.startswith("input:")]
    records = [by_name[n] for n in contiguous_order([r.name for r in records], groups, flow)]
    blocks = []
    vocab = token_vocab(records)
    counted: set[int] = set()  # a parameter shared by blocks (tied embeddings) counts for the first one
    for rec in records:
        group = groups[rec.name]
        own = [p for p in [*rec.module.parameters(), *(adopted or {}).get(rec.name, ())] if id(p) not in counted]
        counted.update(id(p) for p in own)
        params = sum(p.numel() for p in own)
        pbytes = sum(p.numel() * p.element_size() for p in own)
        replicated, core = _classify_saved(trace, rec)
        fwd_ms, bwd_ms, fwd_slope, bwd_slope = timings.get(rec.signature, (None, None, None, None))
        blocks.append(Block(
            name=rec.name, group=group, kind=type(rec.module).__name__, params=params, param_bytes=pbytes,
            fwd_flops=_per_sample(rec.fwd_flops, mb), bwd_flops=_per_sample(rec.bwd_flops, mb),
            activation_bytes=_per_sample(rec.activation_bytes, mb), output_bytes=_per_sample(rec.output_bytes, mb),
            supports_tp=supports_tp(rec.module), signature=rec.signature,
            structure=module_structure(rec.module),
            reduces_batch=rec.reduces_batch, frozen=is_frozen(rec.module),
            param_tensors=sum(1 for p in own if p.requires_grad),
            fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_ms_per_sample=fwd_slope, bwd_ms_per_sample=bwd_slope,
            fwd_matmul_flops=_per_sample(rec.matmul_flops[0], mb), bwd_matmul_flops=_per_sample(rec.matmul_flops[1], mb),
            fwd_attention_flops=_per_sample(rec.attention_flops[0], mb),
            bwd_attention_flops=_per_sample(rec.attention_flops[1], mb),
            fwd_memory_bytes=_per_sample(rec.memory_bytes[0], mb), bwd_memory_bytes=_per_sample(rec.memory_bytes[1], mb),
            replicated_memory_fraction=round(rec.replicated_memory_bytes / rec.memory_bytes[0], 4) if rec.memory_bytes[0] else 0.0,
            matmuls=rec.matmuls, fwd_gemms=_gemm_list(rec.gemms[0], mb), bwd_gemms=_gemm_list(rec.gemms[1], mb),
            activation_replicated_bytes=_per_sample(replicated, mb),
            attention_core_bytes=_per_sample(core, mb), attention_core_gemms=_gemm_list(_core_gemms(trace, rec), mb),
            vocab_parallel=vocab_role(rec, vocab, trace.loss, trace.heads),
            sequence=rec.sequence, tp_divisor=_tp_divisor(rec.module),
            fwd_ops=rec.ops[0], bwd_ops=rec.ops[1], saved_tensors=len(rec.saved),
        ))
    order = {r.name: r.order for r in records}
    edges = tuple(
        Edge(src, dst, _per_sample(sum(leaves.values()), mb))
        for (src, dst), leaves in sorted(trace.edges.items(), key=lambda kv: (order.get(kv[0][0], -1), order[kv[0][1]]))
        if not src.startswith("input:")
    )
    inputs = tuple(
        InputEdge(src.removeprefix("input:"), dst, _per_sample(sum(leaves.values()), mb))
        for (src, dst), leaves in sorted(trace.edges.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))
        if src.startswith("input:")
    )
    if not trace.loss:
        raise MmplanError(f"{name}: the forward's result derives from no block; mmplan needs a loss computed from the blocks' outputs")
    attention = sorted(op for op in trace.ops if "attention" in op)
    profile = Profile(
        model=name, fingerprint="", dtype=dtype, micro_batch=mb,
        blocks=tuple(blocks), edges=edges, inputs=inputs, measured_on=measured_on,
        attention=", ".join(attention) or "none", loss=trace.loss, options=options,
    )
    return replace(profile, fingerprint=profile_fingerprint(profile))


def token_vocab(records: list[_BlockRecord]) -> int | None:
    """The vocabulary: rows of the largest nn.Embedding in a block fed integer inputs (token ids), if any."""
    sizes = [m.num_embeddings for r in records if _reads_ids(r) for m in r.module.modules() if isinstance(m, nn.Embedding)]
    return max(sizes, default=None)


def _reads_ids(rec: _BlockRecord) -> bool:
    leaves = tree_flatten(rec.in_spec)[0] if rec.in_spec is not None else []
    return any(isinstance(x, _TensorSpec) and not x.dtype.is_floating_point and x.dtype != torch.bool for x in leaves)


def vocab_role(rec: _BlockRecord, vocab: int | None, loss: tuple[str, ...], heads: set[str] | None = None) -> str:
    """"embedding" for the block embedding token ids into the vocabulary-sized table, "head" for a block the loss
    reads that projects onto the vocabulary (an nn.Linear with vocab outputs) — and, given `heads`, one the
    runtime shards (read only by F.cross_entropy through shape-only glue: HeadPaths) —, "" otherwise: the blocks
    Megatron shards along the vocabulary under tensor parallelism (Shoeybi et al. 2019, section 3)."""
    if vocab is None:
        return ""
    modules = list(rec.module.modules())
    if _reads_ids(rec) and any(isinstance(m, nn.Embedding) and m.num_embeddings == vocab for m in modules):
        return "embedding"
    if rec.name in loss and any(isinstance(m, nn.Linear) and m.out_features == vocab for m in modules):
        if heads is None or (rec.name in heads and type(rec.module) is nn.Linear):
            return "head"
    return ""


def _gemm_list(kernels: dict, mb: int) -> tuple[tuple[float, float, int], ...]:
    """(FLOPs, bytes, count) per sample of a block's distinct GEMM kernels, largest first."""
    return tuple(sorted(((_per_sample(f, mb), _per_sample(b, mb), n) for (f, b), n in kernels.items()), reverse=True))


def _per_sample(value: float, mb: int) -> float | int:
    v = value / mb
    return int(v) if float(v).is_integer() else v
