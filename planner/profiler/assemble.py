"""The profile from a traced pass: blocks' figures per sample, edges, groups, TP classes and vocabulary roles."""
from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from runtime.program import is_frozen, module_structure
from runtime.tensor_parallel import supports_tp, tp_divisor
from plans.errors import MmplanError
from plans.graph import Block, Edge, InputEdge, Profile, Tie, profile_fingerprint
from planner.profiler.blocks import default_group
from planner.profiler.records import BlockRecord, TensorSpec, Trace


def _classify_saved(trace: Trace, rec: "BlockRecord") -> tuple[int, int]:
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


def _core_gemms(trace: Trace, rec: "BlockRecord") -> dict:
    """The forward GEMM kernels of a block's attention cores: those run inside an attention region (one that ran
    softmax or fused attention) but outside its Linears -- a math attention's QK^T and AV, which selective
    recompute reruns with the softmax (Korthikanti et al. 2022, section 5)."""
    kernels: dict = {}
    for call, shapes in rec.region_gemms.items():
        if call in trace.attends:
            for shape, n in shapes.items():
                kernels[shape] = kernels.get(shape, 0) + n
    return kernels


def _tp_divisor(module: nn.Module) -> int:
    """runtime/tensor_parallel.tp_divisor; 1 (tp 1 only) for a block whose tensor-parallel plan cannot be read."""
    try:
        return tp_divisor(module)
    except Exception:  # a plan naming modules the block does not have: check_tp refuses every tp > 1 too
        return 1


def adopted_parameters(model: nn.Module, batch: dict[str, Any], records) -> dict[str, list[nn.Parameter]]:
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


def assemble(name, dtype, mb, records, trace, overrides, timings, measured_on, options, auto=None,
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
        attention=", ".join(attention) or "none", loss=trace.loss, options=options, ties=ties_of(records),
    )
    return replace(profile, fingerprint=profile_fingerprint(profile))


def ties_of(records: list[BlockRecord]) -> tuple[Tie, ...]:
    """The parameters several blocks hold (tied embeddings), each under its first block in execution order (the one
    whose `params` count it, as the loop above counts)."""
    holders: dict[int, list[tuple[str, str, nn.Parameter]]] = {}
    for rec in records:
        for local, p in rec.module.named_parameters():
            found = holders.setdefault(id(p), [])
            if all(b != rec.name for b, _, _ in found):
                found.append((rec.name, local, p))
    return tuple(Tie(f"{held[0][0]}.{held[0][1]}", tuple(b for b, _, _ in held), held[0][2].numel(),
                     held[0][2].numel() * held[0][2].element_size())
                 for held in holders.values() if len(held) > 1)


def token_vocab(records: list[BlockRecord]) -> int | None:
    """The vocabulary: rows of the largest nn.Embedding in a block fed integer inputs (token ids), if any."""
    sizes = [m.num_embeddings for r in records if _reads_ids(r) for m in r.module.modules() if isinstance(m, nn.Embedding)]
    return max(sizes, default=None)


def _reads_ids(rec: BlockRecord) -> bool:
    leaves = tree_flatten(rec.in_spec)[0] if rec.in_spec is not None else []
    return any(isinstance(x, TensorSpec) and not x.dtype.is_floating_point and x.dtype != torch.bool for x in leaves)


def vocab_role(rec: BlockRecord, vocab: int | None, loss: tuple[str, ...], heads: set[str] | None = None) -> str:
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

