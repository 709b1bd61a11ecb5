"""Tests of `mmplan calibrate`: the pure fits, failure handling of the rank processes, and a quick real run."""
from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

import planner.calibrate.calibrate as calibrate_module
import planner.calibrate.fit as fit_module
import planner.calibrate.ranks as ranks_module
from cost_models.cluster_spec import parse_cluster
from cost_models.cluster_toml import cluster_to_toml
from cost_models.hardware import efficiency
from planner.calibrate.calibrate import calibrate
from planner.calibrate.fit import efficiency_curve, fit_alpha_beta
from planner.calibrate.probes import conv_flops
from planner.calibrate.runtime_probes import probe_slowdown
from planner.calibrate.settings import Reporter, Settings
from plans.cluster import Link
from plans.errors import MmplanError

SIZES = [4 * 4**k for k in range(12)]


# --- pure helpers ------------------------------------------------------------------------------------------------

def test_fit_recovers_alpha_beta():
    link = fit_alpha_beta(SIZES, [2e-4 + s / 3e9 for s in SIZES])
    assert link.latency_s == pytest.approx(2e-4) and link.bandwidth == pytest.approx(3e9)


def test_fit_tolerates_noise_at_every_scale():
    rng = np.random.default_rng(0)
    times = [(5e-5 + s / 1e9) * rng.uniform(0.9, 1.1) for s in SIZES]
    link = fit_alpha_beta(SIZES, times)
    assert link.latency_s == pytest.approx(5e-5, rel=0.15) and link.bandwidth == pytest.approx(1e9, rel=0.15)


def test_fit_clamps_a_negative_latency_and_survives_flat_times():
    link = fit_alpha_beta([1e6, 2e6, 4e6], [0.9e-3, 2e-3, 4.1e-3])  # intercept slightly < 0
    assert link.latency_s == 0 and link.bandwidth == pytest.approx(1e9, rel=0.05)
    flat = fit_alpha_beta([1, 10, 100], [1e-3, 1e-3, 0.9e-3])  # noise only: slope <= 0
    assert flat.bandwidth > 0 and flat.latency_s > 0
    with pytest.raises(ValueError):
        fit_alpha_beta([1], [1e-3])


def test_the_slowdown_pairs_each_turn_and_drops_a_spiked_one():
    # the machine drifts from 10 ms to 14 ms per step over the turns, every rank at once is 1.2x slower in each turn,
    # and one turn's alone measurement was hit by a spike (rank 0 alone at 30 ms)
    alone = [0.010, 0.011, 0.030, 0.013, 0.014]
    true_alone = [0.010, 0.011, 0.012, 0.013, 0.014]
    together = [[1.2 * a for a in true_alone], [1.2 * a * 1.02 for a in true_alone]]  # rank 1 a little slower
    assert probe_slowdown(alone, together) == pytest.approx(1.2 * 1.01)
    assert probe_slowdown([0.01] * 3, [[0.009] * 3, [0.009] * 3]) == 1.0  # never below 1
    assert probe_slowdown([], [[], []]) == 1.0


def test_ring_link_inverts_the_ring_all_reduce_formula():
    # cost_models/comm.py's ring all-reduce: 2 (p - 1) alpha + 2 (p - 1) / p * S / beta
    link, p = Link(2e9, 1e-4), 4
    times = [2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * s / link.bandwidth for s in SIZES]
    back = fit_module.link_from_ring(fit_alpha_beta(SIZES, times), p)
    assert back.latency_s == pytest.approx(link.latency_s) and back.bandwidth == pytest.approx(link.bandwidth)


def test_the_fixed_cost_per_collective_call_is_what_the_ring_model_leaves_out():
    from cost_models.comm import all_gather_time, all_reduce_time, reduce_scatter_time

    link, p, call = Link(1e9, 1e-4), 2, 1.2e-3
    samples = {key: tuple((s, call + fn(s, p, link)) for s in SIZES) for key, fn in
               (("all_reduce", all_reduce_time), ("all_gather", all_gather_time), ("reduce_scatter", reduce_scatter_time))}
    fitted = fit_module.fit_collective_call(link, p, samples)
    assert fitted == pytest.approx(call)
    priced = replace(link, collective_s=fitted)  # the cost model then prices every sample as measured
    assert all_reduce_time(SIZES[3], p, priced) == pytest.approx(samples["all_reduce"][3][1])
    assert all_gather_time(SIZES[3], p, priced) == pytest.approx(samples["all_gather"][3][1])
    faster = {key: tuple((s, 0.5 * t) for s, t in pts) for key, pts in samples.items()}
    assert fit_module.fit_collective_call(Link(1e9, 1e-2), p, faster) == 0.0  # never negative
    assert fit_module.fit_collective_call(link, p, {}) == 0.0


def test_between_ranks_takes_a_sends_latency_and_the_lower_bandwidth(quick_run):
    cal, cluster, _, _ = quick_run
    odd = replace(cal, p2p=Link(3e9, 2e-4), all_reduce=Link(1e9, 9e-4), collective_s=1e-3)
    assert fit_module.between_ranks(odd) == Link(1e9, 2e-4, 1e-3)
    assert cluster.intra_node == fit_module.between_ranks(cal)


def test_efficiency_curve_is_relative_to_peak_and_sorted():
    curve = efficiency_curve(((256, 50e9), (64, 25e9), (1024, 100e9)), 100e9)
    assert curve == ((2 * 64.0**3, 0.25), (2 * 256.0**3, 0.5), (2 * 1024.0**3, 1.0))


def test_ranks_must_allow_collectives():
    with pytest.raises(MmplanError, match="2 <= ranks"):
        calibrate(ranks=1, quick=True)


# --- the rank processes: failures and hangs end quickly with the root cause ---------------------------------------

def _fail_on_rank_1(rank, world, settings, messages):
    if rank == 1:
        raise RuntimeError("disk on fire")
    torch.distributed.barrier()  # rank 0 waits for the dead peer; its error is an echo
    return {}


def _hang(rank, world, settings, messages):
    time.sleep(600)


def test_a_failing_rank_reports_its_own_error(monkeypatch):
    monkeypatch.setattr(ranks_module, "_rank_measure", _fail_on_rank_1)  # inherited by forked ranks
    start = time.monotonic()
    with pytest.raises(MmplanError, match="calibration failed on rank 1 .*RuntimeError: disk on fire"):
        ranks_module.run_ranks(2, Settings.for_run(quick=True), Reporter(None), "fork")
    assert time.monotonic() - start < 20


def test_a_hanging_rank_hits_the_deadline(monkeypatch):
    monkeypatch.setattr(ranks_module, "_rank_measure", _hang)
    settings = replace(Settings.for_run(quick=True), deadline_s=1.5)
    start = time.monotonic()
    with pytest.raises(MmplanError, match="timed out after 1.5 s in step start"):
        ranks_module.run_ranks(2, settings, Reporter(None), "fork")
    assert time.monotonic() - start < 15  # the ranks were killed, not waited for


class _RecordingAdam:
    """Adam's stand-in: each step busies the rank for 2 ms and records when (perf_counter is CLOCK_MONOTONIC on
    Linux: one clock for all ranks)."""

    calls: list[tuple[float, float]] = []

    def __init__(self, params, lr):
        pass

    def step(self):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.002:
            pass
        _RecordingAdam.calls.append((t0, time.perf_counter()))


def _optimizer_points_late_rank_1(rank, world, settings, messages):
    if rank == 1:
        time.sleep(0.3)  # longer than rank 0 takes over all its points when it times them on its own
    ranks_module._optimizer_points({}, settings, lambda step, f: None)
    return {"calls": _RecordingAdam.calls}


def test_the_optimizer_points_are_timed_with_every_rank_stepping_at_once(monkeypatch):
    """The run's optimizer step runs on every rank at once (on a shared CPU each rank then steps up to 2x slower):
    a rank late to the optimizer points still steps while the other times them, even when it arrives later than
    that one could have finished on its own."""
    monkeypatch.setattr(torch.optim, "Adam", _RecordingAdam)  # inherited by the forked ranks
    monkeypatch.setattr(ranks_module, "_rank_measure", _optimizer_points_late_rank_1)
    out = ranks_module.run_ranks(2, Settings.for_run(quick=True), Reporter(None), "fork")
    first, last = out[1]["calls"][0][0], out[1]["calls"][-1][1]
    timed = out[0]["calls"]
    during = sum(first <= (a + b) / 2 <= last for a, b in timed)
    assert during >= 0.8 * len(timed), (during, len(timed))


# --- a real quick run --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # the parent's thread pool is warm before forking
    steps: list[tuple[str, float]] = []
    start = time.perf_counter()
    cal = calibrate_module.measure(quick=True, progress=lambda step, f: steps.append((step, f)),
                                   scratch_dir=tmp_path_factory.mktemp("scratch"))
    return cal, fit_module.to_cluster(cal), steps, time.perf_counter() - start


def test_quick_calibration_is_fast_and_reports_progress(quick_run):
    cal, _, steps, wall = quick_run
    # within its own deadline (not killed): how fast it is on this machine is bench material, not a unit test's
    # (20 s here on a 2-vCPU VM whose speed drifts +-20 %; a few seconds on a quiet workstation)
    assert wall < Settings.for_run(True).deadline_s
    fractions = [f for _, f in steps]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and steps[-1] == ("done", 1.0)
    assert {"matmul", "memory", "all-reduce", "p2p", "disk"} <= {s for s, _ in steps}
    assert torch.get_num_threads() >= 1  # the parent's settings are left alone


def test_quick_calibration_numbers_are_positive_and_finite(quick_run):
    cal, cluster, _, _ = quick_run
    assert (cluster.nodes, cluster.gpus_per_node, cluster.backend) == (1, 2, "gloo")
    d = cluster.device
    links = [cluster.intra_node, cluster.inter_node, cluster.host_to_device, cluster.nvme]
    numbers = [*d.peak_flops.values(), d.memory_bytes, d.memory_bandwidth, *(l.bandwidth for l in links),
               cluster.host_memory_bytes, cluster.nvme_bytes, *(x for p in d.efficiency for x in p)]
    assert all(math.isfinite(x) and x > 0 for x in numbers)
    assert all(math.isfinite(l.latency_s) and l.latency_s >= 0 for l in links)
    assert 1e8 < d.peak_flops["fp32"] < 1e13  # a CPU core, give or take
    # the fp32 peak is the fastest dense kernel's rate in model FLOPs (a Winograd 3 x 3 convolution can beat every
    # matmul); the curve is relative to it, so the curve times the peak gives back each measured matmul's rate
    (probe_flops, conv_s), = cal.samples["conv"]
    assert probe_flops == conv_flops()
    best_matmul = max(rate for _, rate in cal.matmul)
    assert d.peak_flops["fp32"] == pytest.approx(max(best_matmul, conv_flops() / conv_s), rel=1e-3)
    for (flops, e), (n, rate) in zip(d.efficiency, sorted(cal.matmul)):
        assert flops == 2 * n**3 and e * d.peak_flops["fp32"] == pytest.approx(rate, rel=2e-3)
    assert 0 < efficiency(d, 1e9) <= 1
    assert cluster.intra_node.latency_s < 0.1 and cluster.intra_node.bandwidth > 1e7  # gloo on loopback
    assert d.memory_bytes * 2 <= cluster.host_memory_bytes
    assert {"all_reduce", "all_gather", "reduce_scatter", "p2p"} <= set(cal.samples)
    assert cal.collective_s >= 0 and cluster.intra_node.collective_s == pytest.approx(cal.collective_s, rel=1e-3)
    for name, samples in cal.samples.items():
        assert samples and all(s > 0 and t > 0 for s, t in samples), name


def test_calibrated_cluster_round_trips_through_toml(quick_run, tmp_path):
    _, cluster, _, _ = quick_run
    path = tmp_path / "calibrated.toml"
    path.write_text(cluster_to_toml(cluster))
    assert parse_cluster(str(path)) == cluster
    assert parse_cluster(str(path), gpus_per_node=1).nodes == 2


@pytest.mark.parametrize("load,cores,factor", [(0.3, 2, 1.0), (16.0, 2, 8.0), (6.0, 16, 1.0)])
def test_the_wall_clock_bounds_scale_with_the_load(monkeypatch, load, cores, factor):
    """mmplan demo calibrates first: on a loaded machine its fixed 60 s bound failed the demo instead of waiting."""
    from planner.calibrate import settings as settings_module

    monkeypatch.setattr(settings_module.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(settings_module.os, "cpu_count", lambda: cores)
    quick, full = Settings.for_run(True), Settings.for_run(False)
    assert (quick.deadline_s, quick.timeout_s, full.deadline_s) == (60 * factor, 30 * factor, 240 * factor)
