"""Issue 29 item 3: a launchable file. The profile records each group's transformer shape from the real model; the
export writes it as the target's model flags (checked by Megatron-LM's own parse_args + validate_args, torchtitan's
own Llama3Model built on the meta device), a torchrun line for the plan's nodes, and FILL_ME placeholders the targets
refuse until filled (tokenizer, data, training length; a shape an older profile lacks)."""
from __future__ import annotations

import json
import runpy
import shlex
import sys
import types
import unittest.mock
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans.graph import save_profile
from plans.plan import save_plan
from tests.planner.test_export_targets import (  # noqa: F401 (fixtures)
    deepspeed_config,
    filled,
    megatron_lm,
    torchtitan,
)

runner = CliRunner()
LLAVA_LLM = dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, sequence=2048, tied=False,
                 norm="rmsnorm", mlp="swiglu", position="rope", bias="no", rope_base=10000.0)  # LLaMA-2-7B / Vicuna-7B, 576 + 1472 tokens
LLAVA_VISION = dict(layers=24, hidden=1024, heads=16, kv_heads=16, ffn=4096, sequence=577, norm="layernorm", mlp="gelu")


def export(plan: Path, target: str, tmp: Path, *extra) -> Path:
    out = tmp / f"{plan.stem}.{target}"
    r = runner.invoke(app, ["export", str(plan), "--to", target, "-o", str(out), *map(str, extra)])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """llava-1.5-7b's profile, and a tp 2 x pp 4 x dp 8 plan of it on 64 H100s (8 nodes)."""
    from cost_models.cluster_spec import parse_cluster
    from planner.profiler.profile import profile_model
    from planner.solver.baselines import homogeneous_plan
    from runtime.source import resolve

    d = tmp_path_factory.mktemp("launch")
    profile = profile_model(resolve("llava-1.5-7b"))
    save_profile(profile, d / "llava.profile.json")
    plan = homogeneous_plan(profile, parse_cluster("64xh100-sxm"), 256, "tp=2,pp=4,dp=8", predict=False)
    save_plan(plan, d / "llava.json")
    return profile, d / "llava.profile.json", d / "llava.json"


def test_profile_records_the_models_shape(llava):
    profile, _, _ = llava
    shapes = {s.group: s for s in profile.shapes}
    assert {k: getattr(shapes["llm"], k) for k in LLAVA_LLM} == LLAVA_LLM
    assert {k: getattr(shapes["vision"], k) for k in LLAVA_VISION} == LLAVA_VISION and shapes["vision"].vocab == 0


def parse(m, path: Path, monkeypatch, fill: bool):
    argv = shlex.split("\n".join(line for line in path.read_text().splitlines() if not line.startswith("#")))
    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # --no-rope-fusion: RoPE's fused kernel is TransformerEngine's, absent on this host (a GPU install keeps it on)
    monkeypatch.setattr(sys, "argv", ["pretrain", *(filled(argv) if fill else argv), "--no-rope-fusion"])
    args = m.arguments.parse_args()
    m.arguments.validate_args(args)
    return args


def test_megatron_shape_flags_pass_the_real_parser_and_match_the_model(llava, megatron_lm, tmp_path, monkeypatch):
    _, profile, plan = llava
    path = export(plan, "megatron", tmp_path, "--lossy", "--profile", profile)  # lossy: encoders on Megatron's first stage
    text = path.read_text()
    with pytest.raises(SystemExit):  # as exported: --tokenizer-type FILL_ME is no tokenizer Megatron-LM knows
        parse(megatron_lm, path, monkeypatch, fill=False)
    args = parse(megatron_lm, path, monkeypatch, fill=True)  # tokenizer, data, iterations and lr filled: nothing else
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (32, 4096, 32, 11008)
    assert not args.group_query_attention and args.untie_embeddings_and_output_weights
    assert (args.decoder_seq_length, args.seq_length, args.max_position_embeddings) == (2048, 577, 2048)
    assert (args.normalization, args.swiglu, args.position_embedding_type, args.add_bias_linear) == ("RMSNorm", True, "rope", False)
    assert args.rotary_base == 10000 and "--rotary-base 10000" in text  # the zoo attention's own base
    assert 32000 % (args.make_vocab_size_divisible_by * args.tensor_model_parallel_size) == 0  # padding keeps 32000 rows
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (2, 4, 8)
    config = megatron_lm.arguments.core_transformer_config_from_args(args)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size, config.gated_linear_unit) == (32, 4096, 11008, True)
    use = [line for line in text.splitlines() if line.startswith("# use: torchrun")]
    assert len(use) == 1 and "--nnodes 8 --nproc-per-node 8 " in use[0] and "pretrain_vlm.py" in use[0]
    assert "vision: 24 layers, hidden 1024, 16 heads" in text  # the encoder's shape, for the user's model provider


@pytest.mark.parametrize("how", ["no --profile", "an older profile"])
def test_megatron_without_a_shape_writes_placeholders_the_parser_refuses(how, llava, megatron_lm, tmp_path, monkeypatch):
    _, profile, plan = llava
    extra = []
    if how == "an older profile":  # one written before profiles recorded the shape: still valid, no shapes
        data = json.loads(profile.read_text())
        del data["shapes"]
        (tmp_path / "old.json").write_text(json.dumps(data))
        extra = ["--profile", tmp_path / "old.json"]
    path = export(plan, "megatron", tmp_path, "--lossy", *extra)
    text = path.read_text()
    assert "--hidden-size FILL_ME" in text and "--num-attention-heads FILL_ME" in text
    assert ("no --profile given" if not extra else "records no model shape") in text
    monkeypatch.setenv("WORLD_SIZE", "64")
    with pytest.raises(SystemExit):
        parse(megatron_lm, path, monkeypatch, fill=False)
    args = parse(megatron_lm, path, monkeypatch, fill=True)
    assert args.hidden_size == 4096 and args.num_layers == 32  # the layer count is the plan's own


def test_megatron_grouped_query_attention_and_tied_embeddings(megatron_lm, tmp_path, monkeypatch):
    """tiny-vlm-tied: 4 heads over 2 kv heads, the head tied to the embedding."""
    from cost_models.cluster_spec import parse_cluster
    from planner.profiler.profile import profile_model
    from planner.solver.baselines import homogeneous_plan
    from runtime.source import resolve

    profile = profile_model(resolve("tiny-vlm-tied"))
    save_profile(profile, tmp_path / "tied.profile.json")
    save_plan(homogeneous_plan(profile, parse_cluster("8xh100-sxm"), 16, "tp=2,pp=1,dp=4", predict=False), tmp_path / "tied.json")
    path = export(tmp_path / "tied.json", "megatron", tmp_path, "--lossy", "--profile", tmp_path / "tied.profile.json")
    monkeypatch.setenv("WORLD_SIZE", "8")
    argv = filled(shlex.split("\n".join(line for line in path.read_text().splitlines() if not line.startswith("#"))))
    monkeypatch.setattr(sys, "argv", ["pretrain", *argv, "--no-rope-fusion"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = megatron_lm.arguments.parse_args()
    megatron_lm.arguments.validate_args(args)
    assert (args.num_attention_heads, args.group_query_attention, args.num_query_groups) == (4, True, 2)
    assert not args.untie_embeddings_and_output_weights and (args.hidden_size, args.ffn_hidden_size) == (64, 128)
    assert "torchrun --nnodes 1 --nproc-per-node 8 pretrain_vlm.py" in path.read_text()


def test_export_refuses_another_models_profile(llava, tmp_path):
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    save_profile(profile_model(resolve("tiny-vlm")), tmp_path / "other.json")
    _, _, plan = llava
    r = runner.invoke(app, ["export", str(plan), "--to", "megatron", "--profile", str(tmp_path / "other.json")])
    assert r.exit_code != 0 and "another model" in r.output


@pytest.fixture
def titan_models(torchtitan, monkeypatch):
    """torchtitan's model packages import its minimal_async_ep (triton kernels, absent on a CPU host): a stand-in."""
    stub = types.ModuleType("torchtitan.distributed.minimal_async_ep")
    stub.__getattr__ = lambda name: unittest.mock.MagicMock(name=name)
    monkeypatch.setitem(sys.modules, stub.__name__, stub)


def test_torchtitan_model_config_is_the_profiled_llm(llava, titan_models, tmp_path):
    import torch
    from torchtitan.hf_datasets.text_datasets import _validate_dataset

    profile, profile_path, plan = llava
    path = export(plan, "torchtitan", tmp_path, "--profile", profile_path)
    ns = runpy.run_path(str(path))
    assert ns["MODEL"] == dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, hidden_dim=11008, vocab_size=32000,
                               enable_weight_tying=False) and ns["SEQ_LEN"] == 2048
    assert ns["ROPE_THETA"] == 10000.0  # the profile's RoPE base
    with pytest.raises(ValueError):  # torchtitan knows no dataset FILL_ME
        _validate_dataset(ns["DATASET"])
    no_base = replace(profile, shapes=tuple(replace(s, rope_base=0.0) for s in profile.shapes))  # an older profile's shape
    save_profile(no_base, tmp_path / "no-base.profile.json")
    (tmp_path / "no-base").mkdir()
    unknown = runpy.run_path(str(export(plan, "torchtitan", tmp_path / "no-base", "--profile", tmp_path / "no-base.profile.json")))
    assert unknown["ROPE_THETA"] == "FILL_ME"
    with pytest.raises(TypeError), torch.device("meta"):  # the model does not build until it is filled
        unknown["model_spec"]().model.build()
    with torch.device("meta"):
        model = ns["model_spec"]().model.build()
    assert sum(p.numel() for p in model.parameters()) == sum(b.params for b in profile.blocks if b.group == "llm")
    config = ns["apply"](types.SimpleNamespace(parallelism=None, training=types.SimpleNamespace(), activation_checkpoint=None,
                                               dataloader=types.SimpleNamespace(dataset="c4"), hf_assets_path="",
                                               loss=types.SimpleNamespace(), model_spec=None))
    assert config.training.seq_len == 2048 and config.model_spec.model.dim == 4096 and config.dataloader.dataset == "FILL_ME"
    assert "--nnodes 8 --nproc-per-node 8" in path.read_text()


def test_torchtitan_without_a_llama_llm_names_the_fields_to_fill(llava, tmp_path):
    _, _, plan = llava
    text = export(plan, "torchtitan", tmp_path).read_text()
    assert "model_spec" in text and "fill config.model_spec (dim, n_layers, n_heads" in text and "MODEL =" not in text


def test_deepspeed_launch_line_has_the_plans_nodes_and_gpus(llava, deepspeed_config, tmp_path):
    from cost_models.cluster_spec import parse_cluster
    from planner.solver.baselines import homogeneous_plan

    profile, profile_path, _ = llava
    for cluster, spec, want in (("64xh100-sxm", "tp=2,pp=1,dp=32", "--nnodes 8 --nproc-per-node 8 "),
                                ("4xh100-sxm", "tp=1,pp=1,dp=4", "--nnodes 1 --nproc-per-node 4 YOUR")):
        plan = tmp_path / f"{cluster}.json"
        save_plan(homogeneous_plan(profile, parse_cluster(cluster), 256, spec, predict=False), plan)
        comment = json.loads(export(plan, "deepspeed", tmp_path, "--profile", profile_path).read_text())["comment"]
        launch = [c for c in comment if c.startswith("launch on every node: torchrun")]
        assert len(launch) == 1 and want in launch[0]
        assert any("llm: 32 layers, hidden 4096, 32 heads, ffn 11008, sequence 2048, vocab 32000" in c for c in comment)


@pytest.mark.parametrize("rope, want", [({"rope_theta": 500000.0, "rope_type": "default"}, 500000.0),
                                        ({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 0.0)])
def test_profile_records_a_hugging_face_rope_base_unless_it_scales_frequencies(rope, want, tmp_path, monkeypatch):
    """A Hugging Face Llama (Llama 3's base); with Llama 3.1's frequency scaling the base alone is not the model's
    positions, so it stays unknown (0) and the exports write FILL_ME."""
    from transformers import LlamaConfig

    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    monkeypatch.setenv("TRANSFORMERS_DISABLE_TORCH_CHECK", "1")
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=128, max_position_embeddings=64, rope_parameters=rope, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    shape = next(s for s in profile_model(resolve(f"hf:{tmp_path}")).shapes if s.layers == 2)
    assert (shape.position, shape.rope_base) == ("rope", want)
