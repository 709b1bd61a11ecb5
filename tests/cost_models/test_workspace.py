"""GPU memory beyond the tensors (cuBLAS workspaces, NCCL buffers, CUDA context, fragmentation): exact sums of the cited
figures on GPU clusters, nothing on CPU (gloo) ranks, and evaluate's default accounting unchanged."""
from __future__ import annotations

import pytest

from cost_models.cluster_spec import catalog_cluster
from cost_models.evaluate import evaluate
from cost_models.workspace import (CUBLAS_WORKSPACE, CUDA_CONTEXT, FRAGMENTATION, NCCL_BUFFSIZE, GpuOverhead,
                                   gpu_overhead, nccl_buffer_bytes)
from plans import plan as P
from plans.errors import MmplanError
from plans.graph import Block, Edge, Profile

MiB = 2**20


def test_nccl_buffers_per_communicator():
    assert nccl_buffer_bytes(tp=1, dp=1, pp=1) == 0  # a lone rank opens no communicator
    assert nccl_buffer_bytes(tp=8, dp=1, pp=1) == 24 * 2 * 4 * MiB  # 24 channels x 2 ring peers x NCCL_BUFFSIZE
    assert nccl_buffer_bytes(tp=8, dp=4, pp=2) == 2 * 24 * 2 * NCCL_BUFFSIZE + 2 * 2 * NCCL_BUFFSIZE  # + the p2p one


def test_overhead_on_gpus_and_none_on_cpu_ranks():
    h100 = gpu_overhead(catalog_cluster("8xh100-sxm"), tp=8, dp=1, pp=1)
    assert h100 == GpuOverhead(cublas=2 * 32 * MiB, nccl=192 * MiB, context=723 * MiB, fragmentation=0.15)
    a100 = gpu_overhead(catalog_cluster("8xa100-80g"), tp=1, dp=8, pp=1)
    assert a100.cublas == 2 * CUBLAS_WORKSPACE["other"] == 2 * 8519680  # PyTorch's ":4096:2:16:8" default
    cpu = gpu_overhead(catalog_cluster("4xlocal-cpu"), tp=2, dp=2, pp=1)
    assert cpu == GpuOverhead() and cpu.seen_by(1234.0, "device") == 1234.0


def test_seen_by_each_measurement():
    o = GpuOverhead(cublas=10.0, nccl=100.0, context=1000.0, fragmentation=0.2)
    assert o.seen_by(90.0, "allocated") == 100.0  # max_memory_allocated: tensors + cuBLAS workspaces
    assert o.seen_by(90.0, "reserved") == pytest.approx(125.0)  # / (1 - fragmentation)
    assert o.seen_by(90.0, "device") == pytest.approx(1225.0)  # + NCCL buffers + CUDA context
    with pytest.raises(MmplanError, match="seen must be"):
        o.seen_by(1.0, "nvidia-smi")


def _plan(cluster_name: str, tp: int) -> tuple[P.Plan, Profile]:
    blocks = tuple(Block(f"l{i}", "llm", "Layer", 10**6, 2 * 10**6, 1e9, 2e9, 1e6, 1e3, supports_tp=True) for i in range(2))
    profile = Profile.build("m", "bf16", 1, blocks, (Edge("l0", "l1", 1e3),))
    stages = (P.Stage(("l0", "l1"), tuple(range(tp))),)
    plan = P.Plan(P.ProfileRef("m", profile.fingerprint), catalog_cluster(cluster_name), P.Training(4, 2),
                  (P.Group("llm", 1, tp, 1, stages),))
    return P.check_plan(plan, profile), profile


def test_evaluate_adds_the_overhead_only_when_asked_and_only_on_gpus():
    plan, profile = _plan("8xh100-sxm", 8)
    tensors = evaluate(plan, profile).memory
    device = evaluate(plan, profile, overhead="device").memory
    allocated = evaluate(plan, profile, overhead="allocated").memory
    for t, d, a in zip(tensors, device, allocated):
        assert a.gpu == t.gpu + 2 * 32 * MiB
        assert d.gpu == pytest.approx(a.gpu / (1 - FRAGMENTATION) + nccl_buffer_bytes(tp=8, dp=1, pp=1) + CUDA_CONTEXT)
        assert (d.cpu, d.nvme) == (t.cpu, t.nvme)
    cpu_plan, cpu_profile = _plan("2xlocal-cpu", 2)  # local-cpu keeps its measured accounting, exactly
    assert evaluate(cpu_plan, cpu_profile, overhead="device").memory == evaluate(cpu_plan, cpu_profile).memory
