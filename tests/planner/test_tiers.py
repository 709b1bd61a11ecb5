"""Memory tiers (planner/solver/tiers.py): a model far larger than GPU memory still gets a plan, within every tier's capacity."""
from __future__ import annotations

from collections import defaultdict

import pytest

from cost_models.evaluate import evaluate
from planner.solver.construct import GroupLayout, build_plan
from planner.solver.diagnosis import state_bytes
from planner.solver.solve import solve
from planner.solver.tiers import place_tiers
from plans.cluster import Cluster, Device, Link
from plans.errors import MmplanError
from plans.graph import Block, Edge, Profile
from plans.plan import Memory, Training

GB = 10**9


def big_model(layers: int = 4, params: float = 0.9e9) -> Profile:
    """A vision encoder (2 blocks) feeding an LLM (`layers` blocks) of `params` parameters each, bf16."""
    blocks, edges = [], []
    for group, n in (("vision", 2), ("llm", layers)):
        for i in range(n):
            p = int(params)
            blocks.append(Block(f"{group}.{i}", group, "Layer", p, 2 * p, 2e12, 4e12, 3e8, 2e7, supports_tp=True, signature=group))
            if i:
                edges.append(Edge(f"{group}.{i - 1}", f"{group}.{i}", 2e7))
    edges.insert(1, Edge("vision.1", "llm.0", 2e7))
    b, e = tuple(blocks), tuple(edges)
    return Profile.build("big", "bf16", 1, b, e)


def small_cluster(*, gpu_gb: float = 8, host_gb: float = 40, nvme_gb: float = 500, gpus: int = 2) -> Cluster:
    device = Device("small-gpu", {"bf16": 1e14}, int(gpu_gb * GB), 1e12, ((1e6, 0.05), (1e9, 0.4), (1e12, 0.7)))
    return Cluster("small", 1, gpus, device, intra_node=Link(1e11, 2e-6), inter_node=Link(1e10, 1e-5),
                   host_to_device=Link(2.5e10, 1e-5), nvme=Link(8e9, 1e-4), host_memory_bytes=int(host_gb * GB),
                   nvme_bytes=int(nvme_gb * GB), backend="nccl")


def test_a_model_four_times_larger_than_gpu_memory_gets_a_plan_using_cpu_and_nvme():
    profile, cluster = big_model(), small_cluster()
    assert state_bytes(profile, "bf16") >= 4 * cluster.world_size * cluster.device.memory_bytes
    got = solve(profile, cluster, 4)
    plan = got.plan
    assert plan.predicted.fits
    ev = evaluate(plan, profile)  # the cost model's own memory, not the solver's
    tiers_used = {t for g in plan.groups for s in g.stages for t in (s.memory.params, s.memory.grads, s.memory.optimizer)}
    assert {"cpu", "nvme"} & tiers_used
    host, nvme = defaultdict(float), defaultdict(float)
    for m in ev.memory:
        assert m.gpu <= cluster.device.memory_bytes  # every rank's GPU tier within capacity
        host[cluster.node_of(m.rank)] += m.cpu
        nvme[cluster.node_of(m.rank)] += m.nvme
    assert all(v <= cluster.host_memory_bytes for v in host.values())
    assert all(v <= cluster.nvme_bytes for v in nvme.values())
    assert sum(host.values()) + sum(nvme.values()) > 0


def test_without_tiers_the_same_request_fails_naming_the_gpu_shortfall():
    with pytest.raises(MmplanError, match=r"in GPU memory \(try --memory-tiers\).* GB short"):
        solve(big_model(), small_cluster(), 4, memory_tiers=False)


def test_too_little_host_memory_and_nvme_names_the_bytes_short():
    with pytest.raises(MmplanError, match=r"GB short"):
        solve(big_model(), small_cluster(host_gb=10, nvme_gb=10), 4)


def one_group_plan(profile: Profile, cluster: Cluster, memory: Memory):
    names = tuple(b.name for b in profile.blocks)
    mem = Memory(memory.params, memory.grads, memory.optimizer,
                 {b: memory.activations["*"] for b in names} if memory.activations else {})
    layout = GroupLayout("model", names, (3,), 1, 1, (0, 1), memory=(
        Memory(mem.params, mem.grads, mem.optimizer, {b: t for b, t in mem.activations.items() if b in names[:3]}),
        Memory(mem.params, mem.grads, mem.optimizer, {b: t for b, t in mem.activations.items() if b in names[3:]})))
    return build_plan(profile, cluster, Training(4, 2, "1f1b"), [layout])


def test_recompute_is_dropped_where_memory_allows_and_the_plan_gets_faster():
    profile = big_model(layers=4, params=1e8)
    cluster = small_cluster(gpu_gb=80)
    plan = one_group_plan(profile, cluster, Memory(activations={"*": "recompute"}))
    placed = place_tiers(plan, profile)
    assert all(not s.memory.activations for g in placed.groups for s in g.stages)  # all kept
    assert placed.predicted.step_time_s < plan.predicted.step_time_s and placed.predicted.fits


def test_placement_respects_a_tight_gpu_exactly_as_the_cost_model_counts_it():
    profile = big_model(layers=4, params=2e8)
    cluster = small_cluster(gpu_gb=4.5, host_gb=16)
    plan = one_group_plan(profile, cluster, Memory())
    assert not plan.predicted.fits
    placed = place_tiers(plan, profile)
    ev = evaluate(placed, profile)
    assert placed.predicted.fits and max(m.gpu for m in ev.memory) <= cluster.device.memory_bytes
    assert max(m.gpu for m in ev.memory) > 0.5 * cluster.device.memory_bytes  # it keeps what fits on the GPU


def test_a_rank_that_cannot_hold_even_its_streaming_buffers_is_reported():
    profile = big_model(layers=2, params=3e9)  # one block streamed needs 2 x 6 GB on the GPU
    with pytest.raises(MmplanError, match=r"GB short"):
        place_tiers(one_group_plan(profile, small_cluster(gpu_gb=4, host_gb=2000, nvme_gb=5000), Memory()), profile)




def test_tier_ilp_hides_no_transfer_on_cpu_ranks():
    """On gloo ranks nothing overlaps (offload.overlaps_compute): the ILP charges every tier transfer, as the simulator
    does, so tiny-vlm on one local-cpu rank under a quarter of its state (bench/tiers_bench.py (1)) gets a plan that
    fits with nothing on the slower NVMe (host memory to spare; one file per storage there). With transfers hidden
    behind compute the two tiers tied in the ILP, and on a measured profile it offloaded to NVMe, 1.4x slower simulated."""
    from cost_models.cluster_toml import cluster_from_toml
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    profile = profile_model(resolve("tiny-vlm"), micro_batch=4, device="cpu")
    budget = (state_bytes(profile, "fp32") + sum(b.activation_bytes for b in profile.blocks) * 4) / 4
    toml = f'base = "local-cpu"\nnodes = 1\ngpus_per_node = 1\n[device]\nmemory_gb = {budget / 1e9:.9f}\n'
    plan = solve(profile, cluster_from_toml(toml), 8, baseline=False).plan
    used = {t for g in plan.groups for s in g.stages for t in (s.memory.params, s.memory.grads, s.memory.optimizer,
                                                                *s.memory.activations.values())}
    assert plan.predicted.fits
    assert not {"nvme", "offload-nvme"} & used, used
