"""Images of different sizes and counts in one batch: Qwen2-VL's packed patches (runtime/samples.py: rows per sample
from the image grids, and whose images they are from the token types) and LLaVA-NeXT's anyres tiles (rows per sample
of its vision blocks from a forward of each sample alone, runtime/sample_probe.py). The runtime splits the inputs
and the vision-block outputs per sample across data-parallel replicas, pipeline stages and group boundaries; losses
and gradients match the single-process reference."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from plans.errors import MmplanError
from runtime.launch import launch
from runtime.reference import reference_run
from runtime.samples import collate, row_range, sample_rows, split_samples
from runtime.train import Job, train_rank
from tests.hf import tiny_configs, tiny_families
from tests.hf.test_hf_runtime import FIRST_LAYER, LLM, QVISION, QVL
from tests.runtime.plan_builder import make_plan

STEPS = 3
NEXT_VISION = ["model.vision_tower", "model.multi_modal_projector"]
# the patch embedding and the first encoder layer, whose output the projector reads (vision_feature_layer -2)
NEXT_FIRST_HALF = ["model.vision_tower.embeddings", "model.vision_tower.pre_layrnorm", "model.vision_tower.encoder.layers.0"]
NON_COLOCATED = [{"name": "vision", "stages": [(QVL, [0])]}, {"name": "llm", "stages": [(LLM, [1])]}]
PLANS = {  # Qwen2-VL, images of 16 and 8 pixels a side in turn: 16 and 4 patches, 4 and 1 merged tokens per sample
    "dp2": ("qwen2_vl", [{"name": "all", "dp": 2, "stages": [(QVL + LLM, [0, 1])]}]),
    "pp2": ("qwen2_vl", [{"name": "all", "stages": [(QVISION, [0]), (QVL + LLM, [1])]}]),  # patch rows cross the cut
    "non-colocated": ("qwen2_vl", NON_COLOCATED),
    # vision dp2 feeding one pipeline replica: the two replicas' merged tokens (of 2 sizes) concatenate (fan-in)
    "colocated": ("qwen2_vl", [{"name": "vision", "dp": 2, "stages": [(QVL, [0, 1])]},
                               {"name": "llm", "colocated_with": "vision", "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}]),
    # two images per sample, of 16 and 8 / 8 and 8 / 16 and 8 ... pixels (sides 16, 8, 8 in turn)
    "two-images-non-colocated": ("qwen2_vl_two", NON_COLOCATED),
    # Qwen2.5-VL (window attention reorders patches within each image), images of 32 and 16 pixels a side
    "qwen2.5-vl-pp2": ("qwen2_5_vl", [{"name": "all", "stages": [(QVISION, [0]), (QVL + LLM, [1])]}]),
    "qwen2.5-vl-non-colocated": ("qwen2_5_vl", NON_COLOCATED),
    # 1, 2, 0, 1, 2, 0, ... images per sample (sides 16, 8, 8 in turn): whose images, mm_token_type_ids says
    "counts-dp2": ("qwen2_vl_counts", [{"name": "all", "dp": 2, "stages": [(QVL + LLM, [0, 1])]}]),
    "counts-pp2": ("qwen2_vl_counts", [{"name": "all", "stages": [(QVISION, [0]), (QVL + LLM, [1])]}]),
    "counts-colocated": ("qwen2_vl_counts", [{"name": "vision", "dp": 2, "stages": [(QVL, [0, 1])]},
                                             {"name": "llm", "colocated_with": "vision",
                                              "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}]),
    # 0, 1, 0, 1, ... images per sample (the first sample has none; the trace starts at the first that has one):
    # dp2 of one sample per replica and micro-batch, so replica 0's share never has an image (its vision blocks run
    # on nothing, their gradients join the all-reduce as zeros); pp2 / non-colocated of one sample per micro-batch,
    # so every other micro-batch sends the vision blocks' outputs (and their gradients) with no rows
    "no-image-share-dp2": ("qwen2_vl_text_first", [{"name": "all", "dp": 2, "stages": [(QVL + LLM, [0, 1])]}],
                           {"micro_batches": 4}),
    "no-image-micro-batch-pp2": ("qwen2_vl_text_first", [{"name": "all", "stages": [(QVISION, [0]), (QVL + LLM, [1])]}],
                                 {"micro_batches": 8}),
    "no-image-micro-batch-non-colocated": ("qwen2_vl_text_first", NON_COLOCATED, {"micro_batches": 8}),
    # vision dp2 feeding one pipeline replica: replica 0's share of merged tokens has no rows (fan-in of 0 + 4)
    "no-image-share-colocated": ("qwen2_vl_text_first", [{"name": "vision", "dp": 2, "stages": [(QVL, [0, 1])]},
                                                         {"name": "llm", "colocated_with": "vision",
                                                          "stages": [(FIRST_LAYER, [0]), (LLM, [1])]}],
                                 {"micro_batches": 4}),
    # LLaVA-NeXT, images of 16x16, 30x12, 12x30, 32x32 pixels: 3, 3, 3, 5 tiles, 36, 56, 52, 88 image tokens
    "llava-next-dp2": ("llava_next", [{"name": "all", "dp": 2, "stages": [(NEXT_VISION + LLM, [0, 1])]}]),
    "llava-next-pp2-in-vision": ("llava_next", [{"name": "all", "stages": [(NEXT_FIRST_HALF, [0]),
                                                                           (NEXT_VISION + LLM, [1])]}]),
    "llava-next-pp2-vision-llm": ("llava_next", [{"name": "all", "stages": [(NEXT_VISION, [0]), (LLM, [1])]}]),
    # LLaVA-NeXT, two images per sample, of 16x16, 32x32, 30x12 pixels in turn: 8, 6, 8, 8 tiles per sample (3 + 5,
    # 3 + 3, 5 + 3, 3 + 5): pixel_values' 2 rows per sample say nothing of the tiles, a forward of each sample does
    "llava-next-two-images-dp2": ("llava_next_two", [{"name": "all", "dp": 2, "stages": [(NEXT_VISION + LLM, [0, 1])]}]),
    "llava-next-two-images-non-colocated": ("llava_next_two", [{"name": "vision", "stages": [(NEXT_VISION, [0])]},
                                                               {"name": "llm", "stages": [(LLM, [1])]}]),
    "llava-next-non-colocated": ("llava_next", [{"name": "vision", "stages": [(NEXT_VISION, [0])]},
                                                {"name": "llm", "stages": [(LLM, [1])]}]),
}
SIZES = {"qwen2_vl": (tiny_configs.qwen2_vl, {"image_size": [16, 8]}),
         "qwen2_vl_two": (tiny_configs.qwen2_vl, {"image_size": [16, 8, 8], "images_per_sample": 2}),
         "qwen2_5_vl": (tiny_families.qwen2_5_vl, {"image_size": [32, 16]}),
         "qwen2_vl_counts": (tiny_configs.qwen2_vl, {"image_size": [16, 8, 8], "images_per_sample": [1, 2, 0]}),
         "qwen2_vl_text_first": (tiny_configs.qwen2_vl, {"images_per_sample": [0, 1]}),
         "llava_next_two": (tiny_families.llava_next, {"image_size": [[16, 16], [32, 32], [30, 12]], "images_per_sample": 2}),
         "llava_next": (tiny_families.llava_next, {"image_size": [[16, 16], [30, 12], [12, 30], [32, 32]]})}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, (write, sizes) in SIZES.items():
        directory = write(tmp_path_factory.mktemp("hf") / name)
        config = json.loads((directory / "config.json").read_text())
        config["mmplan_inputs"].update(sizes)
        (directory / "config.json").write_text(json.dumps(config))
        out[name] = f"hf:{directory}"
    return out


def test_rows_per_sample_follow_the_image_grid():
    grid = torch.tensor([[1, 4, 4], [1, 2, 2], [1, 2, 4]])
    batch = {"ids": torch.zeros(3, 5, dtype=torch.long), "pixels": torch.randn(16 + 4 + 8, 6), "grid": grid}
    rows = sample_rows(batch)
    assert rows == {"ids": (1, 1, 1), "pixels": (16, 4, 8), "grid": (1, 1, 1)}
    assert row_range(rows["pixels"], 1, 3) == (16, 28)
    samples = split_samples(batch)
    assert [tuple(s["pixels"].shape) for s in samples] == [(16, 6), (4, 6), (8, 6)]
    two = {"pixels": torch.randn(16 + 4 + 4 + 4, 6), "grid": torch.tensor([[1, 4, 4], [1, 2, 2], [1, 2, 2], [1, 2, 2]]),
           "ids": torch.zeros(2, 5)}  # two images per sample
    assert sample_rows(two)["pixels"] == (20, 8) and sample_rows(two)["grid"] == (2, 2)
    again = collate([{k: v[0] if k != "pixels" else v for k, v in s.items()} for s in samples], {"pixels"})
    assert all(torch.equal(again[k], batch[k]) for k in batch)


def test_images_per_sample_follow_the_token_types():
    """4 images for 4 samples: 1, 2, 0 and 1 of them, as the runs of 1s in mm_token_type_ids say (not one each)."""
    grid = torch.tensor([[1, 4, 4], [1, 2, 2], [1, 2, 4], [1, 2, 2]])
    types = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]])
    batch = {"ids": torch.zeros(4, 6, dtype=torch.long), "pixel_values": torch.randn(16 + 4 + 8 + 4, 6),
             "image_grid_thw": grid, "mm_token_type_ids": types}
    rows = sample_rows(batch)
    assert rows["image_grid_thw"] == (1, 2, 0, 1) and rows["pixel_values"] == (16, 12, 0, 4)
    samples = split_samples(batch)
    assert [tuple(s["pixel_values"].shape) for s in samples] == [(16, 6), (12, 6), (0, 6), (4, 6)]
    packed = {"pixel_values", "image_grid_thw"}
    again = collate([{k: v if k in packed else v[0] for k, v in s.items()} for s in samples], packed)
    assert all(torch.equal(again[k], batch[k]) for k in batch)
    untyped = [{k: v if k in packed else v[0] for k, v in s.items() if k != "mm_token_type_ids"} for s in samples]
    with pytest.raises(MmplanError, match="different row counts"):  # one image each, the grid alone would say
        collate(untyped, packed)


def test_a_share_without_images_leaves_them_out_and_a_first_sample_without_one_is_not_traced(models):
    """A batch (or a replica's share of one) with no image has packed inputs of no rows: it is still one sample, and
    the model takes it without them (a stock vision tower cannot run on zero images). The hf: example a model is
    traced by starts at the first sample with an image; the data keeps the config's order (its first has none)."""
    from runtime.hf import data_example, hf_source
    from runtime.samples import batch_samples, model_inputs

    model, example = hf_source(models["qwen2_vl_text_first"]).factory(1)
    assert example["image_grid_thw"].shape[0] == 1
    data = data_example(models["qwen2_vl_text_first"], 1, example)  # a micro-batch of 1: the lists' whole cycle
    assert sample_rows(data)["pixel_values"] == (0, 16)
    first = split_samples(data)[0]
    assert batch_samples(first) == 1 and sample_rows(first)["pixel_values"] == (0,)
    assert set(model_inputs(first)) == set(first) - {"pixel_values", "image_grid_thw"}
    assert float(model(**model_inputs(first)).loss.detach()) > 0


def test_what_is_not_built_is_refused_in_one_line(models, tmp_path):
    """An example traced without images; LLaVA-NeXT with different numbers of images per sample; samples of different
    padded tile counts in one batch (a user's torch Dataset)."""
    from runtime.hf import data_example, hf_source
    from runtime.program import trace_program

    model, example = hf_source(models["qwen2_vl_text_first"]).factory(1)
    first = split_samples(data_example(models["qwen2_vl_text_first"], 1, example))[0]
    with pytest.raises(MmplanError, match="'pixel_values', 'image_grid_thw' has no rows.*give its first sample an image"):
        trace_program(model, first)
    directory = tiny_families.llava_next(tmp_path / "next")
    config = json.loads((directory / "config.json").read_text())
    config["mmplan_inputs"]["images_per_sample"] = [1, 2]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(MmplanError, match="'llava_next' takes the same number of images .at least 1. in every sample"):
        hf_source(f"hf:{directory}").factory(1)
    tiles = [{"pixel_values": torch.zeros(3, 3, 16, 16)}, {"pixel_values": torch.zeros(5, 3, 16, 16)}]
    with pytest.raises(MmplanError, match=r"shapes \(3, 3, 16, 16\) and \(5, 3, 16, 16\) cannot form one batch"):
        collate(tiles, set())


def test_zero_with_a_share_without_images_is_refused_in_one_line(models):
    """Under ZeRO the vision blocks' FSDP2 collectives would run on one replica only: refused before launch for the
    synthetic data (a share of 2 samples, one with an image, passes), and on the rank, before any, for other data."""
    from pathlib import Path

    from runtime.preflight import check_model, check_zero_shares

    spec, path = models["qwen2_vl_text_first"], Path("plan.json")
    zero = [{"name": "all", "dp": 2, "zero": 1, "stages": [(QVL + LLM, [0, 1])]}]
    check_zero_shares(check_model(make_plan(spec, zero, micro_batches=2), path, spec), path, None)
    plan = make_plan(spec, zero, micro_batches=4)
    with pytest.raises(MmplanError, match="replica 0's share of micro-batch 0 of step 0 .samples 0..0. has no image"):
        check_zero_shares(check_model(plan, path, spec), path, None)
    with pytest.raises(MmplanError, match="share of a micro-batch has no image.*use zero 0"):
        launch(train_rank, plan.world_size, Job(plan=plan, model=spec, steps=1, seed=0), timeout_s=120)


def test_llava_next_tiles_per_sample_come_from_a_forward_of_that_sample(models):
    """The hf: batch gives each sample its image size (tokens after unpadding differ); the trace's one sample
    cannot tell the others' tiles, so each distinct sample is probed once (transformers' own tile count)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    from runtime.hf import data_example, hf_source
    from runtime.program import trace_program

    model, example = hf_source(models["llava_next"]).factory(1)
    program = trace_program(model, example)
    batch = data_example(models["llava_next"], 4, example)
    assert batch["image_sizes"].tolist() == [[16, 16], [30, 12], [12, 30], [32, 32]]
    assert (batch["input_ids"] == model.config.image_token_index).sum(dim=1).tolist() == [36, 56, 52, 88]
    tiles = tuple(image_size_to_num_patches(hw, model.config.image_grid_pinpoints, 16) for hw in batch["image_sizes"].tolist())
    assert tiles == (3, 3, 3, 5)
    rows = program.batch_rows({**batch, **{k: v.repeat(2, *[1] * (v.dim() - 1)) for k, v in batch.items()}})
    assert rows["probe:model.multi_modal_projector#0"] == tiles * 2
    assert rows["probe:model.vision_tower.encoder.layers.0#0"] == tiles * 2
    assert program.probe.forwards == 3  # the trace's sample is known; each other distinct sample once
    assert float(model(**batch).loss.detach()) > 0


def test_the_runs_synthetic_data_has_images_of_every_size(models):
    """The run traces a one-sample example (one size); its synthetic data derives from the config's batch of a
    micro-batch (runtime/hf.data_example), so a micro-batch does hold images of both sizes."""
    from runtime.data import open_dataset
    from runtime.hf import data_example, hf_source

    model, example = hf_source(models["qwen2_vl"]).factory(1)
    data = open_dataset(None, data_example(models["qwen2_vl"], 4, example), 128, seed=0, model=model)
    batch = data.sample_batch(range(4))
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]] * 2
    assert sample_rows(batch)["pixel_values"] == (16, 4, 16, 4)
    assert float(model(**batch).loss.detach()) > 0


@pytest.mark.parametrize("case", list(PLANS))
def test_images_of_varied_sizes_and_counts_match_the_single_process_reference(case, models):
    kind, groups, *options = PLANS[case]
    model = models[kind]
    plan = make_plan(model, groups, **(options[0] if options else {}))
    job = Job(plan=plan, model=model, steps=STEPS, seed=0, probe_grads=True)
    ref = reference_run(job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    losses = [m["loss"] for m in results[0]["metrics"]]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), (case, step, got, want)
    grads = {}
    for r in results:
        grads.update(r["grads"])
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        tol = 1e-5 * max(float(want.abs().max()), 1e-2 * scale)
        assert float((grads[name] - want).abs().max()) <= tol, (case, name)


def test_llava_next_of_varied_image_sizes_profiles_on_meta_solves_and_runs(models, tmp_path):
    """The CLI path: a meta profile at a micro-batch of the sizes' whole cycle holds their mean tiles (3.5 per
    sample: the vision->projector edge), and a non-colocated plan passes run's fake-tensor pre-check and trains."""
    from typer.testing import CliRunner

    from planner.cli import app

    runner, prof, plan = CliRunner(), tmp_path / "p.json", tmp_path / "plan.json"
    one, four = tmp_path / "p1.json", tmp_path / "p4.json"
    for out, mb in ((one, "1"), (four, "4")):
        res = runner.invoke(app, ["profile", models["llava_next"], "--micro-batch", mb, "-o", str(out), "--quiet"])
        assert res.exit_code == 0, res.output

    def edge(path):
        return next(e["bytes"] for e in json.loads(path.read_text())["edges"] if e["dst"] == "model.multi_modal_projector")

    assert edge(one) == 3 * 17 * 32 * 4 and edge(four) == edge(one) * 3.5 / 3  # tiles x (16 patches + CLS) x fp32
    res = runner.invoke(app, ["profile", models["llava_next"], "--group", "projector=vision", "-o", str(prof), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "8", "--layout",
                              "vision:tp=1,pp=1,dp=1; llm:tp=1,pp=1,dp=1", "-o", str(plan), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["run", str(plan), "--steps", "2"])
    assert res.exit_code == 0, res.output
