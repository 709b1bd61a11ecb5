"""Issue 29: eleven plan kinds, each exported to every target and loaded with the target's own code (megatron-core
0.16.1 with Megatron-LM's pinned parser, Megatron-Bridge's pinned MIMO config, torchtitan 0.3.0, DeepSpeed 0.19.8),
checking what each field MEANS there -- the ZeRO stage the target runs, its reshard policy, its activation
checkpointing, its batch count -- and that --lossy lists every semantic change."""
from __future__ import annotations

import dataclasses
import json
import runpy
import shlex
import subprocess
import types
from dataclasses import replace
from pathlib import Path

import pytest

from planner.export import export_plan
from planner.export.common import Unsupported
from plans.plan import load_plan
from tests.planner.test_export_targets import (  # noqa: F401 (fixtures)
    FIXTURES,
    bridge,
    deepspeed_config,
    fake_world,
    filled,
    megatron_lm,
    parse_megatron,
    torchtitan,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "plans" / "examples"
KINDS = {  # plan kind: a homogeneous layout of llava-1.5-7b on 64 H100s (tiers set below), or a solved example
    "homogeneous": "tp=2,pp=4,dp=8",
    "interleaved": "tp=2,pp=4,dp=8,schedule=interleaved:2",
    "zero1": "tp=2,pp=1,dp=32,zero=1",
    "zero2": "tp=2,pp=1,dp=32,zero=2",
    "zero3": "tp=2,pp=1,dp=32,zero=3",
    "zero3-pp": "tp=2,pp=4,dp=8,zero=3",
    "sp-selective": "tp=4,pp=2,dp=8,recompute=selective",  # sequence parallelism set below (the ViT's 577 tokens)
    "full-recompute": "tp=2,pp=2,dp=16,recompute=full",
    "cpu-optimizer": "tp=2,pp=1,dp=32,zero=1",
    "colocated": "llava-1.5-13b-solved-64xh100-sxm",
    "encoder-apart": "vit22b-llama70b-non-colocated-128xh100-sxm",
}


@pytest.fixture(scope="module")
def profiles():
    return build_profiles()


@pytest.fixture(scope="module")
def kinds(profiles):
    return build_kinds(profiles)


def build_profiles() -> dict:
    """The profiles of the eleven kinds' models, by fingerprint (their model shapes go into the Bridge exports)."""
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    return {p.fingerprint: p for p in (profile_model(resolve(m)) for m in ("llava-1.5-7b", "llava-1.5-13b", "vit22b-llama70b"))}


def build_kinds(profiles: dict) -> dict:
    """Each kind's plan (bench/export_matrix.py prints the matrix of these kinds x the targets)."""
    from cost_models.cluster_spec import parse_cluster
    from planner.solver.baselines import homogeneous_plan

    profile = next(p for p in profiles.values() if p.model == "llava-1.5-7b")
    cluster = parse_cluster("64xh100-sxm")
    out = {}
    for kind, spec in KINDS.items():
        if "=" not in spec:
            out[kind] = load_plan(EXAMPLES / f"{spec}.json")
            continue
        plan = homogeneous_plan(profile, cluster, 256, spec, predict=False)
        if kind == "cpu-optimizer":
            g = plan.groups[0]
            stages = tuple(replace(s, memory=replace(s.memory, grads="cpu", optimizer="cpu")) for s in g.stages)
            plan = replace(plan, groups=(replace(g, stages=stages),))
        if kind == "sp-selective":
            plan = replace(plan, groups=tuple(replace(g, sequence_parallel=True) for g in plan.groups))
        out[kind] = plan
    return out


def sequence_parallel(plan) -> bool:
    """Whether the LLM runs sequence parallelism (a target with one setting runs the LLM's; an encoder that differs
    is in the lossy list)."""
    return plan.groups[-1].tp > 1 and plan.groups[-1].sequence_parallel


def layout(plan) -> tuple[int, int, int, int]:
    """(dp, tp, pp, zero) of the LLM group: what a one-layout export runs (for a chain it is every group's)."""
    g = plan.groups[-1]
    return g.dp, g.tp, g.pp, g.zero


def write(tmp_path: Path, plan, target: str, name: str) -> tuple[Path, tuple[str, ...]]:
    result = export_plan(plan, target, lossy=True, source=f"{name}.json")
    path = tmp_path / f"{name}.{target}"
    path.write_text(result.text)
    return path, result.dropped


# --- Megatron-LM ------------------------------------------------------------------------------------------------------


def launch_env(path: Path, monkeypatch) -> None:
    """The environment the export's `# use:` lines set (W1: Megatron FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for line in path.read_text().splitlines():
        if line.startswith("# use: export CUDA_DEVICE_MAX_CONNECTIONS="):
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", line.split("=")[1].split()[0])


def megatron_args(path: Path, hidden: int = 4096, heads: int = 32) -> list[str]:
    """The arguments as bash reads them with the export's own `# use:` lines (eval into an array)."""
    use = [line[len("# use: "):] for line in path.read_text().splitlines() if line.startswith("# use: eval")]
    script = use[0].replace("THIS_FILE", shlex.quote(str(path))) + '; printf "%s\\0" "${MEGATRON_ARGS[@]}"'
    argv = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    return filled(argv) + ["--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--seq-length", "2048",
                   "--max-position-embeddings", "2048"]


def check_megatron_semantics(kind, plan, args, dropped, megatron_lm, mimo: bool) -> None:
    """The ZeRO stage, sequence parallelism, recomputation and optimizer offload Megatron-LM runs are the plan's."""
    dp, tp, pp, zero = layout(plan)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    ran_zero = (2 if args.data_parallel_sharding_strategy == "optim_grads" else 3) if args.use_megatron_fsdp else int(args.use_distributed_optimizer)
    assert ran_zero == max(zero, 1 if mimo else 0)
    config = megatron_lm.arguments.core_transformer_config_from_args(args)
    assert config.sequence_parallel == sequence_parallel(plan)
    if len({g.sequence_parallel for g in plan.groups if g.tp > 1}) > 1:
        assert any("sequence parallelism" in d for d in dropped)
    assert config.recompute_granularity == {"sp-selective": "selective", "full-recompute": "full"}.get(kind)
    assert bool(args.optimizer_cpu_offload) == (kind == "cpu-optimizer")


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_lm_validates_every_kind_and_runs_its_zero_sp_and_recompute(kind, kinds, megatron_lm, tmp_path, monkeypatch):
    plan = kinds[kind]
    path, dropped = write(tmp_path, plan, "megatron", kind)
    text = path.read_text()
    launch_env(path, monkeypatch)
    assert "--encoder-tp" not in text and "for Megatron-LM core_v0.16.1" in text and "pretrain_vlm.py" in text
    from planner.export.common import Drops, nearest_chain

    chain = nearest_chain(plan, Drops("megatron", True))  # one layout: the plan's, or the LLM's (the lossy list says how)
    assert f"torchrun --nnodes {-(-chain.world // 8)} --nproc-per-node 8 " in text  # the ranks the file runs
    monkeypatch.setenv("WORLD_SIZE", str(chain.world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain", *megatron_args(path)])
    args = megatron_lm.arguments.parse_args()
    megatron_lm.arguments.validate_args(args)
    if kind in ("colocated", "encoder-apart"):
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (chain.tp, chain.pp, chain.dp)
        with pytest.raises(Unsupported) as e:
            export_plan(plan, "megatron")
        assert all(d.split(" -> ")[0] in str(e.value) for d in dropped)  # the strict error names every change
        assert ("`--to megatron-mimo`" in str(e.value)) == (kind == "encoder-apart")
    if kind == "colocated":  # W7: the vision group's ZeRO stage changes, said in the file
        vision = plan.group("vision")
        assert vision.zero != chain.zero and any(f"ZeRO-{vision.zero} in group 'vision' -> ZeRO-{chain.zero}" in d
                                                 for d in dropped)
    check_megatron_semantics(kind, plan, args, dropped, megatron_lm, mimo=False)


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_mimo_validates_the_encoder_apart_and_refuses_the_rest(kind, kinds, megatron_lm, tmp_path, monkeypatch):
    """Megatron-LM main's MIMO flags (pinned copy of examples/mimo at d98e8a64dd): the encoder-apart plan through its
    own validate_hetero_grid_args + the stock validate_args on the language grid; every other kind is refused in one
    line naming the target that expresses it."""
    plan = kinds[kind]
    if kind != "encoder-apart":
        with pytest.raises(Unsupported, match="megatron-mimo \\(Megatron-LM main d98e8a64dd") as e:
            export_plan(plan, "megatron-mimo", lossy=True)
        assert ("`--to megatron --lossy`" if kind == "colocated" else "`--to megatron`") in str(e.value)
        return
    path, dropped = write(tmp_path, plan, "megatron-mimo", kind)
    text = path.read_text()
    assert "for Megatron-LM main at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553" in text and "pretrain_mimo" in text
    assert "d98e8a64ddf34856e74b24714e3bedb2f5a39553" in (FIXTURES / "README.md").read_text()  # the pinned copy's commit
    launch_env(path, monkeypatch)
    world = plan.cluster.world_size
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain", *megatron_args(path, 8192, 64)])
    args = megatron_lm.arguments.parse_args(megatron_lm.mimo.add_hetero_grid_args)
    _, llm_n = megatron_lm.mimo.validate_hetero_grid_args(args, world)
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size = args.llm_tp, args.llm_pp, llm_n
    megatron_lm.arguments.validate_args(args, {"dataloader_type": "external"})
    check_megatron_semantics(kind, plan, args, dropped, megatron_lm, mimo=True)


def kinds_apart():
    return load_plan(EXAMPLES / f"{KINDS['encoder-apart']}.json")


def test_megatron_text_only_plan_launches_pretrain_gpt():
    def launch(plan) -> str:
        return next(line for line in export_plan(plan, "megatron", lossy=True).text.splitlines() if line.startswith("# use: torchrun"))

    plan = load_plan(EXAMPLES / "tiny-vlm-pp2.json")
    assert "pretrain_vlm.py" in launch(plan)  # its encoder feeds the LLM as its first stage: one layout
    mimo = next(line for line in export_plan(kinds_apart(), "megatron-mimo", lossy=True).text.splitlines() if line.startswith("# use: torchrun"))
    assert "-m examples.mimo.pretrain_mimo" in mimo  # an encoder on ranks of its own: Megatron-LM main's MIMO example
    llm = replace(plan.groups[-1], stages=tuple(replace(s, blocks=tuple(b for b in s.blocks if b.startswith("llm."))) for s in plan.groups[-1].stages))
    text_only = replace(plan, groups=(llm,))  # only the LLM's blocks (the launch line reads the blocks, nothing else)
    assert "pretrain_gpt.py" in launch(text_only)
    assert f"--nnodes 1 --nproc-per-node {len(llm.ranks)} " in launch(text_only)  # the ranks the plan uses


# --- Megatron-Bridge ----------------------------------------------------------------------------------------------------


def provider_fields() -> dict:
    """GPTModelProvider's own fields and their defaults where they are literals, read from the pinned copy of Bridge's
    gpt_provider.py with ast (the module imports the whole of Bridge, which needs Python >= 3.12)."""
    import ast

    tree = ast.parse((FIXTURES / "megatron_bridge" / "gpt_provider.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPTModelProvider")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            try:
                out[node.target.id] = ast.literal_eval(node.value) if node.value is not None else None
            except ValueError:
                out[node.target.id] = "(not a literal)"
    return out


# A recipe's model, unlike every plan here: GPT-2 small's shape (Radford et al. 2019) on GPTModelProvider's own defaults
RECIPE_SHAPE = dict(num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12, num_query_groups=None,
                    normalization="LayerNorm", gated_linear_unit=False, activation_func="gelu", add_bias_linear=True,
                    vocab_size=50257, seq_length=1024)


def recipe():
    """A ConfigContainer as Bridge's recipes return it: GPTModelProvider's defaults (tied head, learned positions) with
    GPT-2's shape, distributed optimizer, sequence parallelism, recomputation, a virtual pipeline, CPU offload and fp16
    ON, another dataset and tokenizer, so apply() must replace every field the plan or the profile decides (W6)."""
    model = types.SimpleNamespace(**{**provider_fields(), **RECIPE_SHAPE, **dict(
        sequence_parallel=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        virtual_pipeline_model_parallel_size=2, context_parallel_size=2, pipeline_model_parallel_layout="Et|tL", bf16=False, fp16=True)})
    ddp = types.SimpleNamespace(use_distributed_optimizer=True, use_megatron_fsdp=True, data_parallel_sharding_strategy="optim")
    optimizer = types.SimpleNamespace(use_distributed_optimizer=True, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    language = types.SimpleNamespace(**vars(model))
    model.language_model_spec = types.SimpleNamespace(params={"config": language, "vocab_size": 50257, "max_sequence_length": 1024})
    return types.SimpleNamespace(model=model, ddp=ddp, optimizer=optimizer, train=types.SimpleNamespace(),
                                 dataset=types.SimpleNamespace(seq_length=1024, data_path="/recipe/data"), mixed_precision="fp16_mixed",
                                 tokenizer=types.SimpleNamespace(tokenizer_type="NullTokenizer", tokenizer_model=None))


def check_bridge_shape(ns: dict, cfg, config, shape, mimo: bool) -> None:
    """The model's shape after apply(): megatron.core's TransformerConfig (built from the applied fields) has the
    profile's layers, width, heads, MLP and norm; the GPT fields are GPTModel's own arguments (megatron-core 0.16.1's
    signature) or GPTModelProvider's (pinned copy), with the profile's vocabulary, sequence, tie and RoPE base."""
    import inspect

    import torch
    from megatron.core.models.gpt import GPTModel

    assert (config.hidden_size, config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size) == \
           (shape.hidden, shape.heads, shape.kv_heads, shape.ffn)
    assert (config.normalization, config.gated_linear_unit, config.activation_func, config.add_bias_linear) == \
           ("RMSNorm", True, torch.nn.functional.silu, False)  # the LLMs here are llama-like
    gpt_args = set(inspect.signature(GPTModel.__init__).parameters)
    if mimo:
        params = cfg.model.language_model_spec.params
        assert set(ns["language_spec_overrides"]) <= gpt_args
        got = (params["vocab_size"], params["max_sequence_length"], params["share_embeddings_and_output_weights"], params["rotary_base"])
    else:
        provider = provider_fields()
        assert set(ns["model_overrides"]) - {f.name for f in dataclasses.fields(type(config))} <= set(provider)
        assert {"vocab_size", "share_embeddings_and_output_weights", "position_embedding_type", "rotary_base"} <= gpt_args
        got = (cfg.model.vocab_size, cfg.model.seq_length, cfg.model.share_embeddings_and_output_weights, cfg.model.rotary_base)
        assert cfg.dataset.seq_length == shape.sequence and cfg.dataset.data_path == "FILL_ME"
        assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model) == ("FILL_ME", "FILL_ME")
        assert shape.vocab % (cfg.model.make_vocab_size_divisible_by * config.tensor_model_parallel_size) == 0
    assert got == (shape.vocab, shape.sequence, shape.tied, int(shape.rope_base))


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_bridge_apply_sets_every_field_on_a_recipe(kind, kinds, profiles, bridge, tmp_path, monkeypatch):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    plan = kinds[kind]
    profile = profiles[plan.profile.fingerprint]
    result = export_plan(plan, "megatron-bridge", lossy=True, source=f"{kind}.json", profile=profile)
    path, dropped = tmp_path / f"{kind}.py", result.dropped
    path.write_text(result.text)
    assert "Megatron-Bridge main 0.7.0" in result.text
    ns = runpy.run_path(str(path))
    cfg = ns["apply"](recipe())
    mimo = "megatron_mimo_parallelism_config" in ns
    model = cfg.model.language_model_spec.params["config"] if mimo else cfg.model
    dp, tp, pp, zero = layout(plan)
    if mimo:
        ns["megatron_mimo_parallelism_config"].finalize(ns["WORLD_SIZE"])
    tc_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    config = TransformerConfig(**{k: getattr(model, k) for k in ns["model_overrides"] if k in tc_fields})  # the applied values
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (tp, pp)
    assert config.num_layers == sum(1 for g in plan.groups for b in g.blocks if b.startswith("llm.layers."))
    llm = profile.shape(next(b.group for b in profile.blocks if b.name == plan.groups[-1].blocks[-1]))
    check_bridge_shape(ns, cfg, config, llm, mimo)
    ddp = DistributedDataParallelConfig(**vars(cfg.ddp))
    # use_precision_aware_optimizer's check asks for TransformerEngine's version, which this machine has not
    assert getattr(cfg.optimizer, "use_precision_aware_optimizer", False) == (kind == "cpu-optimizer")
    optimizer = OptimizerConfig(**{k: v for k, v in vars(cfg.optimizer).items() if k != "use_precision_aware_optimizer"})
    ran_zero = (2 if ddp.data_parallel_sharding_strategy == "optim_grads" else 3) if ddp.use_megatron_fsdp else int(ddp.use_distributed_optimizer)
    assert ran_zero == zero and optimizer.use_distributed_optimizer == ddp.use_distributed_optimizer  # ZeRO-0 included
    assert config.sequence_parallel == sequence_parallel(plan)
    assert config.recompute_granularity == {"sp-selective": "selective", "full-recompute": "full"}.get(kind)
    assert config.context_parallel_size == 1 and optimizer.optimizer_cpu_offload == (kind == "cpu-optimizer")
    assert (config.bf16, config.fp16, cfg.mixed_precision) == (True, False, "bf16_mixed")  # the recipe's fp16 replaced
    chunked = kind == "interleaved" and not any("interleaved model chunks" in d for d in dropped)
    assert (config.virtual_pipeline_model_parallel_size or 1) == (2 if chunked else 1)
    launch = [line for line in result.text.splitlines() if line.startswith("# note: launch on every node")]
    assert len(launch) == 1 and f"--nproc-per-node 8 " in launch[0] and ("YOUR_MIMO_SCRIPT" if mimo else "THIS_FILE") in launch[0]
    if kind == "colocated":  # the vision group's ZeRO stage becomes the LLM's (the nearest one layout's)
        vision, llm = plan.group("vision"), plan.group("llm")
        assert vision.zero != llm.zero and any(f"ZeRO-{vision.zero} in group 'vision' -> ZeRO-{llm.zero}" in d
                                               for d in dropped)


def test_megatron_bridge_without_a_shape_writes_placeholders_transformer_config_refuses(kinds, bridge, tmp_path):
    from megatron.core.transformer import TransformerConfig

    result = export_plan(kinds["homogeneous"], "megatron-bridge", source="plan.json")  # no profile
    path = tmp_path / "bridge.py"
    path.write_text(result.text)
    ns = runpy.run_path(str(path))
    assert ns["model_overrides"]["hidden_size"] == "FILL_ME" and "no --profile given" in result.text
    cfg = ns["apply"](recipe())
    tc_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    with pytest.raises((TypeError, ValueError)):  # megatron.core refuses the shape until it is filled
        TransformerConfig(**{k: getattr(cfg.model, k) for k in ns["model_overrides"] if k in tc_fields})


def test_megatron_bridge_text_only_plan_trains_the_vanilla_gpt_recipe(kinds, tmp_path):
    """A text-only plan starts from Bridge's vanilla GPT recipe (a bare GPTModelProvider; the pinned copy of
    recipes/gpt/__init__.py exports it) and Bridge's GPT forward step; a VLM's recipe is the user's (FILL_ME)."""
    import ast

    plan = kinds["homogeneous"]
    llm = replace(plan.groups[-1], stages=tuple(replace(s, blocks=tuple(b for b in s.blocks if b.startswith("llm.")))
                                                for s in plan.groups[-1].stages))
    ns = runpy.run_path(str(write_text(tmp_path / "text.py", export_plan(replace(plan, groups=(llm,)), "megatron-bridge").text)))
    module, name = ns["RECIPE"].split(":")
    init = ast.parse((FIXTURES / "megatron_bridge" / "recipes_gpt_init.py").read_text())
    exported = next(ast.literal_eval(n.value) for n in init.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    assert module == "megatron.bridge.recipes.gpt" and name in exported
    assert "from megatron.bridge.training.gpt_step import forward_step" in (tmp_path / "text.py").read_text()
    vlm = runpy.run_path(str(write_text(tmp_path / "vlm.py", export_plan(plan, "megatron-bridge", lossy=True).text)))
    assert vlm["RECIPE"] == "FILL_ME" and "vlm_step import forward_step" in (tmp_path / "vlm.py").read_text()
    with pytest.raises(SystemExit, match="name a Megatron-Bridge recipe function"):  # main() refuses it, Bridge or not
        vlm["main"]()


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_megatron_bridge_lossy_list_says_the_encoder_runs_tp_without_sequence_parallelism():
    """W9: Bridge's ModuleParallelismConfig has no sequence_parallel; the file sets the language model's only."""
    plan = load_plan(EXAMPLES / "vit22b-llama70b-non-colocated-128xh100-sxm.json")
    vision, llm = plan.groups
    assert vision.tp > 1 and not vision.sequence_parallel
    sp = replace(plan, groups=(vision, replace(llm, sequence_parallel=True)))  # vision at tp > 1 without it
    with pytest.raises(Unsupported, match="sequence parallelism off in encoder group 'vision'"):
        export_plan(sp, "megatron-bridge")
    result = export_plan(sp, "megatron-bridge", lossy=True)
    assert any(f"sequence parallelism off in encoder group 'vision' (tp={vision.tp})" in d for d in result.dropped)
    assert "sequence_parallel=True" in result.text


# --- torchtitan ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_torchtitan_apply_sets_reshard_policy_and_activation_checkpointing(kind, kinds, torchtitan, tmp_path):
    import typing

    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, FullAC, SelectiveAC
    from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
    from torchtitan.distributed.parallel_dims import ParallelDims

    plan = kinds[kind]
    path, dropped = write(tmp_path, plan, "torchtitan", kind)
    assert "torchtitan 0.3.0" in path.read_text()
    ns = runpy.run_path(str(path))
    # Trainer.Config's defaults (its module needs triton to import): SelectiveAC, a default ParallelismConfig
    config = ns["apply"](types.SimpleNamespace(parallelism=ParallelismConfig(), training=TrainingConfig(),
                                               activation_checkpoint=SelectiveAC.Config()))
    dims = ParallelDims.from_config(config.parallelism, ns["WORLD_SIZE"])
    ac = config.activation_checkpoint
    # None is the "none" member of torchtitan's ActivationCheckpointingConfig (W3)
    assert any(typing.get_args(a)[0] is type(None) for a in typing.get_args(ActivationCheckpointingConfig))
    recomputes = kind in ("full-recompute", "sp-selective")  # selective: FullAC, listed as dropped
    assert (isinstance(ac, FullAC.Config) if recomputes else ac is None)
    dp, tp, pp, zero = layout(plan)
    zero = {1: 2}.get(zero, zero) if kind != "cpu-optimizer" else 3  # ZeRO-1 -> FSDP; CPU offload -> FSDP2's
    sharded = dims.dp_shard > 1
    assert sharded == (zero > 0)
    if sharded:  # W2: ZeRO-3 reshards after forward with a pipeline too; ZeRO-2 never does
        assert get_fsdp_reshard_after_forward_policy(config.parallelism.fsdp_reshard_after_forward, dims.pp_enabled) == (zero == 3)
    assert config.parallelism.enable_sequence_parallel == sequence_parallel(plan)
    if kind in ("zero1", "cpu-optimizer", "sp-selective"):
        assert dropped
    if dims.pp_enabled and kind != "encoder-apart":
        parts = config.parallelism.module_fqns_per_model_part
        flat = [f for p in parts for f in p]  # torchtitan 0.3.0's Decoder names (interleaved: parts are chunk-major)
        assert flat.count("tok_embeddings") == 1 and parts[-1][-2:] == ["norm", "lm_head"]
        assert sorted(f for f in flat if f.startswith("layers.")) == sorted(f"layers.{i}" for i in range(32))


# --- DeepSpeed ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_deepspeed_config_as_initialize_builds_it(kind, kinds, deepspeed_config, tmp_path, monkeypatch):
    """deepspeed.initialize(model, config=FILE): DeepSpeedConfig(config, mpu) with mpu None (AutoTP, no pipeline; it
    counts every rank) or a PipelineModule's grid (data-parallel ranks) -- W4; no stage count in the file -- W5."""
    import deepspeed.comm

    plan = kinds[kind]
    path, dropped = write(tmp_path, plan, "deepspeed", kind)
    data = json.loads(path.read_text())
    assert "DeepSpeed 0.19.8" in " ".join(data["comment"]) and "pipeline" not in data
    dp, tp, pp, zero = layout(plan)
    if kind in ("colocated", "encoder-apart"):  # the nearest one layout (its changes are in the lossy list)
        from planner.export.common import Drops, nearest_chain

        chain = nearest_chain(plan, Drops("deepspeed", True))
        dp, tp, pp = chain.dp, chain.tp, chain.pp
    world = dp * tp * pp
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda group=None: world)
    from tests.planner.test_export_targets import DataParallel

    ds = deepspeed_config(str(path), mpu=DataParallel(dp) if pp > 1 else None)
    assert ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * dp == plan.training.global_batch
    assert ds.zero_optimization_stage == max(zero, 0) or dropped
    if pp > 1:
        assert any(f"num_stages={pp}" in c for c in data["comment"])


# --- every target: the lossy list is complete, and the strict error names all of it -----------------------------------

TARGETS = ("megatron", "megatron-mimo", "megatron-bridge", "torchtitan", "deepspeed")


def expected_changes(plan, target: str) -> list[str]:
    """The semantic changes a one-layout export must list, derived here from the plan (not with the exporter's code):
    for each group that is not the LLM's, its ZeRO stage and sequence parallelism where they differ from the LLM's."""
    main = plan.groups[-1]
    while main.colocated_with is not None:
        main = plan.group(main.colocated_with)
    out = []
    for g in (g for g in plan.groups if g is not main):
        if g.zero != main.zero:
            out.append(f"ZeRO-{g.zero} in group {g.name!r}")
        if (g.tp > 1 and g.sequence_parallel) != (main.tp > 1 and main.sequence_parallel):
            out.append(f"in group {g.name!r}")  # "sequence parallelism on|off in [encoder ]group 'x'"
    return out


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_lossy_list_is_complete_and_the_strict_error_names_all_of_it(kind, target, kinds):
    plan = kinds[kind]
    try:
        result = export_plan(plan, target, lossy=True)
    except Unsupported as e:  # megatron-mimo: a plan its flags cannot hold, refused whatever --lossy says
        assert target == "megatron-mimo" and kind != "encoder-apart" and "\n" not in str(e)
        return
    mimo = target == "megatron-mimo" or (target == "megatron-bridge" and kind == "encoder-apart")
    # MIMO: one ZeRO stage for every module; a group at ZeRO 0 is named as that (the distributed optimizer is required)
    zeros = {g.zero for g in plan.groups}
    want = [(c,) for c in expected_changes(plan, target)] if not mimo else (
        [("different ZeRO stages per group", "ZeRO stage 0")] if len(zeros) > 1 else [])
    for alternatives in want:
        assert any(c in d for c in alternatives for d in result.dropped), (alternatives, result.dropped)
    if result.dropped:
        with pytest.raises(Unsupported) as e:
            export_plan(plan, target)
        assert "\n" not in str(e.value) and all(d.split(" -> ")[0] in str(e.value) for d in result.dropped)
        assert all(d in result.text or json.dumps(d)[1:-1] in result.text for d in result.dropped)  # and the file says so
    else:
        assert export_plan(plan, target).text == result.text  # exact: the strict export is the same file
