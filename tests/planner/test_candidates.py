"""The solver's vectorised stage figures (planner/solver/segments.Segments) are the cost model's own: over random plans,
every segment's op times, tail and memory equal what cost_models computes for the built plan."""
from __future__ import annotations

import random

import pytest

from cost_models.evaluate import evaluate
from cost_models.memory import block_input_bytes, stage_memory
from cost_models.offload import overlaps_compute
from cost_models.tail import stage_tail
from planner.solver.candidates import stage_in_flight
from planner.solver.space import GPU_ONLY, OFFLOAD, Setting, allowed_gpus
from planner.solver.structure import profile_units
from planner.solver.construct import GroupLayout, build_plan, megatron_ranks
from planner.solver.segments import Segments
from plans.cluster import Cluster, Device, Link
from plans.graph import Block, Edge, Profile
from plans.plan import Training

REL = 1e-9  # the vectorised forms use the affine fit of each alpha-beta cost: equal up to rounding


def random_block(rng: random.Random, name: str, group: str, tp: bool) -> Block:
    """A block with random FLOPs, parameters and activations; half of them split by op class (GEMMs, fused attention,
    memory-bound bytes with a replicated share), with an attention core and activations saved outside the TP regions
    (what sequence parallelism and selective recompute change)."""
    fwd, act = 10 ** rng.uniform(9, 12), 10 ** rng.uniform(4, 7)
    extra = {}
    if rng.random() < 0.5:
        attn = rng.uniform(0, 0.3) * fwd
        extra = dict(fwd_matmul_flops=fwd - attn, bwd_matmul_flops=2 * (fwd - attn), fwd_attention_flops=attn,
                     bwd_attention_flops=2 * attn, fwd_memory_bytes=act * rng.uniform(1, 4), bwd_memory_bytes=act * rng.uniform(1, 6),
                     replicated_memory_fraction=rng.uniform(0, 0.5), matmuls=4, activation_replicated_bytes=act * rng.uniform(0, 0.3),
                     attention_core_bytes=act * rng.uniform(0, 0.5) if rng.random() < 0.8 else 0.0)
    return Block(name, group, "Layer", int(10 ** rng.uniform(5, 8)), int(10 ** rng.uniform(5, 8)), fwd, 2 * fwd, act,
                 10 ** rng.uniform(3, 6), supports_tp=tp, signature=name, param_tensors=rng.randint(1, 6), **extra)


def random_plan(seed: int):
    """A chain of 3-8 random blocks on a random 1-2 node cluster, with a random layout: tp, dp, ZeRO stage 0-3, cut
    points, schedule, micro-batches and one tier policy for every stage."""
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    tp_blocks = rng.random() < 0.6
    blocks = tuple(random_block(rng, f"b{i}", "g", tp_blocks and i > 0) for i in range(n))
    edges = tuple(Edge(f"b{i}", f"b{i + 1}", blocks[i].output_bytes) for i in range(n - 1))
    profile = Profile.build(f"random-{seed}", "bf16", 1, blocks, edges)
    per_node = rng.choice([2, 4, 8])
    nodes = rng.choice([1, 2])
    device = Device("sim", {"bf16": 1e14}, 10**12, 1e12, ((1e6, 0.05), (1e9, 0.4), (1e12, 0.7)))
    cluster = Cluster("sim", nodes, per_node, device, intra_node=Link(1e11, 2e-6), inter_node=Link(1e10, 1e-5),
                      host_to_device=Link(2e10, 1e-5), nvme=Link(8e9, 1e-4), host_memory_bytes=10**13, nvme_bytes=10**14,
                      # half the clusters carry measured runtime costs (cost_models/overhead.py)
                      **(dict(optimizer_tensor_s=3e-5, optimizer_byte_s=2e-9, zero_block_s=1e-3, zero_byte_s=1e-12,
                              zero_tensor_s=2e-4)
                         if rng.random() < 0.5 else {}))
    world = cluster.world_size
    while True:
        tp = rng.choice([t for t in (1, 2, 4) if t <= per_node]) if tp_blocks else 1
        dp = rng.choice([1, 2, 4, 8])
        pp = rng.randint(1, n)
        if tp * dp * pp <= world and allowed_gpus(tp * dp, cluster) and allowed_gpus(tp * dp * pp, cluster):
            break
    m = rng.choice([1, 2, 4, 8])
    global_batch = m * dp * rng.choice([1, 2])
    cuts = tuple(sorted(rng.sample(range(1, n), pp - 1)))
    return profile, cluster, tp, dp, rng.choice([0, 1, 2, 3]) if dp > 1 else 0, cuts, m, global_batch, \
        rng.choice(["1f1b", "gpipe"]), rng.choice(GPU_ONLY + OFFLOAD), tp > 1 and rng.random() < 0.6


@pytest.mark.parametrize("seed", range(60))
def test_vectorised_stage_figures_equal_the_cost_model(seed):
    profile, cluster, tp, dp, zero, cuts, m, global_batch, schedule, policy, sp = random_plan(seed)
    unit = profile_units(profile, "chain")[0]
    setting = Setting(cluster, global_batch, schedule, "bf16", "adam", None, (policy,))
    again = zero != 3 or seed % 2 == 0  # ZeRO-3 without reshard_after_forward on odd seeds
    seg = Segments(unit, setting, tp, dp, zero, m, sequence_parallel=sp, reshard_after_forward=again)
    names = tuple(b.name for b in profile.blocks)
    cores = {b.name for b in profile.blocks if b.attention_core_bytes > 0}
    pp = len(cuts) + 1
    bounds = (0, *cuts, len(names))
    memories = tuple(policy.memory(names[a:b], cores) for a, b in zip(bounds, bounds[1:]))
    training = Training(global_batch, m, schedule, dtype="bf16")
    plan = build_plan(profile, cluster, training, [GroupLayout("model", names, cuts, dp, tp, megatron_ranks(dp, tp, pp),
                                                               zero=zero, memory=memories, sequence_parallel=sp,
                                                               reshard_after_forward=again)])
    assert plan.groups[0].sequence_parallel == sp and plan.groups[0].reshard_after_forward == again
    ev = evaluate(plan, profile)
    fwd, bwd, tail, opt, gather = seg.time(policy)
    g0, g1, c0, c1, n0, n1 = seg.memory(policy)
    inputs = block_input_bytes(profile)
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        sc, mem = ev.stages[k], ev.stage_memory[k]
        flight = stage_in_flight(schedule, m, pp - 1 - k)
        assert flight == sc.in_flight
        assert fwd[a, b] == pytest.approx(sc.fwd_s, rel=REL) and bwd[a, b] == pytest.approx(sc.bwd_s, rel=REL)
        params = sum(x.params / (tp if x.supports_tp else 1) for x in profile.blocks[a:b])
        tensors = sum(x.param_tensors for x in profile.blocks[a:b])
        # GPUs: ZeRO 1-2's gather is what it adds to the next first forward (fsdp.first_forward_gather), which the
        # simulator prices per block; the segments must price the same (gather[a, b] below)
        ahead = sc.param_gather_s if overlaps_compute(cluster) and zero in (1, 2) else None
        scalar = stage_tail(plan.groups[0], k, params, training, cluster, overlap_s=sc.time.bwd, tensors=tensors,
                            gather_exposed_s=ahead)
        assert (scalar.grad_sync, scalar.optimizer, scalar.param_gather) == (sc.grad_sync_s, sc.optimizer_s, sc.param_gather_s)
        if memories[k].optimizer == "gpu" or not cluster.optimizer_tensor_s:
            assert tail[a, b] == pytest.approx(scalar.total, rel=REL)
            assert opt[a, b] == pytest.approx(scalar.optimizer, rel=REL)
        else:  # measured costs with the state off the device: the slower of two models, which the segments bound below
            assert opt[a, b] <= scalar.optimizer * (1 + REL) and tail[a, b] <= scalar.total * (1 + REL)
        assert gather[a, b] == pytest.approx(scalar.param_gather, rel=REL, abs=1e-15)
        direct = stage_memory(profile.blocks[a:b], samples=global_batch / m / dp, tp=tp, dp=dp, zero=zero,
                              memory=memories[k], in_flight_micro_batches=flight, input_bytes=inputs, sequence_parallel=sp,
                              reshard_after_forward=again)
        assert direct == mem
        assert g0[a, b] + flight * g1[a, b] == pytest.approx(mem.gpu, rel=REL)
        assert c0[a, b] + flight * c1[a, b] == pytest.approx(mem.cpu, rel=REL, abs=1e-6)
        assert n0[a, b] + flight * n1[a, b] == pytest.approx(mem.nvme, rel=REL, abs=1e-6)


def test_a_colocated_source_also_gets_every_leaner_policy_and_keeps_its_fastest():
    # a source sharing the sink's ranks: per (tp, dp, ZeRO, ...) its fastest fitting policy (what unit_layouts picks)
    # and the slower policies holding less GPU memory than each faster one kept (candidates.colocated_layouts)
    from planner.solver.candidates import colocated_layouts, unit_layouts

    extra = 0
    for seed in range(12):
        profile, cluster, *_, global_batch, schedule, _, _ = random_plan(seed)
        unit = profile_units(profile, "chain")[0]
        setting = Setting(cluster, global_batch, schedule, policies=GPU_ONLY)
        sizes = {g for g in range(1, cluster.world_size + 1) if allowed_gpus(g, cluster)}
        old = [lay for lay in unit_layouts(unit, setting, 1, max_gpus=cluster.world_size, downstream=[1, 2],
                                           merge_depths=False, max_pp=1) if lay.gpus in sizes]
        new = colocated_layouts(unit, setting, 1, max_gpus=cluster.world_size, depths=[1, 2], sizes=sizes)
        key = lambda lay: (lay.tp, lay.dp, lay.zero, lay.reshard_after_forward, lay.sequence_parallel, lay.downstream)
        fronts: dict[tuple, list] = {}
        for lay in new:
            fronts.setdefault(key(lay), []).append(lay)
        for lay in old:  # the fastest policy of each run is still there, with the same figures
            assert any(n.policies == lay.policies and n.bound.own == pytest.approx(lay.bound.own, rel=REL)
                       for n in fronts[key(lay)])
        for lays in fronts.values():  # slower only where leaner
            lays.sort(key=lambda lay: lay.bound.own)
            assert all(max(b.gpu_bytes) < max(a.gpu_bytes) for a, b in zip(lays, lays[1:]))
        extra += len(new) - len(old)
    assert extra > 0  # some runs gained a leaner variant
