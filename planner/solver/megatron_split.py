"""The Megatron-style split of a homogeneous layout into pipeline stages, and the plan that layout builds."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from cost_models.memory import DTYPE_BYTES
from planner.solver.construct import GroupLayout, build_plan, megatron_ranks, with_predictions
from planner.solver.layout_spec import LayoutSpec, Recompute, Split
from plans.capabilities import TP_SINGLE_REGION_KINDS
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Block, Profile
from plans.plan import Group, Memory, Plan, ProfileRef, SolverInfo, Stage, Training, check_plan

# Vocabulary: a "layer" is a transformer layer, i.e. a block that supports tensor parallelism and is not a projector
# (is_layer); "spans" are what a pipeline split counts: each layer with the non-layer
# blocks (embeddings, norms, projector, head) that follow it, the blocks before the first layer joining it.
# When a model has fewer layers than the split needs parts, every block is its own span. (A solver "unit",
# planner/solver/structure.py, is something else: the blocks that get one layout.)

GROUP = "model"  # the one group of a homogeneous plan: every block in one pipeline


def is_layer(block: Block) -> bool:
    """A transformer layer: a block that supports tensor parallelism and is not a single-region block (a projector,
    tensor-parallel too: plans/capabilities.TP_SINGLE_REGION_KINDS)."""
    return block.supports_tp and block.kind not in TP_SINGLE_REGION_KINDS


def layer_count(profile: Profile) -> int:
    """Transformer layers of the model (is_layer)."""
    return sum(1 for b in profile.blocks if is_layer(b))


def llm_start(profile: Profile) -> int:
    """Index of the first block of the LLM: the group holding the model's last block (the sink)."""
    sink = profile.blocks[-1].group
    return next(i for i, b in enumerate(profile.blocks) if b.group == sink)


def llm_layer_count(profile: Profile) -> int:
    """Transformer layers of the LLM (what a Megatron-style MIMO split counts)."""
    return sum(1 for b in profile.blocks[llm_start(profile):] if is_layer(b))


def split_blocks(profile: Profile, parts: int, split: Split = "layers") -> list[tuple[str, ...]]:
    """The model's blocks in `parts` contiguous chunks, cut as `split` says (layout_spec.Split; split_cuts)."""
    blocks = profile.blocks
    first = llm_start(profile) if split == "encoders-first" else 0
    if parts < 1 or parts > len(blocks) - first:
        raise MmplanError(f"cannot split the {len(blocks) - first} blocks of {profile.model!r} into {parts} pipeline chunks; "
                          f"use at most {len(blocks) - first} (pp x virtual stages)")
    bounds = (0, *split_cuts(blocks, parts, split, first), len(blocks))
    return [tuple(b.name for b in blocks[a:z]) for a, z in zip(bounds, bounds[1:])]


def split_cuts(blocks: Sequence[Block], parts: int, split: Split, first: int = 0) -> tuple[int, ...]:
    """Cut points (indices into `blocks` where chunks 1..parts-1 start) of a run of blocks -- the whole model, or one
    group's blocks (a per-group `--layout`) -- in `parts` contiguous chunks, cut as `split` says; the caller checks
    that 1 <= parts <= len(blocks) - first.

    layers: (nearly) equal layer count, Megatron-style. Each non-layer block goes with the layer before it (the
    blocks before the first layer with the first layer), so embeddings land in the first chunk and the final norm
    and head in the last. When the layer count does not divide evenly, the last chunks get one layer more (the
    first pipeline stage holds the most micro-batches in flight under 1F1B). Fewer layers than parts: every
    block counts as a layer.
    encoders-first (Megatron's MIMO recipe): as layers, but only the layers from block `first` on (the LLM's) count,
    so the blocks before it (encoders and projectors) all land on the first chunk with the LLM's first layers.
    flops: the cuts nearest to equal shares of the forward + backward FLOPs (flops_cuts).
    """
    if split == "flops":
        return flops_cuts([b.fwd_flops + b.bwd_flops for b in blocks], parts)
    first = first if split == "encoders-first" else 0
    starts = [i for i in range(first, len(blocks)) if is_layer(blocks[i])]
    if len(starts) < parts:
        starts = list(range(first, len(blocks)))
    starts[0] = 0  # the blocks before the first layer join it
    q, r = divmod(len(starts), parts)
    sizes = [q] * (parts - r) + [q + 1] * r  # spans per chunk: a span is a layer with the non-layer blocks after it
    return tuple(starts[sum(sizes[:k])] for k in range(1, parts))


def flops_cuts(flops: list[float], parts: int) -> tuple[int, ...]:
    """Cut points (block indices where chunks 1..parts-1 start) of `parts` non-empty contiguous chunks whose FLOPs are
    as even as the blocks allow: cut k at the block boundary whose prefix sum is nearest k/parts of the total (the
    earlier on ties), kept after cut k-1 and early enough to leave a block for every later chunk."""
    n = len(flops)
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(flops, dtype=float))))
    if prefix[-1] <= 0:
        prefix = np.arange(n + 1, dtype=float)  # no FLOPs recorded: block count
    cuts: list[int] = []
    for k in range(1, parts):
        lo, hi = (cuts[-1] + 1 if cuts else 1), n - (parts - k)
        target = prefix[-1] * k / parts
        j = int(np.searchsorted(prefix, target))  # prefix[j - 1] < target <= prefix[j]
        if j > 0 and target - prefix[j - 1] <= prefix[min(j, n)] - target:
            j -= 1
        cuts.append(min(max(j, lo), hi))
    return tuple(cuts)


def spec_stages(profile: Profile, spec: LayoutSpec) -> list[tuple[str, ...]]:
    """Blocks of each pipeline stage; with v chunks per rank stage i holds chunks i, i+pp, ... (Megatron)."""
    chunks = split_blocks(profile, spec.pp * spec.virtual_stages, spec.split)
    return [tuple(b for k in range(i, len(chunks), spec.pp) for b in chunks[k]) for i in range(spec.pp)]


_BY_NAME: list = [None, {}]  # the last profile asked for and its blocks by name (a search asks once per stage)


def _by_name(profile: Profile) -> dict[str, Block]:
    if _BY_NAME[0] is not profile:
        _BY_NAME[:] = [profile, {b.name: b for b in profile.blocks}]
    return _BY_NAME[1]


def recomputed_tiers(profile: Profile, blocks: Iterable[str], recompute: Recompute) -> dict[str, str]:
    """Activation tiers for `recompute`: full = every block recomputed; layers = the transformer layers recomputed
    whole (DeepSpeed-style activation checkpointing); selective = Megatron's selective recomputation, the attention
    core of every block that has one (Korthikanti et al. 2022, section 5; the runtime's "selective" tier)."""
    if recompute == "none":
        return {}
    by_name = _by_name(profile)
    if recompute == "selective":
        return {b: "selective" for b in blocks if by_name[b].attention_core_bytes > 0}
    return {b: "recompute" for b in blocks if recompute == "full" or is_layer(by_name[b])}


def spec_training(profile: Profile, spec: LayoutSpec, global_batch: int) -> Training:
    dtype = profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"
    return Training(global_batch=global_batch, micro_batches=global_batch // (spec.dp * spec.micro_batch),
                    schedule=spec.schedule, virtual_stages=spec.virtual_stages, dtype=dtype)


def build_spec_plan(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec, solver: SolverInfo,
           *, predict: bool = True, schema: bool = True) -> Plan:
    training = spec_training(profile, spec, global_batch)
    stages = spec_stages(profile, spec)
    memory = tuple(Memory(activations=recomputed_tiers(profile, blocks, spec.recompute)) for blocks in stages)
    ranks = megatron_ranks(spec.dp, spec.tp, spec.pp)
    if spec.virtual_stages == 1:
        names = tuple(b for s in stages for b in s)
        cuts = tuple(sum(len(s) for s in stages[:i]) for i in range(1, spec.pp))
        layout = GroupLayout(GROUP, names, cuts, spec.dp, spec.tp, ranks, zero=spec.zero, memory=memory,
                             sequence_parallel=spec.sequence_parallel)
        return build_plan(profile, cluster, training, [layout], solver, predict=predict, schema=schema)
    # Interleaved: GroupLayout could say this too (chunks = v, stage k holding chunks k, k + pp, ...); the Group is built
    # here from the stage lists instead, and finished as build_plan does (checked with the profile, which fills in the
    # plan's data flow, then predictions attached).
    per = spec.dp * spec.tp
    group = Group(GROUP, spec.dp, spec.tp, spec.pp, zero=spec.zero, sequence_parallel=spec.sequence_parallel and spec.tp > 1, stages=tuple(
        Stage(blocks, ranks[i * per:(i + 1) * per], memory[i]) for i, blocks in enumerate(stages)))
    plan = check_plan(Plan(ProfileRef(profile.model, profile.fingerprint), cluster, training, (group,), solver=solver), profile,
                      schema=schema)
    return with_predictions(plan, profile)[0] if predict else plan
