"""One traced forward + backward (on FakeTensors or a real CPU) with every probe: FLOPs, saved tensors, data flow."""
from __future__ import annotations

import functools
import hashlib
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                          UnsupportedOperatorException)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from runtime.fake_exec import fake_batch, fakify_module, static_fake
from runtime.source import model_loss
from runtime.tensor_tree import tensors_in
from runtime.vocab_parallel import HeadPaths
from plans.capabilities import TP_SINGLE_REGION_KINDS
from plans.errors import MmplanError
from planner.profiler.blocks import discover_blocks
from planner.profiler.records import NO_TRAFFIC, SOFTMAX, BlockRecord, Trace, TensorSpec, holds_linear, tensor_bytes

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


class _Provenance(TorchFunctionMode):
    """Outside blocks, every op's outputs derive from the union of its inputs' sources."""

    def __init__(self, trace: Trace):
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

    def __init__(self, trace: Trace):
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
        if not getattr(func, "is_view", False) and packet not in NO_TRAFFIC:
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
                nbytes = sum(tensor_bytes(x) for x in (*tensors_in((args, kwargs)), *tensors_in(out)))
                self.trace.count(flops, nbytes=nbytes)
        else:
            if packet in SOFTMAX:
                self.trace.note_attention()
            self.trace.count_bytes(func, args, kwargs, out)
        return out


def _spec(tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    mapped = [TensorSpec(tuple(x.shape), x.dtype, x.requires_grad, _small_integers(x)) if isinstance(x, torch.Tensor) else x
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
        if isinstance(x, TensorSpec):
            parts.append(f"T{x.shape[1:]}:{x.dtype.is_floating_point}:{x.requires_grad}")
        else:
            parts.append(repr(x) if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__)
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def _install_hooks(trace: Trace) -> list:
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
                if src != rec.name:  # a block called again on its own output (BLIP-2's post_layernorm): one block
                    trace.edges[(src, rec.name)][(src, leaf)] = nbytes
            trace.block_inputs = {id(x) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
            if isinstance(module, nn.Embedding) and trace.block_inputs:
                rec.embeds_input = True
            trace.current = rec.name
            trace.seq_ranges.append([trace.max_seq + 1, None, rec.name])
            if type(module).__name__ in TP_SINGLE_REGION_KINDS:  # the block is its own region (the projector)
                trace.calls += 1
                trace.stack.append((module, trace.calls))

        def post(module, args, kwargs, output, rec=rec):
            if trace.stack and trace.stack[-1][0] is module:
                trace.stack.pop()
            trace.note_nodes(output)
            trace.seq_ranges[-1][1] = trace.max_seq
            trace.seq_ranges[-1] = tuple(trace.seq_ranges[-1])
            trace.current = None
            trace.last_finished = rec.name
            leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
            rec.reduces_batch = bool(leaves) and all(x.dim() == 0 for x in leaves)
            for i, leaf in enumerate(leaves):
                rec.output_bytes += tensor_bytes(leaf)
                trace.materialise(leaf)
                trace.provenance.pop(id(leaf), None)
                trace.tag(leaf, frozenset({(rec.name, i, tensor_bytes(leaf))}))

        handles.append(rec.module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(rec.module.register_forward_hook(post, with_kwargs=True))
        rec.param_shapes = frozenset(tuple(p.shape) for p in rec.module.parameters())
        for sub in rec.module.modules():
            if sub is not rec.module:
                handles.append(sub.register_forward_pre_hook(functools.partial(_enter, trace)))
                handles.append(sub.register_forward_hook(functools.partial(_leave, trace)))
    return handles


def _enter(trace: Trace, module: nn.Module, args) -> None:
    """A submodule of a block starts: push it; a Linear becomes its region's last Linear so far."""
    trace.calls += 1
    if isinstance(module, nn.Embedding) and args and id(args[0]) in trace.block_inputs and trace.current:
        trace.records[trace.current].embeds_input = True
    if isinstance(module, nn.Linear):
        region = next((c for m, c in reversed(trace.stack) if holds_linear(m)), None)
        if region is not None:
            trace.last_linear[region] = trace.calls
    trace.stack.append((module, trace.calls))


def _leave(trace: Trace, module: nn.Module, args, output) -> None:
    trace.stack.pop()
    if isinstance(module, nn.Linear) and isinstance(output, torch.Tensor):
        trace.linear_outputs.add(output.untyped_storage()._cdata)
        trace.alive.append(output)


def _saved_kind(trace: Trace, key: int) -> tuple:
    """Where a tensor is saved, for _classify_saved: in a Linear (its input), inside a region, or outside."""
    if not trace.stack:
        return ("outside",)
    module, call = trace.stack[-1]
    if isinstance(module, nn.Linear):
        region = next((c for m, c in reversed(trace.stack[:-1]) if holds_linear(m)), None)
        return ("linear", call, region)
    region = next((c for m, c in reversed(trace.stack) if holds_linear(m)), None)
    if region is None:
        return ("outside",)
    return ("region", region, key in trace.linear_outputs)


def _pack_hook(trace: Trace):
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


def scalar_loss(out: Any) -> torch.Tensor:
    loss = model_loss(out)  # a tensor, or an output object's `.loss` (transformers)
    if loss is not None and loss.is_floating_point():
        return loss if loss.dim() == 0 else loss.float().sum()
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor) and x.is_floating_point()]
    if not leaves:
        raise MmplanError("the model's forward returned no floating-point tensor to take a loss from")
    loss = leaves[0]
    return loss if loss.dim() == 0 else loss.float().sum()


def cast_model(model: nn.Module, batch: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    model.to(dtype)
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def analyse(model: nn.Module, batch: dict[str, Any], *, fake: bool, fused: bool = True,
            softmax_grad_in_memory: bool = False) -> tuple[list[BlockRecord], Trace]:
    """One forward + backward of the model with every probe installed (`fused`, `softmax_grad_in_memory`: Trace.fuse)."""
    records = {name: BlockRecord(name, module) for name, module in discover_blocks(model)}
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    restore = lambda: None  # noqa: E731
    if fake:  # integer inputs stay real: data-dependent glue (token masks, grids) gets static shapes
        restore = fakify_module(model, mode)
        batch = fake_batch(batch, mode)
    try:
        storages = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
        trace = Trace(records, storages, softmax_grad_in_memory=softmax_grad_in_memory)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                trace.tag(value, frozenset({(f"input:{key}", 0, tensor_bytes(value))}))
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
                    loss = scalar_loss(out)
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

