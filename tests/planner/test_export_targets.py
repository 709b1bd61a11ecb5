"""Every exporter checked by the target's own code: Megatron-LM's argument parser and MIMO grid flags, Megatron-Bridge's
MIMO parallelism config, megatron-core's TransformerConfig / HyperCommGrid, torchtitan's ParallelismConfig /
ParallelDims / device mesh, DeepSpeed's DeepSpeedConfig -- on solved plans for llava-1.5-7b (64 H100) and
qwen2-vl-72b (1024 H100) and on heterogeneous ones. The packages come with `pip install -e ".[export]"`; Megatron-LM's
parser and Megatron-Bridge's config are pinned copies under tests/fixtures/ (see its README)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import runpy
import shlex
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
MUST_SHOW = ("llava-1.5-7b", "qwen2-vl-72b")  # solved with `mmplan solve`, exported to all four targets
MIMO = ("llava-1.5-7b-apart", "qwen2-vl-72b-mimo")  # an encoder on its own ranks
MODEL_FLAGS = {  # what a user's launch script adds: the model's shape (the export carries the layout)
    "llava-1.5-7b": "--hidden-size 4096 --num-attention-heads 32",
    "llava-1.5-7b-apart": "--hidden-size 4096 --num-attention-heads 32",
    "qwen2-vl-72b": "--hidden-size 8192 --num-attention-heads 64",
    "qwen2-vl-72b-mimo": "--hidden-size 8192 --num-attention-heads 64",
}
runner = CliRunner()


def cli(*args) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output + (r.stderr if r.stderr_bytes else "")
    return r.stdout


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """Solved plans: the two of the issue (qwen's micro-batch given, so the search takes seconds; it finds the plan
    the unrestricted search finds), llava non-colocated, and a qwen2-vl-72b plan with the ViT on 128 GPUs (tp 4) and
    the LLM on 896 (tp 8, 7 uneven stages), given as Megatron-LM MIMO flags."""
    from planner.profiler.profile import profile_model
    from plans.graph import save_profile
    from runtime.source import resolve

    d = tmp_path_factory.mktemp("export-plans")
    for model in MUST_SHOW:
        save_profile(profile_model(resolve(model)), d / f"{model}.profile.json")
    # solved with ZeRO 0 only and no baselines: with ZeRO 0-3 searched the solver's best plans for these are unpipelined ZeRO layouts,
    # and what this file tests is that each target reads back every degree and cut point of a pipeline
    from cost_models.cluster_spec import parse_cluster
    from planner.solver.solve import solve
    from plans.graph import load_profile
    from plans.plan import save_plan

    out = {}
    for name, (model, cluster, batch, micro_batch) in {"llava-1.5-7b": ("llava-1.5-7b", "64xh100-sxm", 256, None),
                                                        "qwen2-vl-72b": ("qwen2-vl-72b", "1024xh100-sxm", 1024, 32)}.items():
        out[name] = d / f"{name}.json"
        got = solve(load_profile(d / f"{model}.profile.json"), parse_cluster(cluster), batch, micro_batch=micro_batch,
                    zeros=(0,), baseline=False, sequence_parallel=(False,), per_group_micro_batches=False)  # the
        # solver's own 1f1b plan (the Megatron baseline may interleave; with sequence parallelism the best llava plan is
        # colocated, and a per-group micro-batch count, which the refinement finds for llava, no target expresses)
        save_plan(got.plan, out[name])
    # llava apart: the best non-colocated plan itself (solve would emit the homogeneous baseline whenever that
    # predicts faster, which depends on the cost model's figures, not on what this file tests)
    out["llava-1.5-7b-apart"] = d / "llava-1.5-7b-apart.json"
    apart = solve(load_profile(d / "llava-1.5-7b.profile.json"), parse_cluster("64xh100-sxm"), 256,
                  placement="non-colocated", baseline=False, zeros=(0,), sequence_parallel=(False,))
    save_plan(apart.plan, out["llava-1.5-7b-apart"])
    out["qwen2-vl-72b-mimo"] = d / "qwen2-vl-72b-mimo.json"
    cli("solve", d / "qwen2-vl-72b.profile.json", "--cluster", "1024xh100-sxm", "--global-batch", 1024, "--from", "megatron",
        "--encoder-tp 4 --encoder-dp 32 --llm-offset 128 --llm-tp 8 --llm-pp 7 --llm-dp 16 --micro-batch-size 2 "
        "--use-distributed-optimizer --pipeline-model-parallel-layout 'Et*11|t*12|t*12|t*12|t*11|t*11|t*11L'",
        "-o", out["qwen2-vl-72b-mimo"])
    return out


def export(plan: Path, target: str, tmp: Path, *, lossy: bool = False, profile: bool = False) -> Path:
    """`mmplan export`; with `profile`, the plan's profile (its model's shape) too."""
    out = tmp / f"{plan.stem}.{target}"
    model = plan.stem.removesuffix("-apart").removesuffix("-mimo")
    cli("export", plan, "--to", target, "-o", out, *(["--lossy"] if lossy else []),
        *(["--profile", plan.parent / f"{model}.profile.json"] if profile else []))
    return out


# --- what the plan says, computed here (not with the exporter's code) ----------------------------------------------

LLM_LAYER = re.compile(r"^llm\.layers\.\d+$")


def pipeline(plan_path: Path) -> list[dict]:
    """The plan as a list of pipelines, encoder(s) first: per group dp, tp, stage ranks, LLM layers per stage."""
    plan = load_plan(plan_path)
    return [{"name": g.name, "dp": g.dp, "tp": g.tp, "pp": g.pp, "zero": g.zero, "ranks": [list(s.ranks) for s in g.stages],
             "layers": [sum(1 for b in s.blocks if LLM_LAYER.match(b)) for s in g.stages],
             "blocks": [list(s.blocks) for s in g.stages]} for g in plan.groups]


def as_chain(plan_path: Path) -> dict:
    """A plan whose groups form one pipeline, as one group (stages in data-flow order, ranks relaid from 0)."""
    groups = pipeline(plan_path)
    stages = [s for g in groups for s in zip(g["ranks"], g["layers"], g["blocks"])]
    per = groups[0]["dp"] * groups[0]["tp"]
    return {"dp": groups[0]["dp"], "tp": groups[0]["tp"], "pp": len(stages), "zero": groups[0]["zero"],
            "ranks": [list(range(i * per, (i + 1) * per)) for i in range(len(stages))],
            "layers": [s[1] for s in stages], "blocks": [s[2] for s in stages]}


def grid_stage_ranks(tp: int, dp: int, pp: int, offset: int, world: int, monkeypatch) -> tuple[list, list]:
    """megatron-core's HyperCommGrid as Megatron-LM's MIMO topology and Megatron-Bridge's build_hypercomm_grids
    build it ([tp, cp, dp, pp] from rank_offset): the ranks of each pipeline stage, and the tensor-parallel groups."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", str(world))  # HyperCommGrid's mock-testing path: no process group needed
    grid = HyperCommGrid(shape=[tp, 1, dp, pp], dim_names=["tp", "cp", "dp", "pp"], rank_offset=offset)
    pp_groups = grid.get_rank_enum("pp")  # each: one rank per stage
    stages = [sorted(g[i] for g in pp_groups) for i in range(pp)]
    return stages, sorted(grid.get_rank_enum("tp"))


# --- Megatron-LM: its argument parser (pinned copy, core_v0.16.1) on megatron-core 0.16.1 --------------------------


@pytest.fixture(scope="module")
def megatron_lm():
    pytest.importorskip("megatron.core", reason="megatron-core is installed by the [export] extra")
    sys.path.insert(0, str(FIXTURES / "megatron_lm"))
    sys.path.insert(0, str(FIXTURES / "megatron_lm" / "mimo"))
    try:
        from megatron.training import arguments

        spec = importlib.util.spec_from_file_location("megatron_lm_mimo_args", FIXTURES / "megatron_lm" / "mimo" / "args.py")
        mimo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mimo)
        yield types.SimpleNamespace(arguments=arguments, mimo=mimo)
    finally:
        for p in (FIXTURES / "megatron_lm", FIXTURES / "megatron_lm" / "mimo"):
            sys.path.remove(str(p))


def megatron_argv(path: Path, model: str) -> list[str]:
    text = "\n".join(line for line in path.read_text().splitlines() if not line.startswith("#"))
    return shlex.split(text) + shlex.split(MODEL_FLAGS[model]) + ["--seq-length", "2048", "--max-position-embeddings", "2048"]


# What a user writes over the export's FILL_ME placeholders (tokenizer, data, training length; a shape the profile lacks)
STAND_INS = {"--tokenizer-type": "NullTokenizer", "--vocab-size": "32000", "--train-iters": "10", "--lr": "1e-4",
             "--normalization": "RMSNorm", "--position-embedding-type": "learned_absolute", "--hidden-size": "4096",
             "--ffn-hidden-size": "11008", "--num-attention-heads": "32", "--seq-length": "2048",
             "--decoder-seq-length": "2048", "--max-position-embeddings": "2048"}


def filled(argv: list[str]) -> list[str]:
    """The arguments with every FILL_ME placeholder filled as a user would (a value of the flag's type)."""
    return [STAND_INS.get(argv[i - 1], "/data/prefix") if a == "FILL_ME" else a for i, a in enumerate(argv)]


def parse_megatron(m, argv: list[str], world: int, monkeypatch, extra=None):
    argv = filled(argv)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as the export's comment asks, with tensor parallelism
    monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
    return m.arguments.parse_args(extra)


def test_a_solved_plan_of_the_file_is_pipelined(plans):
    """The cut-point checks below run on a solved plan with pipeline stages (at least one of MUST_SHOW's)."""
    assert any(as_chain(plans[name])["pp"] > 1 for name in MUST_SHOW)


def decoder_layers(config) -> list[int]:
    from megatron.core.transformer.enums import LayerType

    layout = config.pipeline_model_parallel_layout
    if layout is None:  # one pipeline stage: Megatron takes no layout
        return [config.num_layers]
    return [row[0].count(LayerType.decoder) for row in layout.layout]


@pytest.mark.parametrize("name", MUST_SHOW)
def test_megatron_lm_parser_agrees_on_every_degree_and_cut_point(name, megatron_lm, plans, tmp_path, monkeypatch):
    path = export(plans[name], "megatron", tmp_path)
    assert path.read_text().startswith(f"# mmplan plan {plans[name].name}: {name}")
    want = as_chain(plans[name])
    world = load_plan(plans[name]).cluster.world_size
    args = parse_megatron(megatron_lm, megatron_argv(path, name), world, monkeypatch)
    megatron_lm.arguments.validate_args(args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == \
           (want["tp"], want["pp"], want["dp"])
    plan = load_plan(plans[name])
    assert args.micro_batch_size * args.data_parallel_size == plan.training.micro_batch
    assert args.global_batch_size == plan.training.global_batch
    config = megatron_lm.arguments.core_transformer_config_from_args(args)  # parses and validates the layout
    assert decoder_layers(config) == want["layers"]
    assert config.sequence_parallel == any(g.sequence_parallel for g in plan.groups if g.tp > 1)
    stages, tp_groups = grid_stage_ranks(want["tp"], want["dp"], want["pp"], 0, world, monkeypatch)
    assert stages == want["ranks"]
    assert tp_groups == sorted(r[i:i + want["tp"]] for r in want["ranks"] for i in range(0, len(r), want["tp"]))


@pytest.mark.parametrize("name", MIMO)
def test_megatron_lm_mimo_flags_agree_on_grids_and_rank_offsets(name, megatron_lm, plans, tmp_path, monkeypatch):
    # the solved plan has ZeRO 0: hetero MIMO training requires the distributed optimizer, the one thing --lossy drops
    path = export(plans[name], "megatron-mimo", tmp_path, lossy=load_plan(plans[name]).groups[0].zero == 0)
    assert "--use-distributed-optimizer" in path.read_text()
    enc, llm = pipeline(plans[name])
    world = sum(len(r) for g in (enc, llm) for r in g["ranks"])
    args = parse_megatron(megatron_lm, megatron_argv(path, name), world, monkeypatch, megatron_lm.mimo.add_hetero_grid_args)
    enc_n, llm_n = megatron_lm.mimo.validate_hetero_grid_args(args, world)
    specs = megatron_lm.mimo.build_module_grid_specs(args, world, enc["name"])
    # then as examples/mimo/pretrain_mimo.py: the stock checks on the language grid
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = args.llm_tp, args.llm_pp
    args.world_size = llm_n
    megatron_lm.arguments.validate_args(args, {"dataloader_type": "external"})
    assert args.use_distributed_optimizer and args.data_parallel_size == llm["dp"]
    by_name = {s.name: s for s in specs}
    e, l = by_name[enc["name"]], by_name["language"]
    assert (e.num_ranks, e.tp, e.dp, e.pp, e.rank_offset) == (enc_n, enc["tp"], enc["dp"], 1, 0)
    assert (l.num_ranks, l.tp, l.dp, l.pp, l.rank_offset) == (llm_n, llm["tp"], llm["dp"], llm["pp"], enc_n)
    config = megatron_lm.arguments.core_transformer_config_from_args(args)
    assert decoder_layers(config) == llm["layers"]
    for g, spec in ((enc, e), (llm, l)):  # the plan's ranks, renumbered so the encoder comes first
        base = min(r for s in g["ranks"] for r in s)
        want = [[spec.rank_offset + r - base for r in s] for s in g["ranks"]]
        stages, _ = grid_stage_ranks(spec.tp, spec.dp, spec.pp, spec.rank_offset, world, monkeypatch)
        assert stages == [sorted(s) for s in want]


# --- Megatron-Bridge: MegatronMIMOParallelismConfig (pinned copy of main); megatron-core configs ----------------------


@pytest.fixture
def bridge(monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core is installed by the [export] extra")
    spec = importlib.util.spec_from_file_location("megatron.bridge.models.megatron_mimo.megatron_mimo_config",
                                                  FIXTURES / "megatron_bridge" / "megatron_mimo_config.py")
    module = importlib.util.module_from_spec(spec)
    for name in ("megatron.bridge", "megatron.bridge.models", "megatron.bridge.models.megatron_mimo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def check_core_fields(ns: dict, num_layers: int, tp: int, pp: int, heads: int):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    fields = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, **ns["model_overrides"]}
    core = {f.name for f in dataclasses.fields(TransformerConfig)}  # the rest are the GPT model's (vocabulary, sequence, ...)
    config = TransformerConfig(**{k: v for k, v in fields.items() if k in core})
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (num_layers, heads * 128, heads)
    DistributedDataParallelConfig(**ns["ddp_overrides"])
    OptimizerConfig(**ns["optimizer_overrides"])
    return config


@pytest.mark.parametrize("name", MUST_SHOW)
def test_megatron_bridge_one_layout_builds_megatron_core_configs(name, bridge, plans, tmp_path):
    path = export(plans[name], "megatron-bridge", tmp_path, profile=True)
    ns = runpy.run_path(str(path))
    want = as_chain(plans[name])
    overrides = ns["model_overrides"]
    assert (overrides["tensor_model_parallel_size"], overrides["pipeline_model_parallel_size"]) == (want["tp"], want["pp"])
    assert ns["WORLD_SIZE"] // (want["tp"] * want["pp"]) == want["dp"]
    config = check_core_fields(ns, sum(want["layers"]), want["tp"], want["pp"], {"llava-1.5-7b": 32, "qwen2-vl-72b": 64}[name])
    assert decoder_layers(config) == want["layers"]
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(), ddp=types.SimpleNamespace(), optimizer=types.SimpleNamespace(),
                                train=types.SimpleNamespace(), dataset=types.SimpleNamespace(), tokenizer=types.SimpleNamespace())
    ns["apply"](cfg)
    assert cfg.model.pipeline_model_parallel_size == want["pp"] and cfg.train.global_batch_size == load_plan(plans[name]).training.global_batch


@pytest.mark.parametrize("name", MIMO)
def test_megatron_bridge_mimo_config_finalizes_with_the_plans_rank_offsets(name, bridge, plans, tmp_path, monkeypatch):
    path = export(plans[name], "megatron-bridge", tmp_path, profile=True)  # exact: Bridge takes any rank_offset and ZeRO stage
    ns = runpy.run_path(str(path))
    config = ns["megatron_mimo_parallelism_config"]
    assert isinstance(config, bridge.MegatronMIMOParallelismConfig)
    config.finalize(ns["WORLD_SIZE"])
    groups = pipeline(plans[name])
    for g in groups:
        p = config.module_parallelisms["language" if g is groups[-1] else g["name"]]
        offset = min(r for s in g["ranks"] for r in s)
        assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size, p.rank_offset) == \
               (g["tp"], g["pp"], g["dp"], offset)
        stages, _ = grid_stage_ranks(g["tp"], g["dp"], g["pp"], offset, ns["WORLD_SIZE"], monkeypatch)
        assert stages == [sorted(s) for s in g["ranks"]]
    llm = groups[-1]
    config = check_core_fields(ns, sum(llm["layers"]), llm["tp"], llm["pp"], 32 if name.startswith("llava") else 64)
    assert decoder_layers(config) == llm["layers"]


# --- torchtitan: ParallelismConfig, ParallelDims and the device mesh it builds ---------------------------------------


@pytest.fixture(scope="module")
def torchtitan():
    return pytest.importorskip("torchtitan", reason="torchtitan is installed by the [export] extra")


@contextmanager
def fake_world(world: int):
    """A process group of `world` ranks that does nothing (torch's fake backend), this process being rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", MUST_SHOW + ("llava-1.5-7b-apart",))
def test_torchtitan_parallel_dims_and_mesh_agree(name, torchtitan, plans, tmp_path):
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

    path = export(plans[name], "torchtitan", tmp_path)  # llava apart: a chain (vision stage, then 7 LLM stages)
    ns = runpy.run_path(str(path))
    want = as_chain(plans[name])
    cfg = ns["parallelism"]
    assert isinstance(cfg, ParallelismConfig)
    dims = ParallelDims.from_config(cfg, ns["WORLD_SIZE"])
    assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp) == (want["dp"], want["tp"], want["pp"])
    # torchtitan 0.3.0's Decoder names for the LLM's blocks (models/common/decoder.py); encoders keep mmplan's
    titan = {"llm.embed": "tok_embeddings", "llm.norm": "norm", "llm.head": "lm_head"}
    parts = [[titan.get(b, b[len("llm."):] if LLM_LAYER.match(b) else b) for b in s] for s in want["blocks"]]
    assert cfg.module_fqns_per_model_part == (parts if want["pp"] > 1 else None)  # one stage: torchtitan takes none
    plan = load_plan(plans[name])
    if want["pp"] > 1:  # the pipeline splits each rank's local batch into its micro-batches
        assert cfg.pipeline_parallel_microbatch_size * want["dp"] == plan.training.micro_batch
        assert ns["training"]["local_batch_size"] * want["dp"] == plan.training.global_batch
    else:  # one stage: a local batch per micro-batch, gradient accumulation up to the global batch
        assert ns["training"]["local_batch_size"] * want["dp"] == plan.training.micro_batch
        assert ns["training"]["global_batch_size"] == plan.training.global_batch
    with fake_world(ns["WORLD_SIZE"]):
        dims.build_mesh()
        if want["pp"] > 1:
            assert dims.get_mesh("pp").mesh.tolist() == [s[0] for s in want["ranks"]]  # rank 0's peers in later stages
        if want["tp"] > 1:
            assert dims.get_mesh("tp").mesh.tolist() == want["ranks"][0][:want["tp"]]


# --- DeepSpeed: DeepSpeedConfig reads the file ------------------------------------------------------------------------


class DataParallel:
    """The mpu DeepSpeedConfig asks for the data-parallel size (world / (tp * pp))."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture
def deepspeed_config(monkeypatch):
    pytest.importorskip("deepspeed", reason="deepspeed is installed by the [export] extra")
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeedConfig asks the communication backend for this rank and the mpu for the data-parallel size. A rank
    # stand-in instead of deepspeed.comm.init_distributed, which compiles a C++ shared-memory op on CPU (minutes).
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    return DeepSpeedConfig


def load_ds(DeepSpeedConfig, path: Path, dp: int):
    return DeepSpeedConfig(str(path), mpu=DataParallel(dp))


@pytest.mark.parametrize("name", MUST_SHOW)
def test_deepspeed_config_accepts_the_export(name, deepspeed_config, plans, tmp_path):
    # pipeline cut points are what ds_config.json cannot hold: dropped with --lossy, and said so
    path = export(plans[name], "deepspeed", tmp_path, lossy=True)
    data = json.loads(path.read_text())
    want = as_chain(plans[name])
    assert data["comment"][0].startswith(f"mmplan plan {plans[name].name}: {name}")
    assert want["pp"] == 1 or any("pipeline cut points" in c for c in data["comment"])
    plan = load_plan(plans[name])
    counted = want["dp"] * (want["tp"] if want["pp"] == 1 else 1)  # AutoTP, launched without an mpu, counts every rank
    ds = load_ds(deepspeed_config, path, counted)
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == \
           (plan.training.global_batch * counted // want["dp"], plan.training.micro_batch // want["dp"], plan.training.micro_batches)
    assert ds.zero_optimization_stage == want["zero"] and "pipeline" not in data  # DeepSpeed reads no stage count from it
    assert want["pp"] == 1 or any(f"num_stages={want['pp']}" in c for c in data["comment"])
    assert ds.bfloat16_config.enabled
    if want["tp"] > 1:
        assert ds.tensor_parallel_config.autotp_size == want["tp"]


def test_deepspeed_round_trip_of_zero3_with_nvme_offload(deepspeed_config, plans, tmp_path):
    """A hand-written ZeRO-Infinity config -> `mmplan solve --from deepspeed` -> `mmplan export --to deepspeed`:
    DeepSpeed reads the same ZeRO stage, offload devices and batch sizes back (exact, no --lossy)."""
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
                                                      "offload_optimizer": {"device": "cpu"}}}))
    profile = plans["llava-1.5-7b"].parent / "llava-1.5-7b.profile.json"
    plan = tmp_path / "from-ds.json"
    cli("solve", profile, "--cluster", "64xh100-sxm", "--global-batch", 256, "--baseline", "homogeneous",
        "--from", "deepspeed", mine, "-o", plan)
    stage = load_plan(plan).groups[0].stages[0].memory
    assert (stage.params, stage.grads, stage.optimizer) == ("nvme", "cpu", "cpu")
    ds = load_ds(deepspeed_config, export(plan, "deepspeed", tmp_path), 64)
    assert ds.zero_optimization_stage == 3 and (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (2, 2)
    assert (str(ds.zero_config.offload_param.device), str(ds.zero_config.offload_optimizer.device)) in \
           {("nvme", "cpu"), ("OffloadDeviceEnum.nvme", "OffloadDeviceEnum.cpu")}


def test_sequence_parallelism_reaches_megatron_and_bridge_and_comes_back(megatron_lm, plans, tmp_path, monkeypatch):
    """A sequence-parallel plan exports --sequence-parallel (Megatron-LM) / sequence_parallel=True (Bridge's
    TransformerConfig) and `solve --from megatron` reads it back; the exporters used to drop it silently."""
    from dataclasses import replace

    from plans.plan import save_plan

    plan = load_plan(plans["qwen2-vl-72b"])
    assert any(g.tp > 1 for g in plan.groups)
    sp = tmp_path / "sp.json"
    save_plan(replace(plan, groups=tuple(replace(g, sequence_parallel=g.tp > 1) for g in plan.groups)), sp)
    path = export(sp, "megatron", tmp_path)
    args = parse_megatron(megatron_lm, megatron_argv(path, "qwen2-vl-72b"), plan.cluster.world_size, monkeypatch)
    megatron_lm.arguments.validate_args(args)
    assert args.sequence_parallel
    assert "sequence_parallel=True" in export(sp, "megatron-bridge", tmp_path).read_text()
    assert "--sequence-parallel" not in export(plans["qwen2-vl-72b"], "megatron", tmp_path).read_text()
    back = tmp_path / "back.json"
    cli("solve", plans["qwen2-vl-72b"].parent / "qwen2-vl-72b.profile.json", "--cluster", plan.cluster.name,
        "--global-batch", plan.training.global_batch, "--baseline", "homogeneous", "--from", "megatron", f"@{path}", "-o", back)
    assert all(g.sequence_parallel for g in load_plan(back).groups if g.tp > 1)
