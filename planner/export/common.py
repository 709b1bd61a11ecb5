"""What every exporter needs from a plan: block roles, the plan as one pipeline, recomputation, the header, and
the rule for features a target cannot express (one line and exit 2, or dropped and said with --lossy)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from plans.errors import MmplanError
from plans.plan import Group, Memory, Plan, Stage

# Vocabulary. A plan is read only through plan.groups (name, dp, tp, pp, zero, colocated_with, stages[].blocks,
# stages[].ranks, stages[].memory), plan.training, plan.cluster, plan.profile and plan.predicted.
# - "LLM": the model's language decoder. The plan lists groups in data-flow order (encoders before the LLM; see
#   planner/solver/solve.py) and a group's blocks in execution order, so the LLM is the top-level module (the text
#   before the first ".") of the plan's last block; every other top-level module is an encoder or projector.
# - "layer": a block that is an element of a numbered container (`llm.layers.7`), i.e. a transformer layer.
#   Blocks of the LLM before its first layer are its embedding, those after its last layer its final norm and
#   head (Megatron's "E" and "L").
# - "chain": the plan as one pipeline: pp stages of dp x tp ranks each, every stage of the same dp, tp and ZeRO
#   stage, ranks 0..world-1 in Megatron order (tp fastest, then dp, then pp). One-layout targets (torchtitan,
#   DeepSpeed, Megatron-LM without MIMO) express exactly the plans that are chains.

_LAYER = re.compile(r"\.\d+$")

# The version of each target the exports are written for and checked with (tests/planner/test_export_targets.py;
# pinned copies in tests/fixtures/README.md); every export's header and `mmplan export --to`'s help name it.
VERSIONS = {
    "megatron": "Megatron-LM core_v0.16.1 (megatron-core 0.16.1)",
    "megatron-mimo": ("Megatron-LM main at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22): its heterogeneous MIMO "
                      "flags, examples.mimo.pretrain_mimo and ModuleGridSpec are not in core_v0.16.1 / megatron-core 0.16.1"),
    "megatron-bridge": "Megatron-Bridge main 0.7.0 (commit 067f987df0) on megatron-core 0.16.1",
    "torchtitan": "torchtitan 0.3.0",
    "deepspeed": "DeepSpeed 0.19.8",
}


class Unsupported(MmplanError):
    """A feature of the plan the target cannot express (the CLI prints it on one line and exits 2)."""


@dataclass
class Drops:
    """Features a target cannot express: an error without --lossy, else collected and written into the export."""

    target: str
    lossy: bool
    dropped: list[str] = field(default_factory=list)

    refused: list[tuple[str, str]] = field(default_factory=list)  # without --lossy: every feature, raised at the end

    def cannot(self, feature: str, nearest: str) -> None:
        """The target cannot express `feature`; with --lossy the export uses `nearest` instead and says so. Without
        it the exporter goes on with `nearest` too, so that `check` names every such feature in one error."""
        if not self.lossy:
            self.refused.append((feature, nearest))
        self.dropped.append(f"{feature} -> {nearest}")

    def check(self) -> None:
        """Raise Unsupported naming every feature the target cannot express (one line), unless --lossy."""
        if self.refused:
            features = "; ".join(f"({i}) {f}" if len(self.refused) > 1 else f for i, (f, _) in enumerate(self.refused, 1))
            nearest = "; ".join(n for _, n in self.refused)
            raise Unsupported(f"{self.target} cannot express {features}; --lossy exports the nearest plan ({nearest}) "
                              "and lists what it dropped")


@dataclass(frozen=True)
class Roles:
    """Which blocks are the LLM's, which are transformer layers (see the vocabulary above)."""

    llm: str  # top-level module of the LLM, e.g. "llm"; "" for a text-only model whose blocks are top-level (embed, layers.N, head)

    @classmethod
    def of(cls, plan: Plan) -> Roles:
        last = plan.groups[-1].stages[-1].blocks[-1]
        return cls(top(last) if "." in last else "")

    def is_llm(self, block: str) -> bool:
        return not self.llm or top(block) == self.llm

    def local(self, block: str) -> str:
        """The block's name inside the LLM: `llm.layers.3` -> `layers.3` (a text-only model's names are already)."""
        return block.split(".", 1)[1] if self.llm and "." in block else block if not self.llm else ""

    @staticmethod
    def is_layer(block: str) -> bool:
        return bool(_LAYER.search(block))

    def llm_layers(self, blocks) -> list[str]:
        return [b for b in blocks if self.is_llm(b) and self.is_layer(b)]


def top(block: str) -> str:
    """The top-level module of a block name: `vision.layers.3` -> `vision`, `vision_proj` -> `vision_proj`."""
    return block.split(".", 1)[0]


def span(ranks) -> str:
    ranks = sorted(ranks)
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def is_megatron_order(g: Group, offset: int) -> bool:
    """The group's stages hold ranks offset.. consecutively (tp fastest, then dp, then pp), as every target lays them."""
    per = g.dp * g.tp
    return all(tuple(s.ranks) == tuple(range(offset + i * per, offset + (i + 1) * per)) for i, s in enumerate(g.stages))


def root(plan: Plan, g: Group) -> Group:
    while g.colocated_with is not None:
        g = plan.group(g.colocated_with)
    return g


# --- the plan as one pipeline -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chain:
    """One layout for the whole model: stages of dp x tp ranks each, consecutive ranks from 0."""

    dp: int
    tp: int
    zero: int
    stages: tuple[Stage, ...]
    note: str = ""  # how the ranks were renumbered, if they were
    sequence_parallel: bool | None = None  # None: the plan's groups' (they are the chain); else the kept group's

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(b for s in self.stages for b in s.blocks)


def collapsed(plan: Plan) -> tuple[Group, ...] | None:
    """The plan's groups with every set of colocated groups that share one layout (same ranks, dp, tp, ZeRO and
    state tiers, none pipelined) merged into one group of all their blocks -- they are one layout, exactly; None
    when colocated groups differ (per-group layouts on shared ranks)."""
    out: list[Group] = []
    for host in (g for g in plan.groups if g.colocated_with is None):
        members = [g for g in plan.groups if root(plan, g) is host]
        if len(members) == 1:
            out.append(host)
            continue
        state = {(g.stages[0].memory.params, g.stages[0].memory.grads, g.stages[0].memory.optimizer) for g in members}
        if not all((g.dp, g.tp, g.zero, g.pp, tuple(g.ranks)) == (host.dp, host.tp, host.zero, 1, tuple(host.ranks))
                   for g in members) or len(state) > 1:
            return None
        mems = [g.stages[0].memory for g in members]
        memory = replace(mems[0], activations={b: t for m in mems for b, t in m.activations.items()})
        stage = Stage(tuple(b for g in members for b in g.blocks), host.stages[0].ranks, memory)
        out.append(Group(host.name, host.dp, host.tp, 1, (stage,), host.zero))
    order = {g.name: min(i for i, x in enumerate(plan.groups) if root(plan, x).name == g.name) for g in out}
    return tuple(sorted(out, key=lambda g: order[g.name]))


def chain_view(plan: Plan) -> Chain | None:
    """The plan as one pipeline when it is exactly one: a single layout (see collapsed), or one encoder layout on its
    own ranks whose dp, tp and ZeRO stage equal the LLM's, feeding the LLM as its first stage(s). Ranks are laid 0..
    in stage order (Megatron order); when the plan numbers them otherwise, the chain says so in `note` -- a
    renumbering that keeps every tensor-parallel group inside a node, as tp divides the GPUs per node."""
    groups = collapsed(plan)
    if groups is None or len(groups) > 2:
        return None
    first = groups[0]
    if any((g.dp, g.tp, g.zero) != (first.dp, first.tp, first.zero) for g in groups):
        return None
    stages = tuple(s for g in groups for s in g.stages)
    per = first.dp * first.tp
    if plan.cluster.gpus_per_node % first.tp:
        return None
    laid = tuple(replace(s, ranks=tuple(range(i * per, (i + 1) * per))) for i, s in enumerate(stages))
    note = ""
    if laid != stages:
        if any(not is_megatron_order(g, min(g.ranks)) for g in groups):
            return None  # ranks inside a group in another order: not a renumbering of whole stages
        old = ", ".join(f"{g.name} {span(g.ranks)}" for g in groups)
        note = f"ranks renumbered in pipeline order ({old} -> 0-{per * len(stages) - 1}); every tensor-parallel group stays in a node"
    used = per * len(stages)
    if used != plan.cluster.world_size:
        note = "; ".join(filter(None, [note, f"the plan uses {used} of the cluster's {plan.cluster.world_size} GPUs: launch {used} ranks"]))
    return Chain(first.dp, first.tp, first.zero, laid, note)


def nearest_chain(plan: Plan, drops: Drops, why: str = "per-group layouts", *, headline: bool = True) -> Chain:
    """The plan as one pipeline; when it is not one, the nearest: the LLM group's layout over every GPU with the
    other groups' blocks in its first stage (Megatron's place for encoders), each change recorded in `drops`: the
    headline (skipped when the caller has said it) and every semantic change per group (ZeRO stage, tp, dp,
    sequence parallelism), which a headline alone would hide."""
    chain = chain_view(plan)
    if chain is not None:
        return chain
    main = root(plan, plan.groups[-1])
    others = [g for g in plan.groups if g is not main]
    world = plan.cluster.world_size
    per_stage = main.tp * main.pp
    dp = world // per_stage if world % per_stage == 0 and (plan.training.micro_batch % (world // per_stage)) == 0 else main.dp
    extra = tuple(b for g in others for b in g.blocks)
    acts = {b: t for g in others for s in g.stages for b, t in s.memory.activations.items()}
    first = main.stages[0]
    stage0 = replace(first, blocks=extra + first.blocks, memory=replace(first.memory, activations={**acts, **first.memory.activations}))
    stages = (stage0, *main.stages[1:])
    per = dp * main.tp
    stages = tuple(replace(s, ranks=tuple(range(i * per, (i + 1) * per))) for i, s in enumerate(stages))
    what = "; ".join(f"group {g.name!r} dp={g.dp} tp={g.tp} pp={g.pp} "
                     f"{'colocated with ' + repr(g.colocated_with) if g.colocated_with else 'on ranks ' + span(g.ranks)}"
                     for g in others)
    layout = f"the layout of group {main.name!r}, dp={dp} tp={main.tp} pp={main.pp}, over ranks 0-{dp * per_stage - 1}"
    if headline and others:
        drops.cannot(f"{why}: {what}", f"{layout}, the other groups' blocks in its first stage")
    elif headline:
        drops.cannot(f"the rank order of group {main.name!r} (ranks {span(main.ranks)})", layout)
    for g in others:
        semantic_changes(g, main, dp, drops)
    if dp != main.dp:
        drops.cannot(f"dp={main.dp} in group {main.name!r}", f"dp={dp} (every GPU in one layout)")
    return Chain(dp, main.tp, main.zero, stages, sequence_parallel=main.tp > 1 and main.sequence_parallel)


def semantic_changes(g: Group, main: Group, dp: int, drops: Drops) -> None:
    """What running group `g`'s blocks with `main`'s layout (data-parallel over `dp`) changes in how they train."""
    if g.zero != main.zero:
        drops.cannot(f"ZeRO-{g.zero} in group {g.name!r}", f"ZeRO-{main.zero}, the stage of group {main.name!r}")
    if (g.dp, g.tp) != (dp, main.tp):
        drops.cannot(f"dp={g.dp} tp={g.tp} in group {g.name!r}", f"dp={dp} tp={main.tp}")
    sp_before = g.tp > 1 and g.sequence_parallel
    sp_after = main.tp > 1 and main.sequence_parallel
    if sp_before != sp_after:
        drops.cannot(f"sequence parallelism {'on' if sp_before else 'off'} in group {g.name!r} (tp={g.tp})",
                     f"{'on' if sp_after else 'off'}, as in group {main.name!r} (tp={main.tp})")


# --- recomputation and memory tiers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recompute:
    """Recomputation as the Megatron family of targets expresses it (the convention of planner/solver/megatron_split.py:
    "full" recomputes every block, "selective" every transformer layer; "block" the first k layers of each stage)."""

    kind: str  # "none" | "full" | "selective" | "block"
    layers: int = 0  # for "block": layers recomputed at the start of every stage (model chunk)


def recompute_of(chunks: list[tuple[tuple[str, ...], Memory]], roles: Roles, drops: Drops) -> Recompute:
    """The recomputation of pipeline chunks (blocks, memory), in the Megatron family's terms: "full" when every block
    is recomputed, "selective" when exactly the transformer layers are (all of them, or the LLM's), "block" when the
    first k LLM layers of every chunk are; anything else is recorded in `drops` as the nearest block count."""
    recomputed = [{b for b, t in mem.activations.items() if t == "recompute"} for _, mem in chunks]
    if not any(recomputed):  # the attention core alone ("selective" tier) is Megatron's own selective recomputation
        selective = any(t == "selective" for _, mem in chunks for t in mem.activations.values())
        return Recompute("selective" if selective else "none")
    if all(set(blocks) <= r for (blocks, _), r in zip(chunks, recomputed)):
        return Recompute("full")
    layers = [{b for b in blocks if roles.is_layer(b)} for blocks, _ in chunks]
    llm = [[b for b in blocks if roles.is_layer(b) and roles.is_llm(b)] for blocks, _ in chunks]
    if all(r == every for r, every in zip(recomputed, layers)) or all(r == set(ls) for r, ls in zip(recomputed, llm)):
        return Recompute("selective")
    counts = {len(r) if r == set(ls[:len(r)]) else -1 for r, ls in zip(recomputed, llm)}
    if len(counts) == 1 and counts != {-1}:
        return Recompute("block", counts.pop())
    k = max(len(r & set(ls)) for r, ls in zip(recomputed, llm)) or 1
    drops.cannot(f"per-stage recomputation ({', '.join(str(len(r)) for r in recomputed)} blocks recomputed per stage)",
                 f"the first {k} LLM layers of every stage recomputed")
    return Recompute("block", k)


def uniform_tier(stages, kind: str, drops: Drops) -> str:
    """The tier ('gpu' | 'cpu' | 'nvme') of params / grads / optimizer state, one for all stages (targets set it
    globally); when stages differ, the most offloaded one (it fits wherever the plan fitted)."""
    tiers = {getattr(s.memory, kind) for s in stages}
    if len(tiers) == 1:
        return tiers.pop()
    pick = "nvme" if "nvme" in tiers else "cpu"
    drops.cannot(f"per-stage {kind} tiers ({', '.join(sorted(tiers))})", f"{kind} in {pick} on every stage")
    return pick


def chain_sequence_parallel(chain: Chain, plan: Plan, drops: Drops) -> bool:
    """Sequence parallelism of a chain: the plan's groups' one setting, or, for the nearest chain, its kept group's
    (nearest_chain recorded what changes for the others)."""
    if chain.sequence_parallel is not None:
        return chain.sequence_parallel
    return chain.tp > 1 and sequence_parallel(plan.groups, drops)


def sequence_parallel(groups, drops: Drops, why: str = "") -> bool:
    """Whether the target runs sequence parallelism, one setting for `groups` (a target sets it once): that of their
    tensor-parallel groups (tp > 1; sequence parallelism shards along their tp); when they differ, on."""
    settings = {g.sequence_parallel for g in groups if g.tp > 1}
    if len(settings) > 1:
        drops.cannot(f"sequence parallelism in some tensor-parallel groups only{why}", "sequence parallelism in every one")
    return True in settings


def activation_tiers(stages) -> set[str]:
    return {t for s in stages for t in s.memory.activations.values()}


def offloaded_as_recomputed(stage: Stage) -> Stage:
    """The stage with activations offloaded to CPU or NVMe recomputed instead (the nearest a target without
    activation offload has: it saves at least as much GPU memory)."""
    acts = {b: ("recompute" if t.startswith("offload") else t) for b, t in stage.memory.activations.items()}
    return replace(stage, memory=replace(stage.memory, activations=acts))


# --- the opening comment ------------------------------------------------------------------------------------------


def header(plan: Plan, source: str, target: str, dropped: list[str], notes: list[str] = ()) -> list[str]:
    """Comment lines (without the comment marker) naming the plan, its predicted figures, the target's version the
    file is written for and what was dropped."""
    t = plan.training
    lines = [f"mmplan plan {source}: {plan.profile.model} (fingerprint {plan.profile.fingerprint}) on {plan.cluster.name}, "
             f"{plan.cluster.world_size} GPUs ({plan.cluster.nodes} x {plan.cluster.gpus_per_node} {plan.cluster.device.name})",
             f"training: global batch {t.global_batch} in {t.micro_batches} micro-batches, {t.schedule}"
             + (f" with {t.virtual_stages} chunks per rank" if t.virtual_stages > 1 else "") + f", {t.dtype}, {t.optimizer}"]
    p = plan.predicted
    if p is None:
        lines.append("predicted: none (a plan written by hand; run `mmplan compare PLAN --profile PROFILE`)")
    else:
        peak = max((m.gpu for m in p.memory), default=0.0)
        lines.append(f"predicted: step {p.step_time_s:.4g} s, {p.samples_per_s:,.1f} samples/s, {p.tflops_per_gpu:.1f} TFLOP/s per GPU, "
                     f"MFU {p.mfu:.1%}, bubble {p.bubble_fraction:.1%}, peak GPU memory {peak / 1e9:.1f} GB"
                     + ("" if p.fits else " (does not fit)"))
    for g in plan.groups:
        lines.append(f"group {g.name}: dp={g.dp} tp={g.tp} pp={g.pp} zero={g.zero}, "
                     + (f"colocated with {g.colocated_with}" if g.colocated_with else f"ranks {span(g.ranks)}")
                     + f", cuts before {', '.join(s.blocks[0] for s in g.stages[1:]) or '-'}")
    lines.append(f"exported by `mmplan export --to {target}`" + (" --lossy" if dropped else "") + f" for {VERSIONS[target]}")
    lines += [f"note: {n}" for n in notes]
    if dropped:
        lines += ["LOSSY: this is the nearest plan the target can express; dropped:"] + [f"  - {d}" for d in dropped]
    return lines
