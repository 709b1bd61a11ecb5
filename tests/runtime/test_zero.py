"""ZeRO 1/2/3 on FSDP2 (runtime/zero.py): loss and gradient parity with the single-process reference, composed with
pipelines, tensor parallelism and a CPU-offloaded optimizer; checkpoints of sharded state resume under zero=0."""
from __future__ import annotations

import pytest
import torch

from plans.plan import Memory
from runtime.launch import launch
from runtime.train import Job, train_rank
from runtime.reference import reference_run
from tests.runtime.plan_builder import make_plan
from tests.runtime.test_parity import check_parity

STEPS = 6
VLM_ALL = ["vision", "vision_proj", "llm"]
PLANS = {
    "dp2-zero1": ("tiny-vlm", [{"name": "all", "dp": 2, "zero": 1, "stages": [(VLM_ALL, [0, 1])]}], {}),
    "dp2-zero2": ("tiny-vlm", [{"name": "all", "dp": 2, "zero": 2, "stages": [(VLM_ALL, [0, 1])]}], {}),
    "dp2-zero3": ("tiny-vlm", [{"name": "all", "dp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1])]}], {}),
    "pp2-dp2-zero3": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 3, "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
    "dp2-zero2-optimizer-cpu": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 2, "stages": [(VLM_ALL, [0, 1], Memory(optimizer="cpu"))]},
    ], {}),
    "dp2-zero3-params-cpu": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1], Memory(params="cpu", grads="cpu", optimizer="cpu"))]},
    ], {}),
    "dp2-zero3-recompute": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1], Memory(activations={"*": "recompute"}))]},
    ], {}),
    "tp2-dp2-zero3": ("tiny-vlm", [{"name": "all", "dp": 2, "tp": 2, "zero": 3, "stages": [(VLM_ALL, [0, 1, 2, 3])]}], {}),
}

_REFERENCE: dict = {}


def reference(model: str, job: Job) -> dict:
    """The single-process run of `job` (cached by what it depends on: model, training, frozen blocks, steps)."""
    frozen = tuple(b.name for b in job.plan.flow.blocks if b.frozen)
    key = (model, job.plan.training, frozen, job.steps)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_run(job)
    return _REFERENCE[key]


@pytest.mark.parametrize("case", list(PLANS))
def test_zero_matches_single_process_reference(case):
    model, groups, training = PLANS[case]
    plan = make_plan(model, groups, **training)
    job = Job(plan=plan, model=model, steps=STEPS, seed=0, probe_grads=True)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    check_parity(case, results, reference(model, job))


def test_a_zero3_checkpoint_is_unsharded_and_resumes_under_zero0_and_zero2(tmp_path):
    """Sharded parameters and Adam state are gathered into the layout-independent checkpoint, and taken apart
    again when a ZeRO run resumes: 2 steps under ZeRO-3 + 2 resumed give the uninterrupted run's losses."""
    stage = [(VLM_ALL, [0, 1])]
    z3, z0, z2 = (make_plan("tiny-vlm", [{"name": "all", "dp": 2, "zero": z, "stages": stage}]) for z in (3, 0, 2))
    whole = launch(train_rank, 2, Job(plan=z3, model="tiny-vlm", steps=4), timeout_s=240)[0]["metrics"]
    ckpt = tmp_path / "ckpt"
    launch(train_rank, 2, Job(plan=z3, model="tiny-vlm", steps=2, checkpoint_every=2, checkpoint_dir=str(ckpt)), timeout_s=240)
    for plan in (z0, z2):
        resumed = launch(train_rank, 2, Job(plan=plan, model="tiny-vlm", steps=4, resume=str(ckpt)), timeout_s=240)[0]["metrics"]
        assert [m["step"] for m in resumed] == [2, 3]
        for got, want in zip(resumed, whole[2:]):
            assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got, want)


@pytest.mark.parametrize("case", ["dp2-zero3", "dp2-zero2-optimizer-cpu"])
def test_a_bf16_zero_plan_steps_fp32_masters_of_its_shards(case):
    """bf16 under ZeRO: FSDP2 shards the bf16 parameters, Adam's fp32 masters cover this rank's shard only (in the
    optimizer's tier); losses and gradients as the single-process bf16 reference's, to bf16 rounding."""
    model, groups, training = PLANS[case]
    plan = make_plan(model, groups, dtype="bf16", **training)
    job = Job(plan=plan, model=model, steps=6, seed=0, probe_grads=True)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    assert all(g.dtype == torch.bfloat16 for r in results for g in r["grads"].values())
    check_parity(case, results, reference(model, job), loss_rtol=2e-2, grad_tol=4e-2)


# --- tied parameters: tiny-vlm-tied's llm.embed and llm.head hold one Parameter (tie_embeddings, as Gemma 3 / PaliGemma)

TIED = "tiny-vlm-tied"
TIED_WEIGHT, TIED_ALIAS = "llm.embed.weight", "llm.head.weight"  # its first name (the reference's) and the head's
TIED_CASES = {"zero1": (1, Memory()), "zero2": (2, Memory()), "zero3": (3, Memory()),
              "zero3-params-cpu": (3, Memory(params="cpu", grads="cpu", optimizer="cpu"))}


def tied_plan(zero: int, memory: Memory = Memory()):
    return make_plan(TIED, [{"name": "all", "dp": 2, "zero": zero, "stages": [(VLM_ALL, [0, 1], memory)]}])


@pytest.mark.parametrize("case", list(TIED_CASES))
def test_a_tied_embedding_and_head_train_as_one_parameter_under_zero(case):
    """The blocks sharing the weight are one FSDP2 unit: one DTensor, one reduction of the summed gradient, one Adam
    update -- the reference's losses and gradients (sharded block by block, the two copies each took a step: 1.5e-4
    off the reference's loss after 6 steps)."""
    plan = tied_plan(*TIED_CASES[case])
    job = Job(plan=plan, model=TIED, steps=STEPS, seed=0, probe_grads=True)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    for r in results:  # ranks probe the weight under both blocks' names, the reference under its first
        alias = r["grads"].pop(TIED_ALIAS, None)
        if alias is not None:
            assert torch.equal(alias, r["grads"][TIED_WEIGHT])
    check_parity(f"tied-{case}", results, reference(TIED, job))


def _tied_checkpoint(directory, zero: int) -> dict:
    """block -> (params, optimizer state) of the checkpoint one dp2 step of tiny-vlm-tied at `zero` writes."""
    from runtime.checkpoint import latest_checkpoint
    from runtime.checkpoint_dcp import read_blocks

    launch(train_rank, 2, Job(plan=tied_plan(zero), model=TIED, steps=1, checkpoint_every=1, checkpoint_dir=str(directory)),
           timeout_s=240)
    return read_blocks(latest_checkpoint(directory))  # DCP's shards, read back per block


@pytest.fixture(scope="module")
def tied_zero0_checkpoint(tmp_path_factory):
    return _tied_checkpoint(tmp_path_factory.mktemp("tied-zero0"), 0)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_tied_parameter_is_checkpointed_with_one_optimizer_state_under_zero(zero, tied_zero0_checkpoint, tmp_path):
    """One optimizer state for the tied weight (the embedding's file; the head's file holds the same weight), and
    every tensor of every block file as ZeRO-0's (sharded block by block: both weights 2e-3 off, two Adam states)."""
    got, want = _tied_checkpoint(tmp_path / "ckpt", zero), tied_zero0_checkpoint
    states = [n for _, optimizer in got.values() for n, state in optimizer.items() if state and n in (TIED_WEIGHT, TIED_ALIAS)]
    assert states == [TIED_WEIGHT]
    assert torch.equal(got["llm.head"][0][TIED_ALIAS], got["llm.embed"][0][TIED_WEIGHT])
    assert got.keys() == want.keys()
    for b, (params, optimizer) in got.items():
        assert params.keys() == want[b][0].keys() and optimizer.keys() == want[b][1].keys(), b
        for n, t in params.items():
            torch.testing.assert_close(t, want[b][0][n], rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
        for n, state in optimizer.items():
            for k, t in state.items():
                torch.testing.assert_close(t, want[b][1][n][k], rtol=1e-5, atol=1e-9, msg=lambda m, n=n, k=k: f"{n} {k}: {m}")


def test_a_tie_between_chunks_of_an_interleaved_zero_stage_is_refused():
    from plans.errors import MmplanError
    from runtime.zero import check_ties_within_chunks

    embed, head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False)
    head.weight = embed.weight
    modules = {"embed": embed, "head": head}
    check_ties_within_chunks([["embed", "head"]], modules)
    with pytest.raises(MmplanError, match="embed and head share a parameter"):
        check_ties_within_chunks([["embed"], ["head"]], modules)


# ZeRO-3 with FSDP2's reshard_after_forward=False (the plan's Group field): gathered once per micro-batch, held to the
# backward; 20 steps, with a pipeline and 4 micro-batches (several forwards in flight hold their blocks gathered)
KEPT = {
    "dp2-zero3-kept": ("tiny-vlm", [{"name": "all", "dp": 2, "zero": 3, "reshard_after_forward": False,
                                     "stages": [(VLM_ALL, [0, 1])]}], {"micro_batches": 2}),
    "pp2-dp2-zero3-kept": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 3, "reshard_after_forward": False,
         "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 4}),
}


@pytest.mark.parametrize("case", list(KEPT))
def test_zero3_without_reshard_after_forward_matches_reference(case):
    model, groups, training = KEPT[case]
    plan = make_plan(model, groups, **training)
    assert not plan.groups[0].reshard_after_forward
    job = Job(plan=plan, model=model, steps=20, seed=0, probe_grads=True)
    results = launch(train_rank, plan.world_size, job, timeout_s=480)
    check_parity(case, results, reference(model, job))


# FSDP2 keeping the parameters unsharded across a step's micro-batches (gathered once per step, resharded after the
# last backward: runtime/zero.before_backward) is ZeRO-2 (gradients reduce-scattered every micro-batch) and ZeRO-1
# (gradients accumulated unsharded, reduced once); 20 steps of 4 micro-batches, on dp2, pp2 x dp2 and two multimodal
# placements (encoder and LLM on disjoint ranks, and colocated on the same ranks)
ACCUMULATED = {
    "dp2-zero2-kept-across-micro-batches": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 2, "stages": [(VLM_ALL, [0, 1])]}]),
    "pp2-dp2-zero1-kept-across-micro-batches": ("tiny-vlm", [
        {"name": "all", "dp": 2, "zero": 1,
         "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]}]),
    "non-colocated-encoder-zero2-llm-zero1": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "zero": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "dp": 2, "zero": 1, "stages": [(["llm"], [2, 3])]}]),
    "colocated-encoder-zero2-llm-zero2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "zero": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "dp": 2, "zero": 2, "colocated_with": "vision", "stages": [(["llm"], [0, 1])]}]),
}


@pytest.mark.parametrize("case", list(ACCUMULATED))
def test_parameters_kept_unsharded_across_micro_batches_match_reference(case):
    model, groups = ACCUMULATED[case]
    plan = make_plan(model, groups, micro_batches=4)
    assert all(g.zero in (1, 2) for g in plan.groups)
    job = Job(plan=plan, model=model, steps=20, seed=0, probe_grads=True)
    results = launch(train_rank, plan.world_size, job, timeout_s=480)
    check_parity(case, results, reference(model, job))
