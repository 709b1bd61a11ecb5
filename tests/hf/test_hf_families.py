"""The families issue 31 names (tiny random-weight configs, tests/hf/tiny_families.py): `hf:` inputs for each,
groups by modality from the data flow, synthetic data per input, a block called twice, value-dependent glue."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app
from planner.profiler.profile import profile_model, written_as_read
from plans.errors import MmplanError
from plans.graph import Edge
from runtime.data import open_dataset
from runtime.source import call_factory, resolve
from runtime.synthetic import DerivedDataset
from runtime.rank import vocab_of
from tests.hf import tiny_families


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: f"hf:{getattr(tiny_families, name)(root / name)}" for name in tiny_families.FAMILIES}


def _groups(profile) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for b in profile.blocks:
        out.setdefault(b.group, []).append(b.name)
    return out


@pytest.mark.parametrize("family", tiny_families.FAMILIES)
def test_every_family_profiles_on_meta_from_its_config(family, families):
    groups = _groups(profile_model(resolve(families[family])))
    assert len(groups) >= 2, groups  # a modality and the text side, at least


def test_an_unknown_family_is_refused_in_one_line_naming_the_factory(tmp_path):
    from transformers import GitConfig

    GitConfig(architectures=["GitForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(MmplanError, match=r"no example inputs for HF model_type 'git'.*write a factory"):
        call_factory(resolve(f"hf:{tmp_path}"), 1)


def test_mllama_vision_tower_is_one_group_though_its_aspect_ratio_embeddings_read_batch_ids(families):
    groups = _groups(profile_model(resolve(families["mllama"])))
    assert list(groups) == ["vision", "projector", "llm"]
    assert all(b.startswith("model.vision_model.") for b in groups["vision"])
    assert "model.vision_model.pre_tile_positional_embedding" in groups["vision"]
    assert groups["projector"] == ["model.multi_modal_projector"]
    assert groups["llm"][0] == "model.language_model.embed_tokens"  # the cross-attention layer 1 included
    assert "model.language_model.layers.1" in groups["llm"]


def test_whisper_encoder_is_the_audio_group_and_the_decoder_the_llm(families):
    groups = _groups(profile_model(resolve(families["whisper"])))
    assert list(groups) == ["audio", "llm"]
    assert all(b.startswith("model.encoder.") for b in groups["audio"])
    assert all(b.startswith("model.decoder.") for b in groups["llm"][:-1]) and groups["llm"][-1] == "proj_out"


def test_blip2_post_layernorm_called_twice_is_one_block_and_the_profile_is_valid(families, tmp_path):
    prof = profile_model(resolve(families["blip2"]))
    assert [b.name for b in prof.blocks].count("vision_model.post_layernorm") == 1
    assert not [e for e in prof.edges if e.src == e.dst]
    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["profile", families["blip2"], "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    assert CliRunner().invoke(app, ["show", str(out)]).exit_code == 0


def test_profile_refuses_to_write_what_show_and_solve_would_refuse(families):
    prof = profile_model(resolve(families["paligemma"]))
    block = prof.blocks[1].name
    with pytest.raises(MmplanError, match="cycle"):
        written_as_read(replace(prof, edges=prof.edges + (Edge(block, block, 4),)), "paligemma")


def test_idefics3_pixel_padding_test_profiles_on_meta_as_on_cpu(families):
    meta = profile_model(resolve(families["idefics3"]))
    cpu = profile_model(resolve(families["idefics3"]), device="cpu")
    assert [(b.name, b.group, b.fwd_flops, b.activation_bytes) for b in meta.blocks] == \
        [(b.name, b.group, b.fwd_flops, b.activation_bytes) for b in cpu.blocks]
    assert set(_groups(meta)) == {"vision", "projector", "llm"}


def test_synthetic_ids_stay_below_each_inputs_embedding_and_labels_below_the_head(families):
    torch.manual_seed(0)
    model, example = call_factory(resolve(families["mllama"]), 2)
    assert vocab_of(model) == 64 < model.get_input_embeddings().num_embeddings  # 8 rows more than the head's classes
    data = open_dataset(None, example, vocab_of(model), 0, model=model)
    assert data.limits == {"aspect_ratio_ids": 9, "input_ids": 72}
    batch = data.sample_batch(range(8))
    assert int(batch["aspect_ratio_ids"].max()) < 9 and int(batch["labels"].max()) < 64
    assert torch.isfinite(model(**batch).loss)


def test_an_out_of_range_synthetic_sample_names_its_input(families):
    _, example = call_factory(resolve(families["llava_next"]), 1)
    data = DerivedDataset(example, vocab=64, seed=0, limits={"input_ids": 40})  # the image token 63 is past it
    with pytest.raises(MmplanError, match=r"input 'input_ids' holds id 63, outside \[0, 40\)"):
        data.sample(0)


def test_whisper_labels_alone_are_a_learnable_transcript(families):
    model, example = call_factory(resolve(families["whisper"]), 2)
    data = open_dataset(None, example, vocab_of(model), 0, model=model)
    a, b = data.sample(0), data.sample(1)
    assert a["labels"].shape == example["labels"].shape[1:] and int(a["labels"].max()) < 64
    assert not torch.equal(a["labels"], example["labels"][0]) or not torch.equal(b["labels"], example["labels"][1])


def bf16_llava():
    """A factory's transformers model whose config says bf16 (as published PaliGemma / Gemma 3 configs do)."""
    from examples.hf_model import factory

    model = factory()
    model.config.dtype = torch.bfloat16
    return model


def test_a_factory_model_is_profiled_in_its_configs_dtype():
    assert profile_model(resolve(f"{__name__}:bf16_llava")).dtype == "bf16"
    assert profile_model(resolve("examples.hf_model:factory")).dtype == "fp32"
    assert profile_model(resolve(f"{__name__}:bf16_llava"), dtype="fp32").dtype == "fp32"  # --dtype wins


@pytest.mark.parametrize("factory", ["llava_with_batch", "qwen2_vl_with_batch"])
def test_a_factory_returning_a_stock_hf_model_and_its_own_batch_profiles_on_meta_and_runs(factory, tmp_path):
    spec = f"examples.hf_model:{factory}"
    meta = profile_model(resolve(spec))
    assert list(_groups(meta)) == ["vision", "projector", "llm"]
    runner, prof, plan = CliRunner(), tmp_path / "p.json", tmp_path / "plan.json"
    assert runner.invoke(app, ["profile", spec, "-o", str(prof), "--quiet"]).exit_code == 0
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "4",
                              "--placement", "non-colocated", "-o", str(plan), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", str(plan), "--model", spec, "--steps", "2"])
    assert res.exit_code == 0, res.output
