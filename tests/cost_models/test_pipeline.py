"""Pipeline simulator against the literature: bubbles of GPipe / 1F1B / interleaved, groups in parallel or colocated."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.comm import all_gather_time, all_reduce_time, p2p_time, reduce_scatter_time
from cost_models.compute import mixed_precision_step_bytes
from cost_models.fsdp import copy_time, host_floor
from cost_models.offload import optimizer_step_time
from cost_models.offload import transfer_time
from cost_models.pipeline import simulate
from cost_models.tail import BUCKET_BYTES
from plans import plan as P
from plans.cluster import Cluster, Device, Link
from plans.errors import MmplanError
from plans.graph import Block, Edge, Profile

PEAK = 1e12  # FLOP/s; efficiency 1 everywhere, so a block of f FLOPs per sample takes f x samples / PEAK s


def make_cluster(nodes: int = 4, gpus_per_node: int = 8) -> Cluster:
    device = Device("sim", {"bf16": PEAK, "fp32": PEAK}, 80 * 10**9, 2e12, ((1.0, 1.0),))
    return Cluster("sim", nodes, gpus_per_node, device, intra_node=Link(1e11, 1e-6), inter_node=Link(1e10, 1e-5),
                   host_to_device=Link(2e10, 1e-5), nvme=Link(8e9, 1e-4), host_memory_bytes=10**12, nvme_bytes=10**13)


def make_profile(spec: list[tuple[str, int, float]], cross: tuple[tuple[str, str], ...] = (), *,
                 edge_bytes: float = 0.0, params: int = 0, activation_bytes: float = 0.0) -> Profile:
    """Groups of `n` identical blocks "<group>.<i>" chained in order; fwd FLOPs f and bwd 2f per sample."""
    blocks, edges = [], []
    for group, n, flops in spec:
        for i in range(n):
            blocks.append(Block(f"{group}.{i}", group, "Layer", params, 2 * params, flops, 2 * flops,
                                activation_bytes, edge_bytes, signature=group))
            if i:
                edges.append(Edge(f"{group}.{i - 1}", f"{group}.{i}", edge_bytes))
    edges += [Edge(s, d, edge_bytes) for s, d in cross]
    b, e = tuple(blocks), tuple(edges)
    return Profile.build("synthetic", "bf16", 1, b, e)


def make_group(name: str, blocks: list[list[str]], *, first_rank: int = 0, dp: int = 1, tp: int = 1,
               colocated_with: str | None = None, zero: int = 0, memory: P.Memory | None = None) -> P.Group:
    n = dp * tp
    stages = tuple(P.Stage(tuple(bs), tuple(range(first_rank + i * n, first_rank + (i + 1) * n)), memory or P.Memory())
                   for i, bs in enumerate(blocks))
    return P.Group(name, dp, tp, len(stages), stages, zero=zero, colocated_with=colocated_with)


def make_plan(profile: Profile, groups: list[P.Group], training: P.Training, cluster: Cluster | None = None) -> P.Plan:
    plan = P.Plan(P.ProfileRef(profile.model, profile.fingerprint), cluster or make_cluster(), training, tuple(groups))
    return P.check_plan(plan, profile)  # the plans/ contract's own checks; derives the boundaries


def even_pipeline(p: int, m: int, schedule: str = "1f1b", v: int = 1, flops: float = 1e9) -> tuple[P.Plan, Profile]:
    """p equal stages (v chunks each, one block per chunk), block k on stage k % p (Megatron's interleaving)."""
    profile = make_profile([("llm", p * v, flops)])
    stages = [[f"llm.{k}" for k in range(p * v) if k % p == i] for i in range(p)]
    return make_plan(profile, [make_group("llm", stages)], P.Training(m, m, schedule, v)), profile


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 1), (4, 8), (8, 32), (3, 5)])
def test_bubble_of_equal_stages_is_p_minus_1_over_m_plus_p_minus_1(schedule, p, m):
    # Narayanan et al. 2021 section 2.2.1 (and GPipe, Huang et al. 2019): with p equal stages, m micro-batches
    # and free p2p, the step is (m + p - 1)(tf + tb) and the bubble is (p - 1) / (m + p - 1) of it.
    plan, profile = even_pipeline(p, m, schedule)
    sim = simulate(plan, profile)
    tf, tb = 1e9 / PEAK, 2e9 / PEAK
    assert sim.pipeline_time_s == pytest.approx((m + p - 1) * (tf + tb), rel=1e-12)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert sim.step_time_s == sim.pipeline_time_s  # no parameters: no gradient sync, no optimizer work


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 3, 16)])
def test_interleaved_bubble_is_p_minus_1_over_v_m_of_the_ideal(p, v, m):
    # Narayanan et al. 2021 section 2.2.2: v model chunks per rank shrink the bubble to (p - 1) / v of a
    # stage's (tf + tb), i.e. (p - 1) / (v m) relative to the ideal m (tf + tb).
    plan, profile = even_pipeline(p, m, "interleaved", v)
    sim = simulate(plan, profile)
    ideal = m * v * 3e9 / PEAK  # v blocks of (1 + 2) GFLOP per micro-batch on every rank
    assert sim.stages[0].chunks == v
    assert (sim.pipeline_time_s - ideal) / ideal == pytest.approx((p - 1) / (v * m), rel=1e-9)


def test_interleaved_holds_the_korthikanti_in_flight_activations():
    plan, profile = even_pipeline(4, 8, "interleaved", 2)
    sim = simulate(plan, profile)
    # Korthikanti et al. 2022, 4.2.3: the first stage holds p (1 + (p - 1) / (p v)) micro-batches.
    assert sim.stages[0].in_flight == pytest.approx(4 * (1 + 3 / 8))


def test_p2p_adds_two_sends_per_stage_boundary_on_the_critical_path():
    p, nbytes = 4, 1e6
    profile = make_profile([("llm", p, 1e9)], edge_bytes=nbytes)
    cluster = make_cluster(nodes=4, gpus_per_node=1)  # every stage on its own node: inter-node sends
    plan = make_plan(profile, [make_group("llm", [[f"llm.{i}"] for i in range(p)])], P.Training(1, 1), cluster)
    sim = simulate(plan, profile)
    hop = p2p_time(nbytes, cluster.inter_node)
    assert sim.pipeline_time_s == pytest.approx(p * 3e9 / PEAK + 2 * (p - 1) * hop, rel=1e-12)


def two_encoders(colocated: bool) -> tuple[P.Plan, Profile]:
    profile = make_profile([("img", 1, 3e9), ("aud", 1, 1e9), ("llm", 2, 2e9)], cross=(("img.0", "llm.0"), ("aud.0", "llm.0")))
    img = make_group("img", [["img.0"]], first_rank=0)
    aud = make_group("aud", [["aud.0"]], first_rank=0 if colocated else 1, colocated_with="img" if colocated else None)
    llm = make_group("llm", [["llm.0", "llm.1"]], first_rank=2)
    return make_plan(profile, [img, aud, llm], P.Training(1, 1)), profile


def test_non_colocated_encoders_run_in_parallel_and_colocated_ones_in_sequence():
    # The heterogeneous-parallelism paper (seed 002): disjoint rank sets run the encoders concurrently, so
    # the step is max(encoders) + LLM; colocated encoders time-share their ranks, so it is their sum + LLM.
    img, aud, llm = 3e9 / PEAK, 1e9 / PEAK, 4e9 / PEAK  # forward seconds; backward is twice as long
    non_colocated = simulate(*two_encoders(colocated=False))
    colocated = simulate(*two_encoders(colocated=True))
    assert non_colocated.pipeline_time_s == pytest.approx(3 * (max(img, aud) + llm), rel=1e-12)
    assert colocated.pipeline_time_s == pytest.approx(3 * (img + aud + llm), rel=1e-12)
    assert len(colocated.stages) == 3 and colocated.representative[0] == 0


def test_encoder_feeding_a_pipeline_warms_up_like_an_extra_stage():
    # A pp=1 encoder on its own ranks in front of a 4-stage LLM is a 5-stage pipeline of equal stages.
    p, m = 4, 8
    profile = make_profile([("enc", 1, 1e9), ("llm", p, 1e9)], cross=(("enc.0", "llm.0"),))
    enc = make_group("enc", [["enc.0"]], first_rank=0)
    llm = make_group("llm", [[f"llm.{i}"] for i in range(p)], first_rank=1)
    sim = simulate(make_plan(profile, [enc, llm], P.Training(m, m)), profile)
    assert sim.stages[0].downstream == p
    assert sim.bubble_fraction == pytest.approx(p / (m + p), rel=1e-12)


def test_colocated_encoder_across_two_llm_stages_does_not_deadlock():
    profile = make_profile([("enc", 1, 1e9), ("llm", 2, 1e9)], cross=(("enc.0", "llm.0"),))
    llm = make_group("llm", [["llm.0"], ["llm.1"]], dp=2)  # ranks 0-1 and 2-3
    enc = make_group("enc", [["enc.0"]], dp=4, colocated_with="llm")  # ranks 0-3
    for schedule in ("1f1b", "gpipe"):
        sim = simulate(make_plan(profile, [enc, llm], P.Training(32, 8, schedule)), profile)
        assert len(set(sim.representative.values())) == 2  # rank classes: {enc, llm s0} and {enc, llm s1}
        assert sim.pipeline_time_s > 0


@pytest.mark.parametrize("colocated", [False, True])
def test_encoder_feeding_an_interleaved_llm_warms_up_as_far_as_the_llm_reads_ahead(colocated):
    # Interleaved stage 0 forwards 2(p-1) + (v-1)p + 1 chunks -- micro-batches 0..p-1 twice, then p..p+2 --
    # before its first backward: an encoder stuck waiting for gradient 0 after fewer forwards would deadlock.
    p, v, m = 4, 2, 8
    profile = make_profile([("enc", 2, 1e9), ("llm", p * v, 1e9)], cross=(("enc.1", "llm.0"),))
    llm = make_group("llm", [[f"llm.{k}" for k in range(p * v) if k % p == i] for i in range(p)], first_rank=0 if colocated else 1)
    enc = make_group("enc", [["enc.0", "enc.1"]], dp=p if colocated else 1, colocated_with="llm" if colocated else None)
    sim = simulate(make_plan(profile, [enc, llm], P.Training(m * p, m, "interleaved", v)), profile)
    encoder = next(s for s in sim.stages if s.group == "enc")
    distinct_before_first_backward = p + 3
    assert encoder.warmup >= distinct_before_first_backward  # forwards run before its first backward
    assert encoder.in_flight == encoder.warmup


def test_gradient_all_reduce_and_optimizer_follow_the_last_backward():
    profile = make_profile([("llm", 2, 1e9)], params=10**8)
    cluster = make_cluster()
    plan = make_plan(profile, [make_group("llm", [["llm.0", "llm.1"]], dp=8)], P.Training(8, 1), cluster)
    sim = simulate(plan, profile)
    grads = 2 * 2 * 10**8  # bf16 gradients of two blocks
    # bucketed: all but the last bucket hide behind the last micro-batch's backward (tail.BUCKET_BYTES)
    backward = sim.stages[0].time.bwd
    full = all_reduce_time(grads, 8, cluster.intra_node)
    exposed = max(all_reduce_time(BUCKET_BYTES, 8, cluster.intra_node), full - backward)
    assert 0 < exposed < full
    tail = exposed + optimizer_step_time(2 * 10**8, P.Memory(), cluster)
    assert sim.step_time_s - sim.pipeline_time_s == pytest.approx(tail, rel=1e-12)
    assert sim.busy[3].comm == pytest.approx(exposed, rel=1e-12)
    assert sim.comm_bytes == pytest.approx(8 * 2 * 7 / 8 * grads, rel=1e-12)  # ring: 2(n-1)/n per rank


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_backward_but_the_first_adds_its_weight_gradients_into_the_accumulated_ones(zero):
    # .grad += g: read both, write the sum (3 x 2 bf16 bytes per parameter) at the device's memory bandwidth on
    # m - 1 of m backwards; ZeRO-2/3 accumulate only this rank's 1/dp shard (FSDP2 reduce-scatters every backward)
    profile = make_profile([("llm", 2, 1e9)], params=10**8)
    cluster, m, dp = make_cluster(), 4, 2
    one, many = (simulate(make_plan(profile, [make_group("llm", [["llm.0", "llm.1"]], dp=dp, zero=zero)],
                                    P.Training(dp * k, k), cluster), profile) for k in (1, m))  # 1 sample per micro-batch
    per_backward = (m - 1) / m * 3 * 2 * 2 * 10**8 / (dp if zero >= 2 else 1) / cluster.device.memory_bandwidth
    assert many.stages[0].time.bwd - one.stages[0].time.bwd == pytest.approx(per_backward, rel=1e-9)
    assert many.stages[0].time.fwd == pytest.approx(one.stages[0].time.fwd, rel=1e-12)
    # gradients kept off the GPU are added on the host (param_tiers.GradTier): not this term
    host = P.Memory(grads="cpu")
    one, many = (simulate(make_plan(profile, [make_group("llm", [["llm.0", "llm.1"]], memory=host)], P.Training(k, k), cluster),
                          profile) for k in (1, m))
    assert many.stages[0].time.bwd == pytest.approx(one.stages[0].time.bwd, rel=1e-12)


def test_fused_grad_accumulation_leaves_only_parameters_outside_gemms_to_add():
    # fused_grad_accumulation=True (Megatron-LM since 2022-02: the wgrad GEMM adds into main_grad): a block with GEMMs
    # pays nothing; a block without (an embedding) still adds its gradients on m - 1 of m backwards
    base = make_profile([("llm", 2, 1e9)], params=10**8)
    gemm = replace(base.blocks[0], fwd_matmul_flops=1e9, bwd_matmul_flops=2e9, matmuls=1)
    profile = Profile.build("synthetic", "bf16", 1, (gemm, base.blocks[1]), base.edges)
    cluster, m = make_cluster(), 4
    plan = make_plan(profile, [make_group("llm", [["llm.0", "llm.1"]])], P.Training(m, m), cluster)
    plain, fused = simulate(plan, profile), simulate(plan, profile, fused_grad_accumulation=True)
    one_block = (m - 1) / m * 3 * 2 * 10**8 / cluster.device.memory_bandwidth
    assert plain.stages[0].time.bwd - fused.stages[0].time.bwd == pytest.approx(one_block, rel=1e-9)
    assert plain.stages[0].time.fwd == fused.stages[0].time.fwd


@pytest.mark.parametrize("call_s", [0.0, 1e-3])
@pytest.mark.parametrize("tier", ["keep", "selective", "recompute"])
def test_tp_backward_collectives_blocking_in_mmplan_and_beside_the_gemms_in_megatron(tier, call_s):
    # mmplan's runtime: per layer, 2 all-reduces each way (g forward, f backward); with sequence parallelism each
    # becomes a reduce-scatter + an all-gather (the same volume, twice the calls: each pays Link.collective_s, as
    # gloo does) and the backward adds 2 re-gathers of the saved input slices, under every tier.
    # overlapped_tp_backward=True (Megatron-LM, TransformerEngine): the column-parallel linears' collectives run beside
    # their GEMMs; exposed: nothing without sequence parallelism, the exits' gradient all-gathers with it
    base = make_profile([("llm", 2, 1e9)], params=10**6, edge_bytes=4e6)
    profile = Profile.build("synthetic", "bf16", 1, tuple(replace(b, supports_tp=True) for b in base.blocks), base.edges)
    cluster, tp, layers, samples = make_cluster(), 4, 2, 2
    cluster = replace(cluster, intra_node=replace(cluster.intra_node, collective_s=call_s))
    link = cluster.intra_node
    ar, ag = all_reduce_time(4e6 * samples, tp, link), all_gather_time(4e6 * samples, tp, link)
    rs = reduce_scatter_time(4e6 * samples, tp, link)
    group = make_group("llm", [["llm.0", "llm.1"]], tp=tp, memory=P.Memory(activations={"llm.0": tier, "llm.1": tier}))
    for sp, fwd, mmplan_bwd, megatron_bwd in ((True, 2 * (ag + rs), 2 * (ag + rs) + 2 * ag, 2 * ag),
                                              (False, 2 * ar, 2 * ar, 0.0)):
        recomputed = fwd if tier == "recompute" else 0.0  # the recomputed forward's collectives
        plan = make_plan(profile, [replace(group, sequence_parallel=sp)], P.Training(samples, 1), cluster)
        plain, hidden = simulate(plan, profile), simulate(plan, profile, overlapped_tp_backward=True)
        assert plain.stages[0].time.bwd_comm == pytest.approx(layers * (mmplan_bwd + recomputed), rel=1e-12)
        assert hidden.stages[0].time.bwd_comm == pytest.approx(layers * (megatron_bwd + recomputed), rel=1e-12)
        assert plain.stages[0].time.fwd_comm == hidden.stages[0].time.fwd_comm == pytest.approx(layers * fwd, rel=1e-12)
    if call_s:  # on gloo sequence parallelism's extra calls make it the slower of the two
        assert 2 * (ag + rs) > 2 * ar


def test_megatron_mixed_precision_step_bytes_count_its_passes():
    # 2021 (fp16 .grad, set to None): copy to fp32 6 + unscale 8 + norm 4 + Adam's fp32 grad read 2 + master read 4
    assert mixed_precision_step_bytes(grad_bytes=2, zeroed_buffer=False, loss_scaling=True) == 24
    # 2022 (fp32 main_grad buffer, zeroed each step): no copy, + the zeroing 4; bf16 (no loss scaling): no unscale
    assert mixed_precision_step_bytes(grad_bytes=4, zeroed_buffer=True, loss_scaling=True) == 22
    assert mixed_precision_step_bytes(grad_bytes=4, zeroed_buffer=True, loss_scaling=False) == 14


@pytest.mark.parametrize("zero", [0, 1])
def test_optimizer_extra_bytes_lengthen_only_the_optimizer_step_of_the_updated_share(zero):
    profile = make_profile([("llm", 2, 1e9)], params=10**8)
    cluster = make_cluster()
    plan = make_plan(profile, [make_group("llm", [["llm.0", "llm.1"]], dp=4, zero=zero)], P.Training(4, 1), cluster)
    plain, extra = simulate(plan, profile), simulate(plan, profile, optimizer_extra_bytes=22)
    updated = 2 * 10**8 / (4 if zero else 1)  # ZeRO-1 steps a 1/dp shard
    assert extra.stages[0].optimizer_s - plain.stages[0].optimizer_s == pytest.approx(
        22 * updated / cluster.device.memory_bandwidth, rel=1e-12)
    assert extra.step_time_s - plain.step_time_s == pytest.approx(22 * updated / cluster.device.memory_bandwidth, rel=1e-9)
    assert extra.stages[0].time == plain.stages[0].time


def test_megatron_distributed_optimizer_switches_reach_the_stage_tail():
    # grad_sync_bytes=4: the reduce-scatter moves fp32 gradients; overlapped_param_gather: the all-gather hides behind
    # the stage's first forward (one micro-batch) but for its first bucket
    profile = make_profile([("llm", 2, 1e9)], params=10**9)
    cluster = make_cluster()
    plan = make_plan(profile, [make_group("llm", [["llm.0", "llm.1"]], dp=4, zero=1)], P.Training(16, 4), cluster)
    plain = simulate(plan, profile)
    megatron = simulate(plan, profile, grad_sync_bytes=4, overlapped_param_gather=True)
    link, params = cluster.intra_node, 2 * 10**9
    gather = all_gather_time(2 * params, 4, link)
    # mmplan's runtime (FSDP2) gathers in the next step's first forward, block by block: the first block's gather
    # exposed, the second's beside the first block's compute, FSDP2's copies around each (fsdp.first_forward_gather);
    # the blocks' forward (1 ms) falls below FSDP2's host floor of a gathering block
    g, c = all_gather_time(params, 4, link), plain.stages[0].time.fwd / 2
    floored = max(c, host_floor(cluster))
    assert plain.stages[0].param_gather_s == pytest.approx(g + max(g, floored) + floored - 2 * c
                                                           + 2 * copy_time(params, 4, cluster), rel=1e-12)
    assert megatron.stages[0].param_gather_s == pytest.approx(
        max(all_gather_time(BUCKET_BYTES, 4, link), gather - megatron.stages[0].time.fwd), rel=1e-12)
    assert megatron.stages[0].grad_sync_s > plain.stages[0].grad_sync_s  # twice the bytes, the same overlap


@pytest.mark.parametrize("zero", [1, 2])
def test_zero_1_2_parameter_gather_hides_behind_the_next_first_forward_but_for_its_first_block(zero):
    # FSDP2 (runtime/zero.py) gathers ZeRO 1-2's updated shards lazily in the next step's first forward, block by
    # block: behind compute longer than each gather only the first block's gather (and FSDP2's copies) shows; on CPU
    # ranks (gloo: nothing overlaps) the whole all-gather stays one after the other with the compute
    profile = make_profile([("llm", 4, 1e11)], params=10**8)
    names = [f"llm.{i}" for i in range(4)]
    gpu = make_cluster()
    cpu = replace(gpu, backend="gloo")
    plan = make_plan(profile, [make_group("llm", [names], dp=4, zero=zero)], P.Training(16, 4), gpu)
    link, nbytes = gpu.intra_node, 2 * 10**8
    fast, serial = simulate(plan, profile), simulate(plan, profile, cpu)
    assert fast.stages[0].time.fwd / 4 > all_gather_time(nbytes, 4, link)
    assert fast.stages[0].param_gather_s == pytest.approx(all_gather_time(nbytes, 4, link)
                                                          + 4 * copy_time(nbytes, 4, gpu), rel=1e-12)
    assert serial.stages[0].param_gather_s == all_gather_time(4 * nbytes, 4, cpu.intra_node)


def test_without_overlap_the_whole_gradient_all_reduce_follows_the_last_backward():
    # grad_sync_overlap=False: a runtime that all-reduces after the backward (Megatron-LM's --DDP-impl local)
    profile = make_profile([("llm", 2, 1e9)], params=10**8)
    cluster = make_cluster()
    plan = make_plan(profile, [make_group("llm", [["llm.0", "llm.1"]], dp=8)], P.Training(8, 1), cluster)
    overlapped, serial = simulate(plan, profile), simulate(plan, profile, grad_sync_overlap=False)
    full = all_reduce_time(2 * 2 * 10**8, 8, cluster.intra_node)
    assert serial.stages[0].grad_sync_s == pytest.approx(full, rel=1e-12)
    assert serial.step_time_s - overlapped.step_time_s == pytest.approx(full - overlapped.stages[0].grad_sync_s, rel=1e-9)
    assert serial.pipeline_time_s == overlapped.pipeline_time_s


def test_blocking_p2p_makes_every_send_part_of_its_task():
    # blocking_p2p=True (Megatron-LM 2021-22: torch.cuda.synchronize() after each send/receive): with one
    # micro-batch the critical path is the same as with free-running sends (each hop once forward, once back),
    # and every stage but the last (forward) / first (backward) is busy for its sends
    p, nbytes = 4, 1e6
    profile = make_profile([("llm", p, 1e9)], edge_bytes=nbytes)
    cluster = make_cluster(nodes=4, gpus_per_node=1)
    plan = make_plan(profile, [make_group("llm", [[f"llm.{i}"] for i in range(p)])], P.Training(1, 1), cluster)
    free, blocking = simulate(plan, profile), simulate(plan, profile, blocking_p2p=True)
    hop = p2p_time(nbytes, cluster.inter_node)
    assert blocking.pipeline_time_s == pytest.approx(free.pipeline_time_s, rel=1e-12)
    assert [s.fwd_s - f.fwd_s for s, f in zip(blocking.stages, free.stages)] == pytest.approx([hop] * (p - 1) + [0.0])
    assert [s.bwd_s - f.bwd_s for s, f in zip(blocking.stages, free.stages)] == pytest.approx([0.0] + [hop] * (p - 1))
    # with many micro-batches the sends occupy the ranks in the steady state too: the step grows
    plan = make_plan(profile, [make_group("llm", [[f"llm.{i}"] for i in range(p)])], P.Training(16, 16), cluster)
    assert simulate(plan, profile, blocking_p2p=True).step_time_s > simulate(plan, profile).step_time_s + hop


def test_offload_only_extends_the_step_by_what_compute_does_not_hide():
    act = 4e8  # bytes per sample: 20 ms over PCIe at 20 GB/s, against 1 ms of forward compute
    profile = make_profile([("llm", 1, 1e9)], activation_bytes=act)
    cluster = make_cluster()
    offloaded = P.Memory(activations={"llm.0": "offload-cpu"})
    plan = make_plan(profile, [make_group("llm", [["llm.0"]], memory=offloaded)], P.Training(1, 1), cluster)
    sim = simulate(plan, profile)
    move = transfer_time(act, "cpu", cluster)
    assert sim.stages[0].fwd_s == pytest.approx(max(1e-3, move), rel=1e-12)
    assert sim.stages[0].bwd_s == pytest.approx(max(2e-3, move), rel=1e-12)
    assert sim.busy[0].transfer == pytest.approx(2 * move, rel=1e-12)
    lanes = {e.lane for e in sim.timeline}
    assert lanes == {"compute", "transfer"}


def test_timeline_events_stay_inside_the_step_and_lanes_do_not_overlap():
    plan, profile = even_pipeline(4, 8, "interleaved", 2)
    sim = simulate(plan, profile)
    for rank in (0, 3):
        compute = sorted((e.start, e.end) for e in sim.rank_timeline(rank) if e.lane == "compute")
        assert len(compute) == 2 * 8 * 2
        assert all(a[1] <= b[0] + 1e-15 for a, b in zip(compute, compute[1:]))
        assert all(0 <= s <= e <= sim.step_time_s for s, e in compute)


def test_a_cycle_between_groups_is_reported():
    with pytest.raises(MmplanError, match="cycle|acyclic"):
        profile = make_profile([("a", 1, 1e9), ("b", 1, 1e9)], cross=(("a.0", "b.0"), ("b.0", "a.0")))
        simulate(make_plan(profile, [make_group("a", [["a.0"]]), make_group("b", [["b.0"]], first_rank=1)], P.Training(1, 1)), profile)

def test_tier_copies_pay_the_link_alpha_each():
    """The runtime moves a tier's bytes tensor by tensor: n copies of the same bytes cost (n - 1) alphas more, on the
    host link and on NVMe (one file per storage there); parameters stream one copy per tensor, gradients per trained one."""
    from cost_models.catalog import CATALOG
    from cost_models.offload import offload_accounting, state_streaming, transfer_time

    cluster = CATALOG["local-cpu"]
    alpha = cluster.host_to_device.latency_s
    one, many = transfer_time(1e6, "cpu", cluster), transfer_time(1e6, "cpu", cluster, copies=50)
    assert many - one == pytest.approx(49 * alpha)
    nvme_alpha = max(alpha, cluster.nvme.latency_s)
    assert transfer_time(1e6, "nvme", cluster, copies=10) - transfer_time(1e6, "nvme", cluster) == pytest.approx(9 * nvme_alpha)
    assert transfer_time(1e6, "gpu", cluster, copies=10) == 0.0
    memory = P.Memory(params="cpu", grads="cpu", optimizer="cpu")
    streamed = state_streaming(1e6, dp=1, zero=0, memory=memory, cluster=cluster, tensors=20, trained_tensors=5)
    assert streamed.params_in == pytest.approx(transfer_time(1e6, "cpu", cluster, copies=20))
    assert streamed.grads_out == pytest.approx(transfer_time(1e6, "cpu", cluster, copies=5))
    assert offload_accounting(10, cluster) == pytest.approx(10 * (cluster.saved_tensor_s + cluster.released_tensor_s))
