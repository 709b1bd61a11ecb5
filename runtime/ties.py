"""Parameters tied across pipeline stages, Megatron-LM's way: a copy on every stage holding a tied block, one gradient.

A parameter several blocks hold (a token embedding and its tied LM head) whose blocks sit on different stages is kept
whole on each of those stages: every rank builds the model from the same seed, so the copies start identical
(runtime/rank.build_model); a rank's remote blocks drop their reference to it (runtime/stage.py). After the backward
and each stage's data-parallel sync, before the optimizer step, the copies' gradients are all-reduced over the ranks
holding them (Megatron-LM's embedding group, `_allreduce_word_embedding_grads`: the first and last stage of each
pipeline): one group per (dp replica, tp rank) position across the holder stages, so that under tensor parallelism
the vocabulary shards (runtime/vocab_parallel.py cuts embedding and head alike) and under ZeRO the FSDP2 shards
(even dim-0 shards over equal dp groups) meet their own counterparts. Each copy then holds the summed gradient of the
whole tie and, with the same optimizer state, steps identically. Checkpoints hold the tie once: its optimizer state
under its owner's name (the first block in execution order), as a single-stage run saves it (train.py).
The cost model prices the same (cost_models/ties.py, tail.tie_sync_time); which ties the runtime holds this way is
plans/capabilities.tied_across_stages_refusal's.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plans.capabilities import tied_across_stages_refusal
from plans.errors import MmplanError

Holder = tuple[str, str]  # (block, the parameter's name inside it)


def find_ties(blocks: Mapping[str, nn.Module], order: Sequence[str]) -> list[tuple[Holder, ...]]:
    """Every parameter several blocks hold, as its holders in `order` (blocks' execution order; the owner first)."""
    rank = {b: i for i, b in enumerate(order)}
    held: dict[int, list[Holder]] = {}
    for b in sorted(blocks, key=lambda n: rank.get(n, len(rank))):
        for local, p in blocks[b].named_parameters():
            found = held.setdefault(id(p), [])
            if all(x != b for x, _ in found):
                found.append((b, local))
    return [tuple(h) for h in held.values() if len(h) > 1]


def untie_remote(blocks: Mapping[str, nn.Module], local: set[str]) -> None:
    """In every block not in `local`, replace each parameter it shares with a local block by an empty one on the meta
    device, so that dropping or hollowing the remote block (runtime/stage.py) leaves the local copy whole."""
    kept = {id(p) for b in local for p in blocks[b].parameters()}
    for name, block in blocks.items():
        if name in local:
            continue
        for m in block.modules():
            for n, p in list(m._parameters.items()):
                if p is not None and id(p) in kept:
                    m._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a parameter tied across stages: its tie's name and owner block, the local block holding it
    and its name there, and the process group of the copies to sum its gradient with."""

    parameter: str
    owner: str  # the block owning the tie (first in execution order)
    block: str
    local: str
    group: Any


def tied_copies(stage_map: Any, ties: Sequence[tuple[Holder, ...]], rank: int) -> list[TiedCopy]:
    """The groups of every tie across stages (new_group is collective: every rank creates every group, in the ties'
    order) and this rank's copies with their groups."""
    mine: list[TiedCopy] = []
    for tie in ties:
        names = [b for b, _ in tie]
        holders = {}  # stage key -> its first chunk, in order of first appearance
        for ch in stage_map.stages.values():
            if set(names).intersection(ch.blocks):
                holders.setdefault(ch.key, ch)
        if len(holders) < 2:
            continue
        why = tied_across_stages_refusal(names, [(c.group, c.dp, c.tp) for c in holders.values()])
        if why:
            raise MmplanError(why)
        first = next(iter(holders.values()))
        for r in range(first.dp):
            for k in range(first.tp):
                ranks = [c.ranks[r * c.tp + k] for c in holders.values()]
                group = dist.new_group(sorted(ranks))
                if rank not in ranks:
                    continue
                stage = next(c for c in holders.values() if rank in c.ranks)
                blocks = {b for ch in stage_map.stages.values() if ch.key == stage.key for b in ch.blocks}
                block, local = next((b, n) for b, n in tie if b in blocks)
                mine.append(TiedCopy(f"{tie[0][0]}.{tie[0][1]}", tie[0][0], block, local, group))
    return mine


def check_copies(copies: Sequence[TiedCopy], modules: Mapping[str, nn.Module]) -> None:
    """Every copy of a tie has the same local shape as the others in its group (collective over each group): a copy
    sharded otherwise than its counterparts (a vocabulary-parallel embedding whose tied head stays whole) is refused
    in one line on every rank of the group, instead of an all-reduce of unequal tensors."""
    from runtime.zero import local_view

    for c in copies:
        shape = tuple(local_view(modules[c.block].get_parameter(c.local)).shape)
        mine = torch.tensor([len(shape), *shape, *[0] * (8 - len(shape))], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(c.group))]
        dist.all_gather(every, mine, group=c.group)
        if any(not torch.equal(x, every[0]) for x in every):
            shapes = sorted({tuple(x[1:1 + int(x[0])].tolist()) for x in every})
            raise MmplanError(f"the copies of {c.parameter} (tied across stages) have the shapes {shapes} on the ranks "
                              "holding them; under tensor parallelism both tied blocks must be vocabulary-parallel (or tp 1)")


def sync_tied_grads(copies: Sequence[TiedCopy], modules: Mapping[str, nn.Module]) -> None:
    """Sum each copy's gradient (this rank's shard of it under ZeRO) with the other copies' over its group."""
    from runtime.zero import local_grad

    for c in copies:
        p = modules[c.block].get_parameter(c.local)  # looked up now: tensor parallelism and ZeRO replaced it
        if not p.requires_grad:
            continue
        g = local_grad(p)
        if g is None:  # a copy its stage did not use this step: it adds nothing, but must take part
            p.grad = g = torch.zeros_like(p)
        dist.all_reduce(g, group=c.group)
