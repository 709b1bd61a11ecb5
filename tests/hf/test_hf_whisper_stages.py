"""Whisper split across stages: the decoder stage runs the encoder's glue with stand-ins for its blocks, and the
encoder's position table (`embed_positions(arange(positions))`) reads no batch input, so its stand-in keeps its whole
shape (runtime/forward_program.py, OutputSpec.fixed) -- it used to be sized per sample (a size mismatch, 20 vs 40,
in every pp2 and non-colocated run of the families bench). Parity with the single-process reference."""
from __future__ import annotations

import pytest

from runtime.launch import launch
from runtime.program import trace_program
from runtime.reference import reference_run
from runtime.source import call_factory, resolve
from runtime.train import Job, train_rank
from tests.hf import tiny_families
from tests.runtime.plan_builder import make_plan

ENCODER = ["model.encoder"]
DECODER = ["model.decoder", "proj_out"]
PLANS = {
    "pp2": ([{"name": "all", "stages": [(ENCODER, [0]), (DECODER, [1])]}], {"micro_batches": 4}),
    "non-colocated": ([{"name": "audio", "stages": [(ENCODER, [0])]}, {"name": "llm", "stages": [(DECODER, [1])]}], {}),
}


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    return f"hf:{tiny_families.whisper(tmp_path_factory.mktemp('whisper') / 'whisper')}"


def test_a_block_reading_no_batch_input_keeps_its_whole_output_shape(whisper):
    model, example = call_factory(resolve(whisper), 2)
    specs = trace_program(model, example).specs
    assert {b for b, s in specs.items() if s.fixed} == {"model.encoder.embed_positions"}
    assert specs["model.encoder.embed_positions"].rows == (20,)  # max_source_positions, whatever the samples


@pytest.mark.parametrize("case", list(PLANS))
def test_whisper_split_across_stages_matches_the_single_process_reference(whisper, case):
    groups, training = PLANS[case]
    plan = make_plan(whisper, groups, **training)
    job = Job(plan=plan, model=whisper, steps=4, seed=0)
    want = reference_run(job)["losses"]
    got = [m["loss"] for m in launch(train_rank, plan.world_size, job, timeout_s=300)[0]["metrics"]]
    assert len(got) == len(want) == 4
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-5 * abs(w), (case, step, g, w)
