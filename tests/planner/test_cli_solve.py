"""`mmplan solve`: writes a checked plan, prints the summary or one JSON object, exit 2 with the shortfall."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans.graph import save_profile
from plans.plan import load_plan

runner = CliRunner()


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict[str, Path]:
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    root = tmp_path_factory.mktemp("profiles")
    out = {}
    for name in ("tiny-vlm-heavy", "tiny-avlm", "llava-1.5-7b"):
        out[name] = root / f"{name}.json"
        save_profile(profile_model(resolve(name)), out[name])
    return out


def invoke(*args: str):
    return runner.invoke(app, ["solve", *map(str, args)])


def test_json_has_the_promised_fields_and_the_plan_is_written(profiles, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke(profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 8, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # one object, nothing else on stdout
    for key in ("plan", "step_time_s", "baseline_step_time_s", "speedup_vs_homogeneous", "solve_time_s", "fits"):
        assert key in data
    assert data["plan"] == str(out) and data["fits"] is True
    assert data["step_time_s"] <= data["baseline_step_time_s"] * (1 + 1e-12) and data["speedup_vs_homogeneous"] >= 1 - 1e-12
    plan = load_plan(out)
    assert plan.predicted.step_time_s == pytest.approx(data["step_time_s"])
    assert plan.solver.time_s > 0 and plan.solver.candidates > 0
    assert all(g.tp == 1 for g in plan.groups)  # local-cpu: tensor parallelism not used


def test_summary_table(profiles, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "64xh100-sxm", "--global-batch", 64, "-o", out,
               "--placement", "non-colocated")
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    for phrase in ("GPUs per modality", "predicted step", "peak memory per rank", "homogeneous baseline", "speed-up",
                   "candidate layouts", f"wrote {out}"):
        assert phrase in text, phrase
    # the search's own summary, or, when the homogeneous baseline predicts faster and is emitted, the grid's
    assert "candidate layouts" in text or "fit in memory" in text
    plan = load_plan(out)
    assert {g.name for g in plan.groups} in ({"vision", "llm"}, {"model"})


def test_colocated_and_gpipe(profiles, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke(profiles["tiny-avlm"], "--cluster", "2xlocal-cpu", "--global-batch", 4, "-o", out, "--placement", "colocated",
               "--schedule", "gpipe", "--no-memory-tiers", "--solver", "cbc", "--json")
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert plan.training.schedule == "gpipe"
    assert json.loads(r.stdout)["structure"] in ("colocated", "baseline")


def test_time_limit_says_it_stopped_early(profiles, tmp_path):
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "512xh100-sxm", "--global-batch", 1024, "-o", tmp_path / "p.json",
               "--time-limit", "0.3")
    assert r.exit_code == 0, r.output
    assert "stopped early" in " ".join(r.output.split())


def test_infeasible_exits_2_with_the_bytes_short(profiles, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "local-cpu", "--global-batch", 2, "-o", out)
    assert r.exit_code == 2
    assert "GB short" in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_too_few_gpus_exits_2_naming_them(profiles, tmp_path):
    r = invoke(profiles["tiny-avlm"], "--cluster", "2xlocal-cpu", "--global-batch", 4, "-o", tmp_path / "p.json",
               "--placement", "non-colocated")
    assert r.exit_code == 2 and "needs at least 3 GPUs" in " ".join(r.output.split())


def test_baseline_path_writes_that_layout(profiles, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "16xh100-sxm", "--global-batch", 32, "-o", out,
               "--baseline", "homogeneous", "--layout", "tp=4,pp=2,dp=2", "--json")
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    (g,) = plan.groups
    assert (g.tp, g.pp, g.dp) == (4, 2, 2) and plan.solver.method == "baseline:homogeneous"
    assert json.loads(r.stdout)["structure"] == "baseline"


def test_megatron_with_a_layout_fixes_its_degrees_and_puts_the_encoders_first(profiles, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "16xh100-sxm", "--global-batch", 32, "-o", out,
               "--baseline", "megatron", "--layout", "tp=4,pp=2,dp=2", "--json")
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    (g,) = plan.groups
    assert (g.tp, g.pp, g.dp) == (4, 2, 2) and plan.solver.method == "baseline:megatron"
    assert all(b.startswith("llm.") for b in g.stages[1].blocks)  # every encoder block on the first stage
    assert "split=encoders-first" in plan.solver.notes


@pytest.mark.parametrize("kind", ["zero3", "gpipe-even", "megatron"])
def test_a_baselines_search_keeps_the_micro_batch_asked_for(profiles, tmp_path, kind):
    """--micro-batch (samples per micro-batch over the data-parallel replicas) binds --baseline's search too: it
    used to be dropped there silently, leaving the baseline's own choice."""
    out = tmp_path / "plan.json"
    r = invoke(profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 16, "--micro-batch", 8, "-o", out,
               "--baseline", kind)
    assert r.exit_code == 0, r.output
    assert load_plan(out).training.micro_batches == 2


@pytest.mark.parametrize("args,message", [
    (("--layout", "tp=1,pp=1,dp=4"), "--baseline homogeneous"),
    (("--layout", "tp=1,pp=1,dp=4"), "or --baseline megatron"),
    (("--baseline", "megatron", "--layout", "tp=1,pp=1,dp=4,split=even"), "split must be one of layers, flops, encoders-first"),
    (("--baseline", "zero3", "--layout", "tp=1,pp=1,dp=4"), "--layout applies to --baseline homogeneous or megatron"),
    (("--baseline", "homogeneous", "--layout", "tp=1,pp=1,dp=4", "--micro-batch", "4"), "micro-batch=N"),
    (("--baseline", "zero3", "--micro-batch", "2"), "not divisible by the baseline's 4 data-parallel replicas"),
    (("--baseline", "homogeneous", "--layout", "tp=1,pp=2,dp=2", "--schedule", "gpipe"), "write schedule=... in the layout"),
    (("--baseline", "zero3", "--schedule", "gpipe"), "drop --schedule"),
    (("--baseline", "homogeneous", "--from", "megatron", "--pipeline-model-parallel-size 2", "--micro-batch", "2",
      "--no-memory-tiers"), "--micro-batch, --no-memory-tiers do not apply"),
    (("--micro-batch", "3"), "does not divide the global batch"),
    (("--time-limit", "-1"), "--time-limit"),
])
def test_bad_options_exit_2(profiles, tmp_path, args, message):
    r = invoke(profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 8, "-o", tmp_path / "p.json", *args)
    assert r.exit_code == 2 and message in " ".join(r.output.split())


def test_layout_sequence_parallel_is_accepted_where_tp_does_not_divide_the_sequence(profiles, tmp_path):
    """tiny-avlm's 17-token ViT at tp=2: the runtime pads it to 18, so --layout ...,sequence-parallel=true is written."""
    out = tmp_path / "p.json"
    r = invoke(profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 8, "-o", out,
               "--baseline", "homogeneous", "--layout", "tp=2,pp=1,dp=2,sequence-parallel=true")
    assert r.exit_code == 0, r.output
    assert all(g.sequence_parallel for g in load_plan(out).groups if g.tp > 1)


@pytest.mark.parametrize("layout,where", [(("--baseline", "homogeneous", "--layout", "tp=3,pp=1,dp=2"), ""),
                                          (("--layout", "vision:tp=3;audio:dp=1;llm:dp=2"), "group 'vision': ")])
def test_a_tp_that_does_not_divide_the_heads_is_refused(profiles, tmp_path, layout, where):
    """tp=3 divides the 6 GPUs of the node but not tiny-avlm's heads and widths (gcd 4 in the vision layers): one line
    naming the block and the tps that would shard it, nothing written (it used to write a plan the runtime refuses)."""
    out = tmp_path / "p.json"
    r = invoke(profiles["tiny-avlm"], "--cluster", "6xlocal-cpu", "--global-batch", 6, "-o", out, *layout)
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and not out.exists(), r.output
    assert f"{where}tp=3 does not divide the heads and widths of block vision.layers.0" in text
    assert "greatest common divisor is 4): use a tp among its divisors 1, 2, 4" in text


def test_unwritable_output_fails_before_solving(profiles, tmp_path):
    r = invoke(profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 8, "-o", tmp_path / "missing" / "p.json")
    assert r.exit_code == 2 and "does not exist" in r.output


def test_unknown_placement_is_a_usage_error(profiles, tmp_path):
    r = invoke(profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 8, "--placement", "sideways")
    assert r.exit_code == 2


def test_json_reports_both_baselines_and_baseline_writes_exactly_that_plan(profiles, tmp_path):
    """`--baseline homogeneous|megatron` writes the very plan `solve` compared with (same step, same layout)."""
    common = (profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 8, "--json")
    r = invoke(*common, "-o", tmp_path / "solved.json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data["baselines"]) == {"homogeneous", "megatron"}
    solved = load_plan(tmp_path / "solved.json")
    assert solved.solver.baselines == {k: v["step_time_s"] for k, v in data["baselines"].items()}
    assert solved.solver.memory_reserve == pytest.approx(0.10)
    for name, b in data["baselines"].items():
        assert data["step_time_s"] <= b["step_time_s"] * (1 + 1e-12)
        out = tmp_path / f"{name}.json"
        r = invoke(*common, "-o", out, "--baseline", name)
        assert r.exit_code == 0, r.output
        plan = load_plan(out)
        assert plan.predicted.step_time_s == pytest.approx(b["step_time_s"], rel=1e-12), name
        assert plan.solver.method == f"baseline:{name}"


def test_memory_reserve_is_respected_and_recorded(profiles, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "8xh100-sxm", "--global-batch", 16, "-o", out, "--json",
               "--memory-reserve", "0.4")
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    cap = plan.cluster.device.memory_bytes
    assert cap == 80 * 10**9 or cap > 60e9  # the real device, not the reduced one the search planned for
    assert plan.solver.memory_reserve == pytest.approx(0.4)
    assert max(m.gpu for m in plan.predicted.memory) <= 0.6 * cap
    bad = invoke(profiles["tiny-avlm"], "--cluster", "4xlocal-cpu", "--global-batch", 8, "-o", tmp_path / "x.json",
                 "--memory-reserve", "1.5")
    assert bad.exit_code == 2 and "--memory-reserve" in bad.output and not (tmp_path / "x.json").exists()


def test_an_explicit_schedule_binds_the_plan_written_even_when_a_baseline_wins(profiles, tmp_path):
    """The Megatron-style baseline searches 1F1B, GPipe and interleaved 1F1B and is written when faster; with
    --schedule given, it searches that schedule only, so the plan keeps what was asked for."""
    out = tmp_path / "plan.json"
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "32xh100-sxm", "--global-batch", 64, "--schedule", "gpipe", "-o", out)
    assert r.exit_code == 0, r.output
    assert load_plan(out).training.schedule == "gpipe"


def test_a_megatron_baseline_that_cannot_fit_says_why_and_where_to_go(profiles, tmp_path):
    r = invoke(profiles["llava-1.5-7b"], "--cluster", "1xa100-40g", "--global-batch", 8, "--baseline", "megatron",
               "-o", tmp_path / "m.json")
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and "no Megatron-style layout" in text and "solve without --baseline" in text
    assert "--memory-tiers" not in text and not (tmp_path / "m.json").exists()
