"""Issue 11 item 5, local fidelity: the runtime costs `calibrate` measures (Cluster fields, cluster TOML, plan JSON),
their one use in the cost model, profile --measure's threads and spread, `run` on another cluster than the plan's,
and impossible figures (MFU > 1) as errors."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.evaluate import evaluate
from cost_models.cluster_spec import parse_cluster
from cost_models.cluster_toml import cluster_from_toml, cluster_to_toml
from cost_models.overhead import optimizer_time
from planner.commands.actual import on_actual_cluster
from planner.calibrate.fit import fit_optimizer
from planner.calibrate.runtime_probes import ZERO_BLOCKS, ZERO_TENSORS_PER_BLOCK, ZERO_WIDTHS, zero_block_bytes, zero_costs
from plans import plan as P
from plans.errors import MmplanError
from plans.graph import Block, Edge, Profile
from plans.serial import from_data, to_data

RUNTIME_COSTS = dict(optimizer_tensor_s=2.5e-5, optimizer_byte_s=1.5e-9, step_overhead_s=4e-3)
HOST_COSTS = dict(forward_op_s=5e-6, backward_op_s=4e-6, saved_tensor_s=2e-6, released_tensor_s=1e-6)
NONE_MEASURED = dict(optimizer_tensor_s=0.0, optimizer_byte_s=0.0, step_overhead_s=0.0, compute_slowdown=1.0,
                     zero_block_s=0.0, zero_byte_s=0.0, zero_tensor_s=0.0, forward_op_s=0.0, backward_op_s=0.0,
                     saved_tensor_s=0.0, released_tensor_s=0.0)


def unmeasured(spec: str = "2xlocal-cpu"):
    """The cluster without the runtime costs the local-cpu entry carries: what these tests add measured costs to."""
    return dataclasses.replace(parse_cluster(spec), **NONE_MEASURED)


def measured_chain(fwd_ms: float, cluster_name: str = "2xlocal-cpu") -> tuple[P.Plan, Profile]:
    """Two measured blocks on two pipeline stages of a local-cpu cluster."""
    blocks = tuple(Block(f"l.{i}", "llm", "Layer", 10**5, 4 * 10**5, 2e8, 4e8, 1e3, 1e3, supports_tp=True,
                         fwd_ms=fwd_ms, bwd_ms=2 * fwd_ms, param_tensors=3) for i in range(2))
    profile = Profile.build("chain", "fp32", 1, blocks, (Edge("l.0", "l.1", 1e3),), measured_on="cpu")
    stages = tuple(P.Stage((f"l.{i}",), (i,), P.Memory()) for i in range(2))
    plan = P.Plan(P.ProfileRef("chain", profile.fingerprint), unmeasured(cluster_name), P.Training(4, 4, dtype="fp32"),
                  (P.Group("llm", 1, 1, 2, stages),))
    return P.check_plan(plan, profile), profile


def test_runtime_costs_round_trip_through_the_cluster_toml_and_the_plan():
    measured = dataclasses.replace(unmeasured(), **RUNTIME_COSTS, **HOST_COSTS)
    text = cluster_to_toml(measured)
    assert "[runtime]" in text and cluster_from_toml(text) == measured
    plain = unmeasured()
    assert "[runtime]" not in cluster_to_toml(plain)  # files without measured costs stay as they were
    old = cluster_from_toml('base = "h100-sxm"\ngpus_per_node = 2\n')  # a file written before the fields existed
    assert (old.optimizer_tensor_s, old.optimizer_byte_s, old.step_overhead_s) == (0.0, 0.0, 0.0)
    based = cluster_from_toml('base = "local-cpu"\ngpus_per_node = 2\n')  # inherits the entry's measured costs
    assert based.step_overhead_s == parse_cluster("local-cpu").step_overhead_s > 0
    assert "optimizer_byte_s" not in to_data(plain)  # plan files keep their bytes when not measured
    assert from_data(type(measured), to_data(measured)) == measured
    with pytest.raises(Exception, match="optimizer_ns_per_byte"):
        cluster_from_toml('base = "local-cpu"\n[runtime]\noptimizer_ns_per_byte = -1\n')


def test_the_step_gains_exactly_the_measured_overhead_and_optimizer_time():
    plan, profile = measured_chain(5.0)
    before = evaluate(plan, profile)
    measured = dataclasses.replace(plan.cluster, **RUNTIME_COSTS)
    after = evaluate(dataclasses.replace(plan, cluster=measured), profile)
    opt = optimizer_time(10**5, P.Memory(), measured, dtype="fp32", tensors=3)
    assert opt == pytest.approx(10**5 * 4 * 1.5e-9 + 3 * 2.5e-5)  # the measured update replaces the bandwidth model
    assert [s.optimizer_s for s in after.stages] == pytest.approx([opt, opt])
    old_opt = before.stages[1].optimizer_s  # the last stage's optimizer step ends the step
    assert after.predicted.step_time_s == pytest.approx(before.predicted.step_time_s - old_opt + opt + 4e-3)
    assert after.simulation.overhead_s == 4e-3


def test_measured_block_times_scale_by_the_measured_slowdown_with_every_rank_busy():
    plan, profile = measured_chain(5.0)
    alone = evaluate(plan, profile)
    busy = evaluate(dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, compute_slowdown=1.5)), profile)
    for a, b in zip(alone.stages, busy.stages):  # the measured 5 / 10 ms scale; modelled terms (accumulation) do not
        assert (b.fwd_s - a.fwd_s, b.bwd_s - a.bwd_s) == pytest.approx((0.5 * 5e-3, 0.5 * 10e-3))
    slow = dataclasses.replace(unmeasured(), compute_slowdown=1.5)
    assert cluster_from_toml(cluster_to_toml(slow)) == slow
    with pytest.raises(Exception, match="compute_slowdown"):
        dataclasses.replace(slow, compute_slowdown=0.5)


def test_zero_costs_what_fsdp2_measured_per_block_byte_and_tensor_and_nothing_at_zero_0():
    """ZeRO's FSDP2 costs beyond its collectives (Cluster.zero_block_s per sharded block and micro-batch plus
    zero_byte_s per byte of its parameters, half in the forward and half in the backward; zero_tensor_s per sharded
    tensor in the optimizer step); none at ZeRO 0."""
    plan, profile = measured_chain(5.0)
    base = dict(zero_block_s=1e-3, zero_byte_s=2e-9, zero_tensor_s=2e-4)
    groups = lambda zero: (dataclasses.replace(plan.groups[0], zero=zero),)
    for zero in (0, 1, 3):
        z = dataclasses.replace(plan, groups=groups(zero))
        before = evaluate(z, profile)
        after = evaluate(dataclasses.replace(z, cluster=dataclasses.replace(plan.cluster, **base)), profile)
        for a, b in zip(before.stages, after.stages):
            op = (1e-3 + 4e5 * 2e-9) / 2  # one block of 4e5 fp32 parameter bytes per stage, 3 tensors
            extra = (op, op, 3 * 2e-4) if zero else (0.0, 0.0, 0.0)
            assert (b.fwd_s - a.fwd_s, b.bwd_s - a.bwd_s, b.optimizer_s - a.optimizer_s) == pytest.approx(extra, abs=1e-12)
    measured = dataclasses.replace(unmeasured(), **base)
    assert cluster_from_toml(cluster_to_toml(measured)) == measured
    per_block = [4e-4 + zero_block_bytes(w) * 1e-9 for w in ZERO_WIDTHS]  # 400 us + 1 ns per byte
    priced = (2e-4, 3e-2)  # what the cost model prices the probe's collectives at, per width: not FSDP2's own
    ranks = [[1e-3, 1e-3 + priced[0] + ZERO_BLOCKS * per_block[0], 5e-3, 5e-3 + priced[1] + ZERO_BLOCKS * per_block[1],
              2e-3, 2e-3 + ZERO_BLOCKS * ZERO_TENSORS_PER_BLOCK * 1e-4]] * 2
    assert zero_costs(ranks, priced) == pytest.approx((4e-4, 1e-9, 1e-4))
    assert zero_costs([[2.0, 1.0, 2.0, 1.0, 2.0, 1.0]]) == (0.0, 0.0, 0.0)  # never negative


def test_fit_optimizer_separates_per_tensor_and_per_byte_costs():
    points = ((1, 1 << 22), (64, 1 << 10), (256, 1 << 8), (32, 1 << 16))
    times = [k * 3e-5 + k * n * 4 * 2e-9 for k, n in points]
    per_tensor, per_byte = fit_optimizer(points, times)
    assert per_tensor == pytest.approx(3e-5) and per_byte == pytest.approx(2e-9)


def test_mfu_above_one_is_an_error_never_a_prediction():
    plan, profile = measured_chain(5.0)
    assert 0 < evaluate(plan, profile).predicted.mfu <= 1
    fast, fast_profile = measured_chain(1e-4)  # 0.2 GFLOP in 0.1 us: far beyond a CPU core's peak
    with pytest.raises(MmplanError, match="impossible prediction.*peak"):
        evaluate(fast, fast_profile)
    bad = P.Predicted(1.0, 1.0, 0.0, 1.0, 1.5, 0.0, 0.0, True)
    with pytest.raises(Exception, match="mfu|maximum"):
        P.check_plan(dataclasses.replace(plan, predicted=bad), profile)


def test_solve_fails_on_impossible_figures_instead_of_skipping_the_plans(tmp_path):
    """A profile measured faster than the cluster's peak makes every plan suspect: solve says so in one line (exit 2)
    and writes nothing, where it used to drop each such candidate and print whatever plan was left."""
    from typer.testing import CliRunner

    from planner.cli import app
    from planner.solver.solve import solve
    from plans.graph import save_profile

    _, fast = measured_chain(1e-4)
    with pytest.raises(MmplanError, match="impossible prediction"):
        solve(fast, unmeasured(), 4, time_limit=20)
    save_profile(fast, tmp_path / "profile.json")
    result = CliRunner().invoke(app, ["solve", str(tmp_path / "profile.json"), "--cluster", "2xlocal-cpu",
                                      "--global-batch", "4", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 2 and "impossible prediction" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "plan.json").exists()


@pytest.fixture(scope="module")
def tiny_profile():
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    return profile_model(resolve("tiny-vlm"), device="meta")


def test_run_warns_in_one_line_for_a_plan_solved_for_another_cluster(tiny_profile):
    from planner.solver.baselines import homogeneous_plan

    h100 = homogeneous_plan(tiny_profile, parse_cluster("2xh100-sxm"), 4, "tp=1,pp=1,dp=2")
    actual = on_actual_cluster(h100, tiny_profile, "gloo")
    assert not actual.same and actual.cluster.device.name == "local-cpu"
    assert "\n" not in actual.warning and "2xh100-sxm" in actual.warning and "local-cpu" in actual.warning
    here = evaluate(h100, tiny_profile, actual.cluster).predicted.step_time_s
    assert actual.predicted_step_s == pytest.approx(here) and f"{here * 1e3:.1f} ms" in actual.warning
    assert here != pytest.approx(h100.predicted.step_time_s)
    local = homogeneous_plan(tiny_profile, parse_cluster("2xlocal-cpu"), 4, "tp=1,pp=1,dp=2")
    same = on_actual_cluster(local, tiny_profile, "gloo")
    assert same.same and same.warning is None


def test_the_local_cpu_entry_prices_what_the_runtime_pays_for_zero_and_the_optimizer(tiny_profile):
    """The catalog's local-cpu carries the runtime costs calibrate measures: a ZeRO-1 plan pays FSDP2's hooks per
    block and micro-batch and its DTensor optimizer step, so on a CPU it is predicted slower than the same plain
    dp2 plan (with them at 0 the guide's solve chose dp2 + ZeRO-1, which ran 2.3x slower than plain dp2)."""
    from planner.solver.baselines import homogeneous_plan

    local = parse_cluster("2xlocal-cpu")
    at = lambda cluster, zero: homogeneous_plan(tiny_profile, cluster, 4, f"tp=1,pp=1,dp=2,zero={zero}").predicted.step_time_s
    blocks = sum(1 for b in tiny_profile.blocks if b.params)
    assert at(local, 1) - at(local, 0) >= blocks * local.zero_block_s  # each sharded block's hooks, once per micro-batch
    assert at(unmeasured(), 1) - at(unmeasured(), 0) < blocks * local.zero_block_s
    assert at(local, 0) - at(unmeasured(), 0) >= local.step_overhead_s  # the fixed per-step cost is in every plan


def test_profile_measure_times_with_runs_threads_and_records_the_spread(monkeypatch):
    import torch

    from planner.profiler import measure as measure_module
    from planner.profiler.profile import profile_model
    from runtime.launch import RANK_THREADS
    from runtime.source import resolve

    seen, timed = [], []
    real = measure_module.measure_model

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        timed.append(real(*args, **kwargs))
        return timed[-1]

    monkeypatch.setattr(measure_module, "measure_model", spy)
    before = torch.get_num_threads()
    profile = profile_model(resolve("tiny-vlm"), device="cpu", measure=True, reps=2)
    assert seen == [RANK_THREADS] and torch.get_num_threads() == before
    assert profile.options.threads == RANK_THREADS and profile.measure_spread >= 0
    assert all(b.fwd_ms > 0 and b.bwd_ms > 0 for b in profile.blocks)
    # the blocks' times add up to the whole model's at the profiled micro-batch (what machine_speed compares with)
    whole_ms = timed[0][0][0]
    assert measure_module.profiled_model_ms(profile) == pytest.approx(whole_ms, rel=1e-6)

    # timed again later: the ratio to the profile's time, measured as the profile measured it (the ranks' threads)
    def later(model, batches, device, reps):
        seen.append(torch.get_num_threads())
        assert len(batches) == 1 and next(iter(batches[0].values())).shape[0] == profile.micro_batch
        return [(1.25 * whole_ms, 0.0)]

    monkeypatch.setattr(measure_module, "measure_model", later)
    assert measure_module.machine_speed(resolve("tiny-vlm"), profile) == pytest.approx(1.25)
    assert seen[-1] == RANK_THREADS and torch.get_num_threads() == before
    meta = profile_model(resolve("tiny-vlm"))  # no measured times: nothing to compare with
    assert measure_module.profiled_model_ms(meta) is None and measure_module.machine_speed(resolve("tiny-vlm"), meta) is None


def test_measure_model_repeats_until_the_median_is_stable():
    import torch

    from planner.profiler.measure import MAX_ROUNDS, measure_model

    model = torch.nn.Linear(8, 1)
    calls = []

    class Batch(dict):
        pass

    x = torch.randn(4, 8)

    class Loss(torch.nn.Module):
        def forward(self, x):
            calls.append(1)
            return model(x).sum()

    (median, spread), = measure_model(Loss(), [{"x": x}], torch.device("cpu"), reps=3)
    assert median > 0 and spread >= 0
    assert 2 * 3 + 2 <= len(calls) <= 2 + 3 * MAX_ROUNDS  # at least two rounds to compare, at most MAX_ROUNDS


def test_a_gpu_plan_run_on_another_gpu_is_predicted_with_that_gpus_catalog_figures(monkeypatch):
    import torch

    from plans.plan import load_plan

    plan = load_plan("plans/examples/llava-1.5-13b-solved-64xh100-sxm.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    other = on_actual_cluster(plan, None, "nccl")
    assert not other.same and other.cluster.device.name == "h200" and other.cluster.world_size == 64
    assert "h100-sxm" in other.warning and "h200" in other.warning
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert on_actual_cluster(plan, None, "nccl").same
