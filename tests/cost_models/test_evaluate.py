"""evaluate(): throughput and MFU (PaLM definition), token inference, fits, block times, the Chrome trace."""
from __future__ import annotations

import dataclasses
import json

import pytest

from cost_models.comm import all_reduce_time
from cost_models.compute import block_time
from cost_models.evaluate import evaluate, tokens_per_sample
from cost_models.cluster_spec import catalog_cluster
from cost_models.trace import chrome_trace
from plans import plan as P
from plans.cluster import Cluster, Device, Link
from plans.graph import Block, Edge, Profile
from plans.serial import dumps


@pytest.fixture(scope="module")
def tiny_profiles():
    from planner.profiler.profile import profile_model  # the real profiling pass, on the meta device
    from runtime.models import zoo
    from runtime.source import resolve

    return {name: (profile_model(resolve(name), micro_batch=2), zoo.ZOO[name]) for name in ("tiny-vlm", "tiny-flamingo")}


def test_tokens_per_sample_is_the_llm_sequence_length(tiny_profiles):
    for profile, arch in tiny_profiles.values():
        assert tokens_per_sample(profile) == arch.seq_len  # prefix tokens (tiny-vlm) or text only (tiny-flamingo)


def at_peak_cluster(nodes: int = 1) -> Cluster:
    device = Device("sim", {"bf16": 1e12}, 80 * 10**9, 2e12, ((1.0, 1.0),))
    return Cluster("sim", nodes, 8, device, Link(1e11), Link(1e10), Link(2e10), Link(8e9), 10**12, 10**13)


def chain_plan(p: int, m: int, cluster: Cluster, *, params: int = 0, act: float = 0.0, tp: int = 1,
               memory: P.Memory | None = None) -> tuple[P.Plan, Profile]:
    blocks = tuple(Block(f"llm.{i}", "llm", "Layer", params, 2 * params, 1e9, 2e9, act, 0.0, supports_tp=True) for i in range(p))
    edges = tuple(Edge(f"llm.{i}", f"llm.{i + 1}", 0.0) for i in range(p - 1))
    profile = Profile.build("chain", "bf16", 1, blocks, edges)
    stages = tuple(P.Stage((f"llm.{i}",), tuple(range(i * tp, (i + 1) * tp)), memory or P.Memory()) for i in range(p))
    plan = P.Plan(P.ProfileRef("chain", profile.fingerprint), cluster, P.Training(m, m), (P.Group("llm", 1, tp, p, stages),))
    return P.check_plan(plan, profile), profile


@pytest.mark.parametrize("p,m", [(1, 4), (4, 8)])
def test_mfu_at_peak_compute_is_one_minus_the_bubble(p, m):
    # PaLM appendix B: MFU = model FLOPs per second / peak. With every kernel at peak, free communication
    # and no optimizer work, the only loss is the pipeline bubble.
    plan, profile = chain_plan(p, m, at_peak_cluster())
    ev = evaluate(plan, profile)
    assert ev.predicted.mfu == pytest.approx(1 - ev.predicted.bubble_fraction, rel=1e-12)
    assert ev.predicted.tflops_per_gpu * 1e12 == pytest.approx(ev.predicted.mfu * plan.cluster.device.peak_flops["bf16"], rel=1e-12)
    assert ev.predicted.samples_per_s == pytest.approx(m / ev.predicted.step_time_s, rel=1e-12)
    assert ev.predicted.tokens_per_s == 0.0  # no token-id input: tokens unknown


def test_fits_checks_the_gpu_of_every_rank_and_the_host_memory_of_every_node():
    cluster = at_peak_cluster()
    plan, profile = chain_plan(2, 2, cluster, params=10**9)  # 16 GB of model states per rank
    assert evaluate(plan, profile).predicted.fits
    small_gpu = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=15 * 10**9))
    assert not evaluate(plan, profile, small_gpu).predicted.fits
    off = P.Memory(optimizer="cpu")  # 12 GB per rank to the host, 24 GB on the node
    plan, profile = chain_plan(2, 2, cluster, params=10**9, memory=off)
    ev = evaluate(plan, profile)
    assert [m.cpu for m in ev.memory] == [12e9, 12e9] and ev.predicted.fits
    assert not evaluate(plan, profile, dataclasses.replace(cluster, host_memory_bytes=20 * 10**9)).predicted.fits


def test_block_time_measured_flops_tp_and_recompute():
    cluster = catalog_cluster("8xh100-sxm")
    block = Block("l", "llm", "Layer", 10**6, 2 * 10**6, 1e12, 2e12, 1e6, 4e6, supports_tp=True, fwd_ms=10.0, bwd_ms=20.0)
    # Measured at micro-batch 2 on this device: 3 samples take 1.5x, split over no tp.
    measured = block_time(block, 3, 1, cluster, measured_micro_batch=2)
    assert (measured.fwd, measured.bwd) == pytest.approx((0.015, 0.030))
    # Megatron: two all-reduces of the layer output forward, two backward, over NVLink.
    tp = block_time(block, 3, 8, cluster, measured_micro_batch=2)
    assert tp.fwd == pytest.approx(0.015 / 8)
    assert tp.fwd_comm == tp.bwd_comm == pytest.approx(2 * all_reduce_time(3 * 4e6, 8, cluster.intra_node))
    # Recompute runs the forward again before the backward, its all-reduces included.
    again = block_time(block, 3, 8, cluster, measured_micro_batch=2, recompute=True)
    assert again.bwd == pytest.approx(tp.bwd + tp.fwd) and again.bwd_comm == pytest.approx(2 * tp.fwd_comm)
    # From FLOPs: FLOPs / (peak x efficiency), the larger kernel running closer to peak.
    analytic = block_time(block, 1, 1, cluster)
    assert 1e12 / cluster.device.peak_flops["bf16"] < analytic.fwd < analytic.bwd < 2 * analytic.fwd


def tiny_vlm_plan(profile: Profile) -> P.Plan:
    """vision (+ projector) on ranks 0-1 with dp 2; the LLM on ranks 2-5 as 2 stages of tp 2."""
    groups = {g: [b.name for b in profile.group_blocks(g)] for g in profile.groups}
    llm = groups["llm"]
    return P.Plan(
        P.ProfileRef(profile.model, profile.fingerprint), catalog_cluster("8xh100-sxm"), P.Training(8, 4),
        (
            P.Group("vision", 2, 1, 1, (P.Stage(tuple(groups["vision"]), (0, 1)),)),
            P.Group("vision_proj", 2, 1, 1, (P.Stage(tuple(groups["vision_proj"]), (0, 1)),), colocated_with="vision"),
            P.Group("llm", 1, 2, 2, (P.Stage(tuple(llm[:3]), (2, 3)), P.Stage(tuple(llm[3:]), (4, 5))), zero=1),
        ),
    )


def test_evaluate_a_real_profile_end_to_end(tiny_profiles):
    profile, arch = tiny_profiles["tiny-vlm"]
    plan = P.check_plan(tiny_vlm_plan(profile), profile)
    ev = evaluate(plan, profile)
    p = ev.predicted
    assert p.fits and 0 < p.bubble_fraction < 1 and p.comm_bytes > 0
    assert p.tokens_per_s == pytest.approx(p.samples_per_s * arch.seq_len)
    assert [m.rank for m in p.memory] == list(range(6))
    assert p.bottleneck.startswith(("vision", "llm"))
    assert {s.group for s in ev.stages} == {"vision", "vision_proj", "llm"}
    assert {e.lane for e in ev.rank_timeline(2)} >= {"compute", "comm"}  # TP all-reduces of the LLM
    assert ev.busy[5] == ev.busy[4]  # tp shards of one stage are identical
    P.check_plan(dataclasses.replace(plan, predicted=p))  # the prediction fits plan.json's schema
    assert '"step_time_s"' in dumps(p)


def test_chrome_trace_has_a_process_per_rank_and_lanes_as_threads(tiny_profiles):
    profile, _ = tiny_profiles["tiny-vlm"]
    ev = evaluate(P.check_plan(tiny_vlm_plan(profile), profile), profile)
    trace = json.loads(json.dumps(chrome_trace(ev)))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 2: "rank 2", 4: "rank 4"}  # one representative per rank class
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {name.split(" #")[0] for name in lanes.values()} == {"compute", "comm", "transfer"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(ev.timeline)
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in spans:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in by_thread.values():  # slices of one thread never overlap (viewers need them nested)
        intervals.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(intervals, intervals[1:]))
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(ev.predicted.step_time_s * 1e6)
    every = chrome_trace(ev, ranks=range(6))
    assert {e["pid"] for e in every["traceEvents"]} == set(range(6))
