"""One rank built from a plan: the composition root of the runtime (`build_rank`); train.py runs what it builds.

The order techniques are applied in is written once, in `build_rank`'s docstring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plans.plan import Plan
from runtime.blocks import block_modules
from runtime.boundary import Exchange
from runtime.data import open_dataset
from runtime.hf import data_example
from runtime.grad_buckets import GradBuckets
from runtime.job import Job
from runtime.launch import RankContext
from runtime.memory import RankTiers
from runtime.precision import to_precision
from runtime.program import trace_program
from runtime.samples import sample_rows
from runtime.schedule import Task, rank_tasks
from runtime.source import call_factory, resolve
from runtime.stage import RankModel, build_rank_model
from runtime.stage_map import StageMap, build_stage_map
from runtime.ties import TiedCopy, check_copies, find_ties, tied_copies
from runtime.tp_stage import parallelize_stage


@dataclass
class Rank:
    """This rank's part of the run: its blocks with their parallelism and tiers, its tasks, its ends of the routes,
    and the process groups of its stages (keyed "group/index"; ZeRO and buckets by chunk key)."""

    stage_map: StageMap
    rm: RankModel
    dataset: Any
    stage_inputs: dict[str, tuple[str, ...]]  # chunk key -> the batch inputs its glue reads
    tasks: list[Task]
    exchange: Exchange
    route_index: dict[int, int]  # id(route) -> its index in stage_map.routes
    dp_groups: dict[str, Any]
    tp_groups: dict[str, Any]
    stage_tp: dict[str, Any]  # stage key -> runtime/tp_stage.py's record of what it sharded
    zero_blocks: dict[str, list]  # chunk key -> its blocks sharded by FSDP2 (ZeRO 1-3)
    zero_replicated: dict[str, list]  # stage key -> adopted parameters ZeRO leaves whole
    last_backward: dict[str, int]  # chunk key -> index of its last backward task (ZeRO syncs, buckets armed there)
    tiers: RankTiers
    buckets: dict[str, GradBuckets]  # chunk key -> its bucketed dp all-reduce
    tied: list[TiedCopy]  # this rank's copies of parameters tied across stages (runtime/ties.py)

    def tie_names(self) -> dict[str, str]:
        """'block.local name' of each copy this rank holds of a tie owned by a block of another stage -> the tie's
        name (its owner's, under which checkpoints keep its optimizer state)."""
        return {f"{c.block}.{c.local}": c.parameter for c in self.tied if c.block != c.owner}

    def stage(self, key: str):
        """The first chunk of the stage "group/index" (what its chunks share: group, stage, dp, tp, ranks)."""
        return _first_chunk(self.stage_map, key)


def build_rank(ctx: RankContext, job: Job) -> Rank:
    """Build this rank of the job's plan. The composition order, and why:

    1. precision — the whole model with its initial weights in the plan's dtype, frozen blocks frozen (the same on
       every rank and in the reference run: `build_model`);
    2. program — the forward traced once (fx, or the model's own forward); the plan's stage map checked against it;
    3. this rank's blocks (the others dropped to the meta device), its tasks in the plan's schedule, its route ends;
    4. process groups — every stage's dp and tp groups, then the groups of the copies of each parameter tied across
       stages (runtime/ties.py); collective: every rank creates every group, in one order;
    5. tensor parallelism (vocabulary, sequence parallelism) — it replaces the sharded parameters, so it comes
       before anything holds references to them;
    6. ZeRO (FSDP2) — it shards the tp-local tensors, so after 5, and before the tiers, whose optimizer runs on
       its local shards;
    7. memory tiers — device budget, activation tiers, parameter / gradient / optimizer placement and Adam, over
       the parameters as 5 and 6 left them;
    8. gradient buckets — the dp all-reduce during the backward, over the device-tier parameters of 7.
    """
    plan = job.plan
    model, example = build_model(job)  # 1
    data = data_example(job.model, job.plan.training.micro_batch, example)  # images of several sizes: runtime/hf.py
    dataset = open_dataset(job.data, data, vocab_of(model), job.seed, model=model)
    program = trace_program(model, example)  # 2
    stage_map = build_stage_map(plan, program)
    local = {b for st in stage_map.stages_on(ctx.rank) for b in st.blocks}  # 3
    ties = find_ties(block_modules(model), [b.name for b in plan.flow.blocks] if plan.flow is not None else [])
    rm = build_rank_model(model, example, local, ctx.device, program)
    tasks = rank_tasks(stage_map, plan.training.schedule, ctx.rank)
    exchange = Exchange(stage_map, ctx.rank, rm.specs, ctx.device, getattr(program, "batch_rows", sample_rows))
    dp_groups, tp_groups = process_groups(plan, stage_map, ctx.rank)  # 4
    exchange.tp_groups = tp_groups
    tied = tied_copies(stage_map, ties, ctx.rank)
    stage_tp = apply_tensor_parallel(plan, stage_map, rm, tp_groups, ctx.rank)  # 5
    zero_blocks, zero_replicated = apply_zero_stages(plan, stage_map, rm, dp_groups, ctx)  # 6
    check_copies(tied, rm.local)  # the copies of a tie alike after 5 and 6 (collective over each tie's group)
    mine = stage_map.stages_on(ctx.rank)  # 7
    tiers = RankTiers([(st.blocks, plan.group(st.group).stages[st.stage].memory) for st in mine], rm.local,
                      limit=job.device_budget, nvme_dir=job.nvme_dir, device=ctx.device, lr=job.lr, prefetch=job.prefetch)
    buckets = grad_buckets(job, stage_map, rm, dp_groups, ctx.rank)  # 8
    return Rank(stage_map, rm, dataset, {key: _stage_inputs(rm, st.blocks, key == stage_map.loss_stage)
                                         for key, st in stage_map.stages.items()},
                tasks, exchange, {id(r): i for i, r in enumerate(stage_map.routes)}, dp_groups, tp_groups, stage_tp,
                zero_blocks, zero_replicated, {t.stage: i for i, t in enumerate(tasks) if t.kind != "F"}, tiers, buckets, tied)


def build_model(job: Job, micro_batch: int = 1) -> tuple[nn.Module, dict[str, Any]]:
    """The model with its initial weights in the plan's precision (runtime/precision.py), the plan's frozen blocks
    frozen: the same on every rank and in the reference run."""
    torch.manual_seed(job.seed)
    model, example = to_precision(*call_factory(resolve(job.model), micro_batch), job.plan.training.dtype)
    frozen = {b.name for b in job.plan.flow.blocks if b.frozen} if job.plan.flow is not None else set()
    if frozen:
        for name, m in block_modules(model).items():
            if name in frozen:
                m.requires_grad_(False)
    return model, example


def vocab_of(model: nn.Module) -> int:
    """The classes of the model's output head (a transformers model's output embeddings), else its largest
    nn.Embedding: Mllama's token table has 8 rows more than its LM head has classes."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, nn.Linear):
        return head.out_features
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(sizes) if sizes else 2


def process_groups(plan: Plan, stage_map: StageMap, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's data-parallel group (same tp index across replicas) and tensor-parallel group of each of its
    stages (keyed "group/index": a stage's chunks share them). new_group is collective: every rank creates every
    group, in the same order."""
    dp_groups, tp_groups = {}, {}
    for st in stage_map.stages.values():
        if st.index:  # a further chunk of an interleaved stage
            continue
        if st.dp > 1 or plan.group(st.group).zero:  # ZeRO shards over the group even at dp 1 (FSDP2 path)
            for k in range(st.tp):
                ranks = [st.ranks[r * st.tp + k] for r in range(st.dp)]
                g = dist.new_group(ranks)
                if rank in ranks:
                    dp_groups[st.key] = g
        if st.tp > 1:
            for r in range(st.dp):
                g = dist.new_group(list(st.tp_ranks(r)))
                if rank in st.tp_ranks(r):
                    tp_groups[st.key] = g
    return dp_groups, tp_groups


def chunks_of(stage_map: StageMap, key: str, rank: int | None) -> list[str]:
    """The chunk keys of stage "group/index" (one, or v under the interleaved schedule) on `rank`, in order; with
    rank None on every rank of the stage (the same chunks)."""
    keys = stage_map.stages if rank is None else stage_map.keys_on(rank)
    return [ck for ck in keys if stage_map.stages[ck].key == key]


def _first_chunk(stage_map: StageMap, key: str):
    return next(c for c in stage_map.stages.values() if c.key == key)


def apply_tensor_parallel(plan: Plan, stage_map: StageMap, rm: RankModel, tp_groups: dict[str, Any],
                          rank: int) -> dict[str, Any]:
    """Shard the blocks that support it (transformer layers; the token embedding, LM head and loss over the
    vocabulary; sequence parallelism where the plan asks) across their replica's tp ranks; the others stay
    replicated (runtime/tp_stage.py). Returns what was done per stage key."""
    done: dict[str, Any] = {}
    for key, group in tp_groups.items():
        st = _first_chunk(stage_map, key)
        leaving = {r.block for ck in chunks_of(stage_map, key, None) for r in stage_map.routes_out_of(ck)}
        done[key] = parallelize_stage(
            rm.program, stage_map.stage_blocks(key), rm.local, group, st.tp_index(rank), st.tp,
            vocab=vocab_of(rm.model), leaving=leaving, sequence_parallel=plan.group(st.group).sequence_parallel)
    return done


def _adopted(rm: RankModel, blocks) -> list:
    """The adopted parameters (runtime/stage.adopt_free_parameters) of these blocks on this rank."""
    out = []
    for alias in rm.aliases:
        block, local = alias.rsplit(".", 1)
        if block in blocks and block in rm.local:
            out.append(rm.local[block].get_parameter(local))
    return out


def apply_zero_stages(plan: Plan, stage_map: StageMap, rm: RankModel, dp_groups: dict[str, Any],
                      ctx: RankContext) -> tuple[dict[str, list], dict[str, list]]:
    """Shard the blocks of each ZeRO stage over their data-parallel group with FSDP2 (runtime/zero.py); keyed by
    chunk, since each chunk's last backward of the step is when its gradients are final. Also returns, per stage
    key, the adopted parameters left whole (read outside their block: all-reduced instead)."""
    from runtime.zero import apply_zero, check_ties_within_chunks  # FSDP2: imported by the runs that use it

    sharded: dict[str, list] = {}
    replicated: dict[str, list] = {}
    for key, group in dp_groups.items():
        st = _first_chunk(stage_map, key)
        zero = plan.group(st.group).zero
        if not zero:
            continue
        offload = plan.group(st.group).stages[st.stage].memory.params == "cpu"
        check_ties_within_chunks([stage_map.stages[ck].blocks for ck in chunks_of(stage_map, key, ctx.rank)], rm.local)
        for ck in chunks_of(stage_map, key, ctx.rank):
            blocks = stage_map.stages[ck].blocks
            adopted = _adopted(rm, blocks)
            if adopted:
                replicated[key] = replicated.get(key, []) + adopted
            sharded[ck] = apply_zero({b: rm.local[b] for b in blocks}, group, zero, ctx.device, offload,
                                     replicated=adopted,
                                     reshard_after_forward=plan.group(st.group).reshard_after_forward)
    return sharded, replicated


def grad_buckets(job: Job, stage_map: StageMap, rm: RankModel, dp_groups: dict[str, Any],
                 rank: int) -> dict[str, GradBuckets]:
    """Bucketed all-reduce during the backward for the dp stages whose parameters and gradients stay in the
    device tier (the host tiers move gradients after the backward: those stages reduce after it) and that are not
    ZeRO-sharded (ZeRO reduce-scatters instead)."""
    out = {}
    for key, group in dp_groups.items():
        st = _first_chunk(stage_map, key)
        memory = job.plan.group(st.group).stages[st.stage].memory
        if job.bucket_bytes > 0 and memory.params == memory.grads == "gpu" and not job.plan.group(st.group).zero:
            for ck in chunks_of(stage_map, key, rank):  # per chunk: armed at the chunk's last backward of the step
                params = [p for b in stage_map.stages[ck].blocks for p in rm.local[b].parameters() if p.requires_grad]
                if params:
                    out[ck] = GradBuckets(list({id(p): p for p in params}.values()), group, job.bucket_bytes)
    return out


def _stage_inputs(rm: RankModel, blocks: tuple[str, ...], loss: bool) -> tuple[str, ...]:
    keys: set[str] = set()
    for b in blocks:
        if b in rm.program.blocks:
            keys |= rm.program.deps(rm.program.blocks[b])[1]
    if loss:
        keys |= rm.program.deps(rm.program.output)[1]
    return tuple(sorted(keys))
