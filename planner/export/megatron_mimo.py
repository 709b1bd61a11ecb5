"""Plan -> the heterogeneous MIMO flags of Megatron-LM main (examples/mimo at commit d98e8a64dd): an encoder grid
(--encoder-tp --encoder-dp) on ranks 0.. and the language grid (--llm-offset --llm-tp --llm-pp --llm-dp) after it, launched
with examples.mimo.pretrain_mimo. Megatron-LM core_v0.16.1 (`--to megatron`) has none of these: it runs one layout."""
from __future__ import annotations

from planner.export.common import (
    Drops,
    Roles,
    Unsupported,
    activation_tiers,
    collapsed,
    is_megatron_order,
    recompute_of,
    sequence_parallel,
    span,
)
from planner.export.megatron import (
    args_file,
    dtype_flags,
    model_chunks,
    no_activation_offload,
    pipeline_flags,
    recompute_flags,
    tier_flags,
    zero_flags,
)
from plans.graph import Profile
from plans.plan import Group, Plan

# The code the files are written for and checked with (tests/fixtures/README.md: a pinned copy of this commit's
# examples/mimo/training/args.py and what it imports).
MIMO_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def export(plan: Plan, drops: Drops, source: str, profile: Profile | None = None) -> str:
    enc, llm = _grids(plan)
    roles = Roles.of(plan)
    notes: list[str] = []
    args, world = _mimo(plan, roles, drops, notes, enc, llm)
    return args_file(plan, roles, args, world, drops, notes, profile, source, "megatron-mimo")


def _grids(plan: Plan) -> tuple[Group, Group]:
    """(encoder group, LLM group): the MIMO flags hold exactly one encoder grid and one language grid on disjoint
    ranks. Any other plan is refused in one line naming the target that expresses it (--lossy does not help here:
    the nearest plan is another target's)."""
    groups = collapsed(plan)
    if groups is not None and len(groups) == 2:
        return groups[0], groups[1]
    if groups is None:
        why = ("colocated groups with their own layouts (its module grids are disjoint rank ranges): `--to megatron --lossy` "
               "exports the nearest one layout")
    elif len(groups) == 1:
        why = "a plan of one layout (its flags place an encoder grid beside the language grid): export it with `--to megatron`"
    else:
        why = (f"{len(groups) - 1} encoder groups on their own ranks (its flags hold one encoder grid): `--to megatron-bridge` "
               "expresses every group on its own ranks")
    raise Unsupported(f"megatron-mimo (Megatron-LM main {MIMO_COMMIT[:10]}'s heterogeneous MIMO flags) cannot express {why}")


def _mimo(plan: Plan, roles: Roles, drops: Drops, notes: list[str], enc: Group, llm: Group) -> tuple[list[list[str]], int]:
    """examples/mimo/training/args.py: the encoder grid (tp, dp; cp = pp = 1) on ranks 0.., the language grid at
    --llm-offset; module grids must cover the world; hetero MIMO needs the distributed optimizer."""
    enc_dp = enc.dp
    if enc.pp > 1:
        enc_dp = enc.dp * enc.pp
        drops.cannot(f"pipeline parallelism in encoder group {enc.name!r} (pp={enc.pp}; Megatron's encoder grid has pp=1)",
                     f"encoder dp={enc_dp} on the same {len(enc.ranks)} ranks")
    misplaced = [b for b in llm.blocks if not roles.is_llm(b)] + [b for b in enc.blocks if roles.is_llm(b)]
    if misplaced:
        drops.cannot(f"blocks {', '.join(misplaced[:3])}{' ..' if len(misplaced) > 3 else ''} in the other module's group "
                     "(MIMO runs encoders and projectors on the encoder grid, the LLM on the language grid)",
                     "each block on its module's grid")
    enc_n, llm_n = len(enc.ranks), len(llm.ranks)
    offsets = {enc.name: min(enc.ranks), llm.name: min(llm.ranks)}
    for g in (enc, llm):
        if not is_megatron_order(g, offsets[g.name]):
            drops.cannot(f"the rank order of group {g.name!r} (ranks {span(g.ranks)})", "consecutive ranks, tp fastest, then dp, then pp")
    if offsets[enc.name] != 0 or offsets[llm.name] != enc_n:
        gpn = plan.cluster.gpus_per_node
        if gpn % enc.tp or gpn % llm.tp or enc_n % llm.tp:  # a tensor-parallel group would straddle two nodes
            drops.cannot("an encoder grid that does not start at rank 0", f"encoder on ranks 0-{enc_n - 1}, LLM from rank {enc_n}")
        else:
            notes.append(f"ranks renumbered: encoder {enc.name!r} {span(enc.ranks)} -> 0-{enc_n - 1}, LLM {llm.name!r} "
                         f"{span(llm.ranks)} -> {enc_n}-{enc_n + llm_n - 1} (Megatron's MIMO grids put the encoder first; "
                         "every tensor-parallel group stays inside a node)")
    used = enc_n + llm_n
    if used != plan.cluster.world_size:
        notes.append(f"the plan uses {used} of the cluster's {plan.cluster.world_size} GPUs: launch {used} ranks")
    zero = max(enc.zero, llm.zero, 1)
    if min(enc.zero, llm.zero) < 1:
        drops.cannot("ZeRO stage 0 (Megatron's heterogeneous MIMO training requires --use-distributed-optimizer)", "ZeRO-1")
    if enc.zero != llm.zero and zero > 1:
        drops.cannot(f"different ZeRO stages per group ({enc.zero}, {llm.zero})", f"ZeRO-{zero} for both")
    if set(activation_tiers(enc.stages)) - {"keep"} or any(
            (s.memory.params, s.memory.grads, s.memory.optimizer) != ("gpu", "gpu", "gpu") for s in enc.stages):
        drops.cannot(f"memory tiers or recomputation in encoder group {enc.name!r} (the MIMO flags configure the LLM's)",
                     "the encoder's state and activations on the GPU")
    stages = no_activation_offload(llm.stages, drops)
    chunks = model_chunks(stages, plan.training.virtual_stages, roles, drops)
    args = [["--encoder-tp", str(enc.tp)], ["--encoder-dp", str(enc_dp)], ["--llm-offset", str(enc_n)],
            ["--llm-tp", str(llm.tp)], ["--llm-pp", str(llm.pp)], ["--llm-dp", str(llm.dp)]]
    args += pipeline_flags(plan, llm.pp, llm.dp, llm.blocks, chunks, roles, drops)
    if sequence_parallel((enc, llm), drops, " (Megatron's --sequence-parallel sets it for the whole run)"):
        args.append(["--sequence-parallel"])
    args += zero_flags(zero)
    args += recompute_flags(recompute_of(list(chunks), roles, drops))
    args += tier_flags(stages, drops)
    args += dtype_flags(plan)
    return args, used
