"""`mmplan export` and `mmplan solve --from`: what each target expresses exactly, what needs --lossy and what it says,
the mapping of recomputation and memory tiers, round trips. (The targets' own code loads the files in
test_export_targets.py.)"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.export import TARGETS, export_plan
from planner.export.common import Unsupported
from planner.export.importing import parse_layout_string, plan_from
from plans.plan import load_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "plans" / "examples"
runner = CliRunner()


def example(name: str):
    return load_plan(EXAMPLES / f"{name}.json")


def flags(text: str) -> dict[str, str | None]:
    """A Megatron argument file as {flag: value or None}."""
    argv = shlex.split("\n".join(line for line in text.splitlines() if not line.startswith("#")))
    out, i = {}, 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        out[argv[i]] = value
        i += 2 if value is not None else 1
    return out


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The llava-1.5-7b profile on 64 H100s and its Megatron-style plan (a chain: vision, projector, LLM in pipeline stages)."""
    from planner.profiler.profile import profile_model
    from plans.graph import save_profile
    from runtime.source import resolve

    d = tmp_path_factory.mktemp("llava")
    profile = profile_model(resolve("llava-1.5-7b"))
    save_profile(profile, d / "profile.json")
    r = runner.invoke(app, ["solve", str(d / "profile.json"), "--cluster", "64xh100-sxm", "--global-batch", "256",
                            "--baseline", "megatron", "-o", str(d / "plan.json"), "--json"])  # a chain: Megatron's
    # own layout (the solver's best plan for this case is colocated since bubble filling and per-block ZeRO pricing)
    assert r.exit_code == 0, r.output
    return profile, d


def tiny_avlm_apart():
    """vision, audio and LLM each on their own ranks (the LLM data-parallel over two)."""
    from tests.runtime.plan_builder import make_plan

    return make_plan("tiny-avlm", [{"name": "vision", "stages": [(["vision", "vision_proj"], [2])]},
                                   {"name": "audio", "stages": [(["audio", "audio_proj"], [3])]},
                                   {"name": "llm", "dp": 2, "stages": [(["llm"], [0, 1])]}])


ONE_LAYOUT = tuple(t for t in TARGETS if t != "megatron-mimo")  # megatron-mimo writes an encoder grid beside the LLM's


@pytest.mark.parametrize("target", ONE_LAYOUT)
def test_the_export_opens_with_a_comment_naming_the_plan_and_its_predictions(target, llava):
    plan = load_plan(llava[1] / "plan.json")
    text = export_plan(plan, target, lossy=True, source="solved.json").text
    first = json.loads(text)["comment"] if target == "deepspeed" else [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert first[0].startswith("mmplan plan solved.json: llava-1.5-7b (fingerprint ")
    assert f"step {plan.predicted.step_time_s:.4g} s" in first[2] and "MFU" in first[2]


@pytest.mark.parametrize("target", ONE_LAYOUT)
def test_colocated_groups_sharing_one_layout_export_exactly(target):
    result = export_plan(example("tiny-vlm-dp2"), target)  # vision, projector and LLM colocated, all dp=2
    assert result.dropped == ()
    assert "LOSSY" not in result.text


@pytest.mark.parametrize("target, feature", [
    ("megatron", "2 encoder groups on their own ranks (Megatron-LM core_v0.16.1 runs one layout"),
    ("torchtitan", "groups with their own layouts"),
    ("deepspeed", "groups with their own layouts"),
])
def test_what_a_target_cannot_express_is_one_error_and_lossy_says_what_it_dropped(target, feature):
    plan = tiny_avlm_apart()
    with pytest.raises(Unsupported, match=re.escape(feature)) as e:
        export_plan(plan, target)
    assert "\n" not in str(e.value) and "--lossy" in str(e.value)
    result = export_plan(plan, target, lossy=True)
    assert feature in result.dropped[0]
    assert "LOSSY" in result.text and feature in result.text
    # the strict error names every feature --lossy drops (the per-group dp changes too), not the first only
    assert all(d.split(" -> ")[0] in str(e.value) for d in result.dropped) and len(result.dropped) > 1


def test_megatron_mimo_refuses_in_one_line_what_its_flags_cannot_hold(llava):
    """Megatron-LM main's MIMO flags hold one encoder grid beside the language grid: a one-layout plan, colocated groups
    with their own layouts and two encoder groups apart are refused, naming the target that expresses them (--lossy
    does not change that: the nearest plan is another target's)."""
    for plan, names in ((load_plan(llava[1] / "plan.json"), "--to megatron`"), (example("tiny-vlm-dp2"), "--to megatron`"),
                        (tiny_avlm_apart(), "--to megatron-bridge")):
        for lossy in (False, True):
            with pytest.raises(Unsupported, match="megatron-mimo .*d98e8a64dd") as e:
                export_plan(plan, "megatron-mimo", lossy=lossy)
            assert names in str(e.value) and "\n" not in str(e.value)


def test_megatron_refuses_an_encoder_on_its_own_ranks_naming_megatron_mimo():
    plan = example("vit22b-llama70b-non-colocated-128xh100-sxm")  # the ViT on ranks of its own, a layout of its own
    with pytest.raises(Unsupported, match="`--to megatron-mimo` writes Megatron-LM main's heterogeneous MIMO flags") as e:
        export_plan(plan, "megatron")
    assert "\n" not in str(e.value)
    text = export_plan(plan, "megatron-mimo", lossy=True).text
    assert "--encoder-tp" in text and "for Megatron-LM main at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553" in text
    assert "--encoder-tp" not in export_plan(plan, "megatron", lossy=True).text


def test_megatron_bridge_expresses_every_group_on_its_own_ranks():
    text = export_plan(tiny_avlm_apart(), "megatron-bridge").text
    assert "'vision': ModuleParallelismConfig" in text and "'audio': ModuleParallelismConfig" in text
    assert "'language': ModuleParallelismConfig" in text and "rank_offset=2" in text and "rank_offset=3" in text


def test_megatron_layout_string_carries_uneven_cut_points_and_mimo_renumbers_ranks(llava):
    from cost_models.cluster_spec import parse_cluster
    from planner.solver.construct import GroupLayout, build_plan
    from plans.plan import Training

    profile, _ = llava  # the LLM on ranks 0-55 (tp 4, dp 2, pp 7, uneven), the ViT and projector on 56-63 (tp 8)
    vision = tuple(b.name for b in profile.blocks if not b.name.startswith("llm"))
    llm = tuple(b.name for b in profile.blocks if b.name.startswith("llm"))
    counts = [3, 5, 5, 5, 5, 5, 4]
    cuts = tuple(1 + sum(counts[:i]) for i in range(1, 7))  # llm.embed, then the layers
    plan = build_plan(profile, parse_cluster("64xh100-sxm"), Training(64, 32), [
        GroupLayout("llm", llm, cuts, 2, 4, tuple(range(56))), GroupLayout("vision", vision, (), 1, 8, tuple(range(56, 64)))][::-1],
        predict=False)
    text = export_plan(plan, "megatron-mimo", lossy=True).text
    f = flags(text)
    assert [stage.count("t") for stage in parse_layout_string(f["--pipeline-model-parallel-layout"])] == counts
    assert (f["--encoder-tp"], f["--encoder-dp"], f["--llm-offset"]) == ("8", "1", "8")
    assert (f["--llm-tp"], f["--llm-pp"], f["--llm-dp"]) == ("4", "7", "2")
    assert "ranks renumbered" in text and "ZeRO stage 0" in text


def test_megatron_moves_encoders_to_the_first_stage_only_with_lossy():
    from tests.runtime.plan_builder import make_plan

    plan = make_plan("tiny-vlm-heavy", [{"name": "model", "dp": 2, "stages": [  # the vision encoder cut between stages
        (["vision.patch_embed", "vision.layers.0"], [0, 1]), (["vision", "vision_proj", "llm"], [2, 3])]}])
    with pytest.raises(Unsupported, match="encoder blocks after the first pipeline stage"):
        export_plan(plan, "megatron")
    assert export_plan(plan, "torchtitan").dropped == ()  # torchtitan's module_fqns_per_model_part holds that cut


def test_recomputation_maps_to_megatron_granularity_and_method(llava):
    from planner.solver.baselines import homogeneous_plan

    profile, _ = llava
    from cost_models.cluster_spec import parse_cluster

    cluster = parse_cluster("64xh100-sxm")
    full = homogeneous_plan(profile, cluster, 256, "tp=2,pp=1,dp=32,recompute=full", predict=False)
    f = flags(export_plan(full, "megatron").text)
    assert (f["--recompute-granularity"], f["--recompute-method"], f["--recompute-num-layers"]) == ("full", "uniform", "1")
    selective = homogeneous_plan(profile, cluster, 256, "tp=2,pp=1,dp=32,recompute=selective", predict=False)
    assert flags(export_plan(selective, "megatron").text)["--recompute-granularity"] == "selective"
    # the first 3 LLM layers of the stage: Megatron's block method (baselines split encoders over stages when pp > 1)
    plain = homogeneous_plan(profile, cluster, 256, "tp=2,pp=1,dp=32", predict=False)
    g = plain.groups[0]
    stages = tuple(replace(s, memory=replace(s.memory, activations={b: "recompute" for b in
                                                                      [b for b in s.blocks if b.startswith("llm.layers.")][:3]}))
                   for s in g.stages)
    block = replace(plain, groups=(replace(g, stages=stages),))
    f = flags(export_plan(block, "megatron").text)
    assert (f["--recompute-method"], f["--recompute-num-layers"]) == ("block", "3")
    assert "FullAC.Config()" in export_plan(full, "torchtitan").text


def test_memory_tiers_map_to_each_targets_offload(llava):
    from cost_models.cluster_spec import parse_cluster
    from planner.solver.baselines import homogeneous_plan

    profile, _ = llava
    plan = homogeneous_plan(profile, parse_cluster("64xh100-sxm"), 256, "tp=1,pp=1,dp=64,zero=3", predict=False)
    g = plan.groups[0]

    def with_tiers(**tiers):
        return replace(plan, groups=(replace(g, stages=tuple(replace(s, memory=replace(s.memory, **tiers)) for s in g.stages)),))

    optimizer_cpu = with_tiers(optimizer="cpu", grads="cpu")
    assert "--optimizer-cpu-offload" in flags(export_plan(optimizer_cpu, "megatron").text)
    ds = json.loads(export_plan(optimizer_cpu, "deepspeed").text)
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    everything_nvme = with_tiers(params="nvme", grads="nvme", optimizer="nvme")
    ds = json.loads(export_plan(everything_nvme, "deepspeed").text)
    assert ds["zero_optimization"]["offload_param"]["device"] == "nvme" and ds["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    with pytest.raises(Unsupported, match="parameters in nvme memory"):
        export_plan(everything_nvme, "megatron")
    with pytest.raises(Unsupported, match="NVMe tiers"):
        export_plan(everything_nvme, "torchtitan")
    assert "enable_cpu_offload=True" in export_plan(with_tiers(params="cpu", grads="cpu", optimizer="cpu"), "torchtitan").text
    acts = replace(plan, groups=(replace(g, stages=tuple(replace(s, memory=replace(s.memory, activations={b: "offload-nvme" for b in s.blocks}))
                                                          for s in g.stages)),))
    with pytest.raises(Unsupported, match="activation offload"):
        export_plan(acts, "megatron")


def test_megatron_round_trip_gives_back_the_solved_plan(llava, tmp_path):
    """export --to megatron, then solve --from megatron @FILE: the same layout and cut points, the same prediction."""
    profile, d = llava
    plan = load_plan(d / "plan.json")
    (tmp_path / "m.args").write_text(export_plan(plan, "megatron").text)
    again = plan_from("megatron", f"@{tmp_path / 'm.args'}", profile, plan.cluster, plan.training.global_batch)
    assert [(g.dp, g.tp, g.pp, [s.blocks for s in g.stages], [s.ranks for s in g.stages]) for g in again.groups] == \
           [(g.dp, g.tp, g.pp, [s.blocks for s in g.stages], [s.ranks for s in g.stages]) for g in plan.groups]
    assert again.training == plan.training
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s)


def test_megatron_mimo_flags_become_two_groups_on_their_own_ranks(llava):
    from cost_models.cluster_spec import parse_cluster

    profile, _ = llava
    args = ("--encoder-tp 1 --encoder-dp 8 --llm-offset 8 --llm-tp 2 --llm-pp 4 --llm-dp 7 --micro-batch-size 8 "
            "--use-distributed-optimizer --pipeline-model-parallel-layout 'Et*7|t*9|t*9|t*7L' --num-layers 32")
    plan = plan_from("megatron", args, profile, parse_cluster("64xh100-sxm"), 224)
    vision, llm = plan.groups
    assert (vision.dp, vision.tp, vision.pp, vision.ranks) == (8, 1, 1, tuple(range(8)))
    assert (llm.dp, llm.tp, llm.pp, min(llm.ranks)) == (7, 2, 4, 8) and llm.zero == 1
    assert [sum(1 for b in s.blocks if b.startswith("llm.layers.")) for s in llm.stages] == [7, 9, 9, 7]
    assert "vision_proj" in vision.blocks and plan.training.micro_batch == 56


def test_solve_from_megatron_and_deepspeed_on_the_command_line(llava, tmp_path):
    _, d = llava
    out = tmp_path / "mine.json"
    r = runner.invoke(app, ["solve", str(d / "profile.json"), "--cluster", "64xh100-sxm", "--global-batch", "256",
                            "--baseline", "homogeneous", "--from", "megatron",
                            "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --micro-batch-size 2 "
                            "--recompute-activations --hidden-size 4096", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["method"] == "baseline:megatron" and data["groups"][0]["dp"] == 8 and data["micro_batches"] == 16
    r = runner.invoke(app, ["compare", str(d / "plan.json"), str(out), "--json"])
    assert r.exit_code == 0 and len(json.loads(r.stdout)) == 2
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    r = runner.invoke(app, ["solve", str(d / "profile.json"), "--cluster", "64xh100-sxm", "--global-batch", "256",
                            "--from", "deepspeed", str(ds), "-o", str(tmp_path / "ds-plan.json"), "--json"])
    assert r.exit_code == 0, r.output
    g = json.loads(r.stdout)["groups"][0]
    assert (g["dp"], g["tp"], g["pp"], g["zero"]) == (64, 1, 1, 2)


def test_export_command_prints_or_writes(tmp_path):
    plan = EXAMPLES / "tiny-vlm-pp2.json"
    r = runner.invoke(app, ["export", str(plan), "--to", "torchtitan"])
    assert r.exit_code == 0 and r.stdout.startswith("# mmplan plan tiny-vlm-pp2.json")
    out = tmp_path / "ds.json"
    r = runner.invoke(app, ["export", str(plan), "--to", "deepspeed", "-o", str(out), "--lossy"])
    assert r.exit_code == 0 and "dropped: pipeline cut points" in " ".join(r.stdout.split())
    data = json.loads(out.read_text())  # DeepSpeed reads no stage count from the file: the comment says where it goes
    assert "pipeline" not in data and any("PipelineModule(layers, num_stages=2" in c for c in data["comment"])
    r = runner.invoke(app, ["export", str(plan), "--to", "deepspeed", "-o", str(tmp_path / "no.json")])
    assert r.exit_code == 2 and not (tmp_path / "no.json").exists()
    assert r.stderr.count("\n") == 1 and "pipeline cut points" in r.stderr


def test_interleaved_megatron_layout_round_trips(llava):
    """--num-layers-per-virtual-pipeline-stage: 4 chunks per rank, encoders on the first; exported as a layout of
    pp*v entries, read back to the same stages."""
    from cost_models.cluster_spec import parse_cluster

    profile, _ = llava
    cluster = parse_cluster("64xh100-sxm")
    plan = plan_from("megatron", "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2",
                     profile, cluster, 256)
    assert plan.training.schedule == "interleaved" and plan.training.virtual_stages == 4
    assert "vision.layers.23" in plan.groups[0].stages[0].blocks
    layout = flags(export_plan(plan, "megatron").text)["--pipeline-model-parallel-layout"]
    assert [s.count("t") for s in parse_layout_string(layout)] == [2] * 16
    again = plan_from("megatron", export_plan(plan, "megatron").text, profile, cluster, 256)
    assert [s.blocks for s in again.groups[0].stages] == [s.blocks for s in plan.groups[0].stages]


def test_readme_megatron_usage_runs_in_bash_and_passes_values_without_quotes(llava, tmp_path):
    """The README's usage lines, run by bash (not shlex), with torchrun standing in: Megatron gets exactly the file's
    arguments, a quoted layout such as 'Et*4|...L' without its quotes."""
    import subprocess

    from cost_models.cluster_spec import parse_cluster
    from planner.solver.baselines import homogeneous_plan

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [line for line in readme.splitlines() if "MEGATRON_ARGS" in line]
    assert len(lines) == 2 and lines[0].startswith("eval ") and lines[1].startswith("torchrun ")
    profile, _ = llava
    plan = homogeneous_plan(profile, parse_cluster("64xh100-sxm"), 256, "tp=2,pp=4,dp=8", predict=False)
    text = export_plan(plan, "megatron", lossy=True).text
    (tmp_path / "megatron.args").write_text(text)
    script = "torchrun() { printf '%s\\0' \"$@\"; }\n" + "\n".join(lines)
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    got = out[out.index("pretrain_gpt.py") + 1:]
    assert got == shlex.split("\n".join(line for line in text.splitlines() if not line.startswith("#")))
    layout = got[got.index("--pipeline-model-parallel-layout") + 1]
    assert layout.startswith("E") and "'" not in layout and "|" in layout
    assert any(line.startswith("# use: eval \"MEGATRON_ARGS=(") for line in text.splitlines())  # the file says the same


def test_gpt3_175b_megatron_flags_round_trip_with_nothing_dropped_silently(tmp_path):
    """Megatron-LM's examples/pretrain_gpt3_175B.sh (TP 8, PP 16, global batch 1536 on 1024 A100s) through
    `solve --from megatron` and `export --to megatron`: the same parallel flags; every flag the plan has no field for
    is named in its notes, the ones it has (precision, optimizer) are carried."""
    from bench.published_models import gpt_profile
    from cost_models.cluster_spec import parse_cluster

    profile = gpt_profile("gpt-175b", layers=96, dim=12288, heads=96, seq=2048, vocab=51200)
    profile = replace(profile, blocks=tuple(replace(b, group="gpt") for b in profile.blocks))  # one group: the LLM
    published = ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-layers 96 --hidden-size 12288 "
                 "--num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 "
                 "--global-batch-size 1536 --rampup-batch-size 16 16 5859375 --train-samples 146484375 --lr 6.0e-5 "
                 "--min-lr 6.0e-6 --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 "
                 "--adam-beta2 0.95 --init-method-std 0.006 --fp16 --recompute-activations")
    plan = plan_from("megatron", published, profile, parse_cluster("1024xa100-80g"), 1536)
    assert plan.training.dtype == "fp16" and plan.training.optimizer == "adam"
    g = plan.groups[0]
    assert (g.tp, g.pp, g.dp) == (8, 16, 8) and plan.training.micro_batch == 8
    note = plan.solver.notes.split("; not carried (no plan field): ")[1]
    for flag in ("--hidden-size 12288", "--num-attention-heads 96", "--seq-length 2048", "--lr 6.0e-5",
                 "--train-samples 146484375", "--clip-grad 1.0", "--rampup-batch-size 16 16 5859375"):
        assert flag in note
    back = flags(export_plan(plan, "megatron").text)
    given = flags(published)
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                 "--global-batch-size", "--num-layers", "--fp16"):
        assert back[flag] == given[flag], flag
    assert back["--recompute-granularity"] == "selective" and "--use-distributed-optimizer" not in back
    assert [s.count("t") for s in parse_layout_string(back["--pipeline-model-parallel-layout"])] == [6] * 16


def test_deepspeed_round_trip_lists_gradient_clipping(llava, tmp_path):
    profile, _ = llava
    from cost_models.cluster_spec import parse_cluster

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                              "zero_optimization": {"stage": 2, "overlap_comm": True}}))
    plan = plan_from("deepspeed", str(ds), profile, parse_cluster("64xh100-sxm"), 256)
    assert "not carried (no plan field): gradient_clipping=1.0, zero_optimization.overlap_comm=true" in plan.solver.notes
