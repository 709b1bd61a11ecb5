"""`mmplan calibrate --device cuda`: the one-line refusal without CUDA, and the cluster TOML written from (fake)
measurements: links per scope from the collectives' fits, the GEMM curve by kernel FLOPs, FSDP2's per-block cost."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from cost_models.cluster_toml import load_cluster_toml
from cost_models.hardware import efficiency
from planner.calibrate.cuda import (COLLECTIVES, CudaMeasurements, gemm_points, link_from_collective, scope_link,
                                    write_cluster)
from planner.cli import app
from plans.cluster import Link
from tests.cli_helpers import one_line_error

SIZES = tuple(float(2**k) for k in range(16, 31, 2))


def _samples(bandwidth: float, latency: float, ranks: int) -> dict:
    """Exact collective times over `ranks` ranks on a per-hop link (bandwidth, latency), as comm.py prices them."""
    p = ranks
    t = {"all_gather": lambda s: (p - 1) * latency + (p - 1) / p * s / bandwidth,
         "reduce_scatter": lambda s: (p - 1) * latency + (p - 1) / p * s / bandwidth,
         "all_reduce": lambda s: 2 * (p - 1) * latency + 2 * (p - 1) / p * s / bandwidth,
         "p2p": lambda s: latency + s / bandwidth}
    return {op: tuple((s, t[op](s)) for s in SIZES) for op in COLLECTIVES}


def _measurements(nodes: int = 2) -> CudaMeasurements:
    gemm = ((1024, 1024, 1024, 2 * 1024**3 / 200e12), (8192, 8192, 8192, 2 * 8192**3 / 700e12),
            (8192, 14336, 4096, 2 * 8192 * 14336 * 4096 / 720e12))
    return CudaMeasurements(
        device_name="NVIDIA H100 80GB HBM3", memory_bytes=80 * 10**9, nodes=nodes, gpus_per_node=8, gemm=gemm,
        memory_bandwidth=3.0e12, host_to_device=Link(50e9, 10e-6),
        collectives={"intra_node": _samples(370e9, 3e-6, 8), "inter_node": _samples(48e9, 10e-6, nodes)},
        ranks={"intra_node": 8, "inter_node": nodes}, fsdp_block_s=0.4e-3, host_memory_bytes=2 * 10**12,
        nvme=Link(3e9, 100e-6), nvme_bytes=10**13)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda_in_one_line(tmp_path):
    res = CliRunner().invoke(app, ["calibrate", "--device", "cuda", "--output", str(tmp_path / "c.toml")])
    assert "needs CUDA" in one_line_error(res)
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.parametrize("op", COLLECTIVES)
def test_per_hop_link_recovered_from_each_collective(op):
    from planner.calibrate.fit import fit_alpha_beta

    fit = fit_alpha_beta(*zip(*_samples(370e9, 3e-6, 8)[op]))
    link = link_from_collective(op, fit, 8)
    assert link.bandwidth == pytest.approx(370e9, rel=1e-6)
    assert link.latency_s == pytest.approx(3e-6, rel=1e-3)


def test_scope_link_takes_the_slowest_collective():
    samples = _samples(370e9, 3e-6, 8)
    samples["all_reduce"] = _samples(200e9, 3e-6, 8)["all_reduce"]
    assert scope_link(samples, 8).bandwidth == pytest.approx(200e9, rel=1e-3)


def test_gemm_points_by_flops():
    pts = gemm_points(((8, 8, 8, 1.0), (8, 8, 8, 0.5), (16, 16, 16, 1.0)))
    assert pts == ((1024.0, 1536.0), (8192.0, 8192.0))


def test_writes_a_cluster_toml_the_solver_reads(tmp_path):
    path = tmp_path / "gpu.toml"
    written = write_cluster(_measurements(), path, peak_bf16=989.4e12)
    cluster = load_cluster_toml(path)
    assert cluster == written
    assert (cluster.nodes, cluster.gpus_per_node, cluster.backend) == (2, 8, "nccl")
    assert cluster.intra_node.bandwidth == pytest.approx(370e9, rel=1e-3)
    assert cluster.inter_node.bandwidth == pytest.approx(48e9, rel=1e-3)
    assert cluster.inter_node.latency_s == pytest.approx(10e-6, rel=1e-2)
    assert cluster.zero_block_s == pytest.approx(0.4e-3)
    assert cluster.device.peak_flops["bf16"] == 989.4e12
    # the largest GEMM measured at 720 TFLOP/s: 0.728 of the datasheet peak on the cost model's curve
    assert efficiency(cluster.device, 2 * 8192 * 14336 * 4096) == pytest.approx(720 / 989.4, rel=1e-3)


def test_one_node_uses_the_intra_node_link_across(tmp_path):
    cluster = write_cluster(_measurements(nodes=1), tmp_path / "one.toml")
    assert cluster.inter_node == cluster.intra_node
    assert cluster.device.peak_flops["bf16"] == pytest.approx(720e12)  # no datasheet given: the fastest GEMM
