"""This rank's part of the model: the traced program, its local blocks, and the shape of every block output."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from runtime.blocks import block_modules
from runtime.output_spec import OutputSpec
from runtime.program import Program, trace_program
from runtime.samples import rows_per_sample
from runtime.ties import untie_remote


@dataclass
class RankModel:
    model: nn.Module  # the module tree; blocks of other ranks are moved to the meta device (no memory)
    program: Program
    local: dict[str, nn.Module]  # this rank's blocks by name
    specs: dict[str, OutputSpec]  # every block's output structure (for receive buffers)
    aliases: dict[str, str] = field(default_factory=dict)  # "block.local name" of an adopted parameter -> its model name

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for m in self.local.values():
            for p in m.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())


def output_specs(model: nn.Module, example: dict[str, Any]) -> dict[str, OutputSpec]:
    """Per-sample output shapes of every block, from one forward on fake tensors (no compute)."""
    specs: dict[str, OutputSpec] = {}
    handles = []
    for name, m in block_modules(model).items():
        def hook(module, args, output, name=name):
            flat, tree = tree_flatten(output)
            leaves = [t for t in flat if isinstance(t, torch.Tensor)]  # of one sample: k rows if packed (samples.py)
            specs[name] = OutputSpec(tree, tuple((tuple(t.shape[1:]), t.dtype) for t in leaves),
                                     tuple(t.shape[0] if t.dim() else 1 for t in leaves))
        handles.append(m.register_forward_hook(hook))
    rows = rows_per_sample(example)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            batch = {k: mode.from_tensor(v[:rows.get(k, 1)]) if isinstance(v, torch.Tensor) else v for k, v in example.items()}
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return specs


def build_rank_model(model: nn.Module, example: dict[str, Any], local_blocks: set[str], device: torch.device,
                     program: Program | None = None) -> RankModel:
    """Record output shapes, keep only `local_blocks` in memory (on `device`); `program`: the model's traced
    forward (traced here when not given)."""
    program = program if program is not None else trace_program(model, example)
    own_forward = hasattr(program, "run_stage")  # runtime/forward_program.py: the model's own forward runs
    specs = program.specs if own_forward else output_specs(model, example)
    blocks = block_modules(model)
    aliases = adopt_free_parameters(model, blocks, getattr(program, "free_owner", {}))
    untie_remote(blocks, local_blocks)  # a parameter tied across stages: each stage keeps its copy (runtime/ties.py)
    for name, m in blocks.items():
        if name in local_blocks:
            m.to(device)
        elif own_forward:  # glue may read any module's device or dtype: keep them, not the memory
            if name in program.blocks:  # a module never called as a block (Qwen2-Audio's embed_positions, whose
                _hollow(m, device)  # weight the glue reads directly) stays whole: every stage's glue uses it
        else:
            m.to(torch.device("meta"))
    if own_forward:
        model.to(device)  # the glue's own modules (rotary tables); hollow tensors are on `device` already
    return RankModel(model, program, {n: blocks[n] for n in local_blocks}, specs, aliases)


FREE = "mmplan_free_"  # the prefix of a parameter a block adopted


def adopt_free_parameters(model: nn.Module, blocks: dict[str, nn.Module], owner: dict[str, str]) -> dict[str, str]:
    """Register each parameter outside every block (CLIP's logit_scale) in its owner block too — the block
    that uses it, found from the data flow (runtime/forward_program.py) — so the owner's stage trains it,
    its tiers hold it, its data-parallel group all-reduces it, like any of the block's own parameters. The
    model's forward keeps reading it where it is (the same Parameter object). Returns the aliases:
    "block.local name" -> the parameter's name in the model."""
    aliases = {}
    for name, block in owner.items():
        local = FREE + name.replace(".", "__")
        blocks[block].register_parameter(local, model.get_parameter(name))
        aliases[f"{block}.{local}"] = name
    return aliases


def _hollow(module: nn.Module, device: torch.device) -> None:
    """Parameters and buffers as one broadcast zero each: right shape, dtype and device, no memory, no gradient."""
    with torch.no_grad():
        for m in module.modules():
            for store in (m._parameters, m._buffers):
                for name, t in list(store.items()):
                    if t is not None:
                        empty = torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
                        store[name] = nn.Parameter(empty, requires_grad=False) if isinstance(t, nn.Parameter) else empty
