"""planner/commands/compare.py: JSON figures and the best plan, traces, metrics logs and predicted-vs-measured deviations."""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field, replace

import pytest
from rich.console import Console

from cost_models.evaluate import evaluate
from cost_models.cluster_spec import parse_cluster
from planner.solver.baselines import homogeneous_plan
from planner.commands.compare import (
    Compared,
    best_index,
    deviation,
    deviation_summary,
    load_compared,
    metrics_from_rows,
    read_metrics,
    write_traces,
)
from planner.commands.report import compare_json, compare_table, measured_table
from plans.errors import FormatError, MmplanError
from plans.graph import Block, Edge, Profile
from plans.plan import save_plan


def chain_profile(layers: int = 4) -> Profile:
    """embed -> layers -> head, fp32, small enough to evaluate in milliseconds."""
    blocks = [Block("embed", "llm", "Embedding", 1000, 4000, 0.0, 0.0, 1e4, 1e4)]
    blocks += [Block(f"layers.{i}", "llm", "Layer", 10**5, 4 * 10**5, 1e8, 2e8, 1e5, 1e4, supports_tp=True, signature="layer")
               for i in range(layers)]
    blocks.append(Block("head", "llm", "Linear", 10**4, 4 * 10**4, 1e7, 2e7, 1e4, 1e3))
    names = [b.name for b in blocks]
    edges = tuple(Edge(a, b, 1e4) for a, b in zip(names, names[1:]))
    return Profile.build("chain", "fp32", 1, tuple(blocks), edges)


@pytest.fixture(scope="module")
def setup():
    profile, cluster = chain_profile(), parse_cluster("4xlocal-cpu")
    plans = {name: homogeneous_plan(profile, cluster, 8, layout) for name, layout in
             (("pp2", "tp=1,pp=2,dp=2"), ("dp4", "tp=1,pp=1,dp=4,micro-batch=2"), ("pp4", "tp=1,pp=4,dp=1,schedule=gpipe"))}
    return profile, cluster, plans


def compared(profile, plans, names):
    out = []
    for n in names:
        ev = evaluate(plans[n], profile)
        out.append(Compared(f"{n}.json", plans[n], ev.predicted, ev))
    return out


def test_json_keeps_argument_order_and_flags_the_fastest_fitting_plan(setup):
    profile, _, plans = setup
    items = compared(profile, plans, ["pp4", "dp4", "pp2"])
    data = compare_json(items)
    assert [d["plan"] for d in data] == ["pp4.json", "dp4.json", "pp2.json"]
    fastest = min(range(3), key=lambda i: items[i].predicted.step_time_s)
    assert [d["best"] for d in data] == [i == fastest for i in range(3)] and best_index(items) == fastest
    for d, c in zip(data, items):
        p = c.predicted
        assert (d["step_time_s"], d["samples_per_s"], d["tflops_per_gpu"], d["mfu"], d["bubble_fraction"], d["fits"]) == \
               (p.step_time_s, p.samples_per_s, p.tflops_per_gpu, p.mfu, p.bubble_fraction, p.fits)
        assert [m["rank"] for m in d["peak_memory_bytes"]] == [0, 1, 2, 3]
        assert set(d["peak_memory_bytes"][0]) == {"rank", "gpu", "cpu", "nvme"}
        assert d["max_memory_bytes"]["gpu"] == max(m.gpu for m in p.memory)
    json.dumps(data, allow_nan=False)  # plain JSON


def test_a_plan_that_does_not_fit_is_never_best(setup):
    profile, cluster, plans = setup
    items = compared(profile, plans, ["pp2", "dp4"])
    fast = min(items, key=lambda c: c.predicted.step_time_s)
    overflowing = replace(fast, predicted=replace(fast.predicted, fits=False))
    others = [c for c in items if c is not fast]
    assert best_index([overflowing, *others]) == 1
    assert best_index([overflowing]) is None
    text = _render(compare_table([overflowing, *others]))
    assert "★ best" in text and "no" in text


def test_table_lists_every_figure(setup):
    profile, _, plans = setup
    text = _render(compare_table(compared(profile, plans, ["pp2", "dp4"])))
    for needle in ("step time", "samples/s", "tokens/s", "TFLOP/s per GPU", "MFU", "peak GPU memory", "peak CPU memory",
                   "peak NVMe", "bubble", "comm per step", "bottleneck", "model: tp1 pp2 dp2", "★ best"):
        assert needle in text, needle


def test_without_a_profile_stored_predictions_are_used_and_required(setup, tmp_path):
    profile, _, plans = setup
    save_plan(plans["pp2"], tmp_path / "with.json")
    save_plan(replace(plans["pp2"], predicted=None), tmp_path / "bare.json")
    (item,) = load_compared([tmp_path / "with.json"])
    assert item.evaluation is None and item.predicted == plans["pp2"].predicted
    with pytest.raises(MmplanError, match="bare.json carries no predicted figures.*--profile"):
        load_compared([tmp_path / "with.json", tmp_path / "bare.json"])
    (evaluated,) = load_compared([tmp_path / "bare.json"], profile)
    assert evaluated.evaluation is not None and evaluated.predicted == plans["pp2"].predicted


def test_traces_have_one_process_per_rank_and_unique_names(setup, tmp_path):
    profile, _, plans = setup
    items = compared(profile, plans, ["pp2", "dp4"])
    items.append(Compared("elsewhere/pp2.json", items[0].plan, items[0].predicted, items[0].evaluation))
    paths = write_traces(items, tmp_path / "traces")
    assert [p.name for p in paths] == ["pp2.trace.json", "dp4.trace.json", "pp2-2.trace.json"]
    trace = json.loads(paths[0].read_text())
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert sorted(e["pid"] for e in names) == [0, 1, 2, 3]
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert slices and {e["cat"] for e in slices} >= {"compute"} and all(e["dur"] >= 0 for e in slices)
    with pytest.raises(MmplanError, match="pass --profile"):
        write_traces([Compared("x.json", items[0].plan, items[0].predicted)], tmp_path)


# --- predicted vs measured ---------------------------------------------------------------------------------------

def rows(n_steps: int = 4, world: int = 4):
    """Step 0 is slow (warm-up); later steps vary so the median is a middle value."""
    out = []
    for step in range(n_steps):
        scale = 5.0 if step == 0 else 1.0 + 0.1 * step
        out.append({"step": step, "loss": 2.0 - 0.1 * step, "step_time_s": 0.010 * scale,
                    "compute_s": [0.004 * scale + 0.001 * r for r in range(world)], "comm_s": [0.001 * scale] * world,
                    "idle_s": [0.0] * world, "peak_memory_bytes": [1e6 * (r + 1) for r in range(world)]})
    return out


def test_deviations_are_medians_after_warmup_relative_to_the_measurement(setup):
    profile, _, plans = setup
    ev = evaluate(plans["pp2"], profile)
    summary = deviation_summary(plans["pp2"], ev, rows())
    assert (summary["steps"], summary["steps_used"], summary["warmup_steps_skipped"]) == (4, 3, 1)
    step = summary["step_time_s"]
    assert step["measured"] == pytest.approx(0.012)  # median of 0.011, 0.012, 0.013; step 0 left out
    assert step["predicted"] == ev.predicted.step_time_s
    assert step["deviation_pct"] == pytest.approx((ev.predicted.step_time_s - 0.012) / 0.012 * 100)
    r2 = summary["ranks"][2]
    assert r2["rank"] == 2
    busy = ev.busy[2].compute + ev.busy[2].comm
    assert r2["busy_s"]["predicted"] == pytest.approx(busy)
    assert r2["busy_s"]["measured"] == pytest.approx(0.004 * 1.2 + 0.002 + 0.001 * 1.2)
    assert r2["peak_memory_bytes"]["measured"] == 3e6
    assert r2["peak_memory_bytes"]["deviation_pct"] == pytest.approx((ev.predicted.memory[2].gpu - 3e6) / 3e6 * 100)
    assert deviation(1.1, 1.0) == pytest.approx(10.0) and deviation(1.0, 0.0) is None


def test_stored_predictions_give_step_and_memory_but_no_busy_time(setup):
    profile, _, plans = setup
    summary = deviation_summary(plans["pp2"], plans["pp2"].predicted, rows())
    assert summary["step_time_s"]["deviation_pct"] is not None
    assert summary["ranks"][0]["busy_s"]["predicted"] is None and summary["ranks"][0]["busy_s"]["deviation_pct"] is None
    text = _render(measured_table(plans["pp2"], plans["pp2"].predicted, rows()))
    assert "step time" in text and "rank 3 peak memory" in text and "first 1 skipped" in text


def test_a_single_step_is_used_and_rows_may_be_dataclasses_or_scalars(setup):
    profile, _, plans = setup

    @dataclass
    class StepMetrics:  # the runtime's row type
        step: int
        loss: float
        step_time_s: float
        compute_s: list = field(default_factory=list)
        comm_s: list = field(default_factory=list)
        idle_s: list = field(default_factory=list)
        peak_memory_bytes: list = field(default_factory=list)

    one = StepMetrics(0, 1.0, 0.02, [0.01] * 4, [0.0] * 4, [0.01] * 4, [1e6] * 4)
    summary = deviation_summary(plans["pp2"], plans["pp2"].predicted, [one])
    assert summary["steps_used"] == 1 and summary["step_time_s"]["measured"] == 0.02
    scalar = {"step": 0, "step_time_s": 0.02, "compute_s": 0.01, "comm_s": 0.005, "peak_memory_bytes": 5.0}
    ev = evaluate(plans["pp2"], profile)
    assert deviation_summary(plans["pp2"], ev, [scalar])["ranks"][3]["busy_s"]["measured"] == pytest.approx(0.015)


@pytest.mark.parametrize("lines,needle", [
    ([], "has no steps"),
    (["{not json"], "line 1 is not valid JSON"),
    (["[1, 2]"], "line 1 is a JSON list"),
    (['{"step": 0, "compute_s": [1], "peak_memory_bytes": [1]}'], "line 1 lacks field 'step_time_s'"),
    (['{"step": 0, "step_time_s": "fast", "compute_s": [1], "peak_memory_bytes": [1]}'], "'step_time_s' must be a finite number >= 0, got 'fast'"),
    (['{"step": -1, "step_time_s": 1, "compute_s": [1], "peak_memory_bytes": [1]}'], "'step' must be an integer >= 0"),
    (['{"step": 0, "step_time_s": 1, "compute_s": [], "peak_memory_bytes": [1]}'], "'compute_s' is an empty list"),
    (['{"step": 0, "step_time_s": 1, "compute_s": [1, null], "peak_memory_bytes": [1]}'], "'compute_s[1]' must be a finite number"),
])
def test_malformed_metrics_logs_are_one_line_errors(tmp_path, lines, needle):
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(FormatError) as e:
        read_metrics(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_metrics_of_another_plan_are_rejected(setup, tmp_path):
    _, _, plans = setup
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(world=2)) + "\n")  # blank lines are fine
    assert len(read_metrics(path)) == 4
    with pytest.raises(FormatError, match="compute_s lists 2 ranks but the plan has 4"):
        deviation_summary(plans["pp2"], plans["pp2"].predicted, read_metrics(path))
    with pytest.raises(FormatError, match="has no steps"):
        metrics_from_rows([])


def _render(table) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_memory_model_megatron_counts_the_gradient_buffer_and_the_gpu_overhead(setup, tmp_path):
    from cost_models.evaluate import evaluate
    from cost_models.workspace import CUDA_CONTEXT

    profile, _, plans = setup
    save_plan(plans["pp2"], tmp_path / "p.json")
    (tensors,) = load_compared([tmp_path / "p.json"], profile)
    (megatron,) = load_compared([tmp_path / "p.json"], profile, "megatron")
    # local-cpu (gloo): no GPU overhead, only the fp32 gradient buffer where gradients are in a half dtype
    assert megatron.predicted.memory == evaluate(plans["pp2"], profile, grad_buffer="fp32").memory
    on_gpus = replace(plans["pp2"], cluster=parse_cluster("4xh100-sxm"))
    ev = evaluate(on_gpus, profile, grad_buffer="fp32", overhead="device")
    assert min(m.gpu for m in ev.memory) > CUDA_CONTEXT + min(m.gpu for m in tensors.predicted.memory)
    with pytest.raises(MmplanError, match="--memory-model must be one of tensors, megatron"):
        load_compared([tmp_path / "p.json"], profile, "deepspeed")
    with pytest.raises(MmplanError, match="--memory-model megatron needs --profile"):
        load_compared([tmp_path / "p.json"], None, "megatron")
