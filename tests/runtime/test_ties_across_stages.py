"""A parameter tied across pipeline stages (tiny-vlm-tied's llm.embed and llm.head on two stages; runtime/ties.py):
a copy on each stage, the copies' gradients all-reduced between them, 20 steps of the single-process reference's
losses at pp2 and pp2 x dp2 (ZeRO 0 and 1), tp2 x pp2, and a checkpoint holding the tie once that resumes under either layout."""
from __future__ import annotations

import pytest
import torch

from runtime.launch import launch
from runtime.reference import reference_run
from runtime.train import Job, train_rank
from tests.runtime.plan_builder import make_plan
from tests.runtime.test_parity import check_parity

TIED = "tiny-vlm-tied"
OWNER, COPY = "llm.embed.weight", "llm.head.weight"
FIRST = ["vision", "vision_proj", "llm.embed", "llm.layers.0"]
SECOND = ["llm.layers.1", "llm.norm", "llm.head"]
STEPS = 20


def tied_pp_plan(dp: int = 1, zero: int = 0, tp: int = 1):
    ranks, per = list(range(2 * dp * tp)), dp * tp
    return make_plan(TIED, [{"name": "all", "dp": dp, "tp": tp, "zero": zero,
                             "stages": [(FIRST, ranks[:per]), (SECOND, ranks[per:])]}], micro_batches=4)


def _losses(results) -> list[float]:
    return [m["loss"] for m in results[0]["metrics"]]


def _close(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want) > 0
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), (step, g, w)


# pp2 and pp2 x dp2 over 20 steps; under ZeRO 6 steps (as tests/runtime/test_zero.py), the FSDP2 shards of the copies
@pytest.mark.parametrize(("dp", "zero", "steps"), [(1, 0, STEPS), (2, 0, STEPS), (2, 1, 6), (2, 3, 6)],
                         ids=["pp2", "pp2-dp2", "pp2-dp2-zero1", "pp2-dp2-zero3"])
def test_a_tie_across_stages_trains_as_the_single_process_reference(dp, zero, steps):
    plan = tied_pp_plan(dp, zero)
    job = Job(plan=plan, model=TIED, steps=steps, seed=0, probe_grads=True)
    ref = reference_run(job)
    results = launch(train_rank, plan.world_size, job, timeout_s=300)
    _close(_losses(results), ref["losses"])
    copies = [r["grads"].pop(COPY) for r in results if COPY in r["grads"]]
    owners = [r["grads"][OWNER] for r in results if OWNER in r["grads"]]
    assert copies and owners
    for c in copies:  # each stage's copy holds the whole tie's gradient (the reference probes it under the owner's name)
        torch.testing.assert_close(c, owners[0], rtol=1e-6, atol=1e-9)
    check_parity(f"tied-across-stages-dp{dp}-zero{zero}", results, ref)


def test_a_tie_across_stages_under_tensor_parallelism_meets_its_vocabulary_shards():
    """tp2 x pp2: the embedding and the head are both vocabulary-parallel, so tp rank k of each stage holds the same
    rows of the tie and their copies are summed position by position."""
    plan = tied_pp_plan(tp=2)
    job = Job(plan=plan, model=TIED, steps=8, seed=0)
    _close(_losses(launch(train_rank, plan.world_size, job, timeout_s=300)), reference_run(job)["losses"])


def test_a_checkpoint_of_a_tie_across_stages_holds_it_once_and_resumes_under_any_layout(tmp_path):
    """The pp2 checkpoint is the single-stage one's: the weight under both blocks, one optimizer state (the
    owner's); resumed under pp2 and under dp2 (one stage) it gives the uninterrupted run's losses, and so does the
    one-stage checkpoint resumed under pp2 (the copy takes the owner's optimizer state)."""
    from runtime.checkpoint import latest_checkpoint
    from runtime.checkpoint_dcp import read_blocks

    pp2 = tied_pp_plan()
    whole = _losses(launch(train_rank, 2, Job(plan=pp2, model=TIED, steps=4), timeout_s=300))
    ckpt = tmp_path / "ckpt"
    launch(train_rank, 2, Job(plan=pp2, model=TIED, steps=2, checkpoint_every=2, checkpoint_dir=str(ckpt)), timeout_s=300)
    manifest = latest_checkpoint(ckpt)
    files = read_blocks(manifest)
    states = [n for _, optimizer in files.values() for n, state in optimizer.items() if state and n in (OWNER, COPY)]
    assert states == [OWNER]
    assert torch.equal(files["llm.head"][0][COPY], files["llm.embed"][0][OWNER])
    one_stage = make_plan(TIED, [{"name": "all", "dp": 2, "stages": [(FIRST + SECOND, [0, 1])]}], micro_batches=4)
    for plan in (pp2, one_stage):
        resumed = launch(train_rank, 2, Job(plan=plan, model=TIED, steps=4, resume=str(ckpt)), timeout_s=300)
        _close(_losses(resumed), whole[2:])
    flat = tmp_path / "one-stage"
    launch(train_rank, 2, Job(plan=one_stage, model=TIED, steps=2, checkpoint_every=2, checkpoint_dir=str(flat)),
           timeout_s=300)
    resumed = launch(train_rank, 2, Job(plan=pp2, model=TIED, steps=4, resume=str(flat)), timeout_s=300)
    _close(_losses(resumed), whole[2:])


def test_a_tie_across_stages_whose_copies_sit_in_host_and_nvme_tiers(tmp_path):
    """The copies live in their own stages' tiers (parameters on NVMe and gradients on the host on one, parameters on
    the host and Adam state on NVMe on the other): still the reference's losses."""
    from plans.plan import Memory

    plan = make_plan(TIED, [{"name": "all", "stages": [(FIRST, [0], Memory(params="nvme", grads="cpu")),
                                                       (SECOND, [1], Memory(params="cpu", optimizer="nvme"))]}])
    job = Job(plan=plan, model=TIED, steps=4, seed=0, nvme_dir=str(tmp_path))
    _close(_losses(launch(train_rank, 2, job, timeout_s=300)), reference_run(job)["losses"])
