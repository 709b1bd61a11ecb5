"""Loss parity: every plan shape trains exactly like the single-process reference (CPU, gloo, fp32)."""
from __future__ import annotations

import pytest
import torch

from plans.plan import Memory
from runtime.launch import launch
from runtime.reference import reference_run
from runtime.train import Job, train_rank
from tests.runtime.plan_builder import make_plan

STEPS = 20

VLM_ALL = ["vision", "vision_proj", "llm"]
PLANS = {
    "dp2": ("tiny-vlm", [
        {"name": "all", "dp": 2, "stages": [(VLM_ALL, [0, 1])]},
    ], {}),
    "pp2-gpipe": ("tiny-vlm", [
        {"name": "all", "stages": [(["vision", "vision_proj", "llm.embed"], [0]), (["llm"], [1])]},
    ], {"schedule": "gpipe", "micro_batches": 4}),
    "pp2-1f1b": ("tiny-vlm", [
        {"name": "all", "stages": [(["vision", "vision_proj", "llm.embed", "llm.layers.0"], [0]), (["llm"], [1])]},
    ], {"schedule": "1f1b", "micro_batches": 4}),
    # interleaved 1F1B, v = 2: stage 0 runs chunks 0 and 2 of the model, stage 1 chunks 1 and 3
    "pp2-interleaved-v2": ("tiny-vlm", [
        {"name": "all", "stages": [(["vision", "vision_proj", "llm.embed", "llm.layers.1"], [0]), (["llm"], [1])]},
    ], {"schedule": "interleaved", "virtual_stages": 2, "micro_batches": 4}),
    # interleaved 1F1B, v = 4 (solve's VIRTUAL_STAGES): stage 0 runs chunks 0, 2, 4, 6 of the model, stage 1 chunks 1, 3, 5, 7
    "pp2-interleaved-v4": ("tiny-vlm", [
        {"name": "all", "stages": [(["vision.patch_embed", "vision.layers.0", "vision.norm", "llm.embed", "llm.layers.1"], [0]),
                                   (["vision", "vision_proj", "llm"], [1])]},
    ], {"schedule": "interleaved", "virtual_stages": 4, "micro_batches": 4}),
    # interleaved with memory tiers: stage 0's two chunks share one parameter store on the CPU (offloaded activations)
    "pp2-interleaved-v2-tiers": ("tiny-vlm", [
        {"name": "all", "stages": [
            (["vision", "vision_proj", "llm.embed", "llm.layers.1"], [0],
             Memory(params="cpu", grads="cpu", optimizer="cpu", activations={"*": "offload-cpu"})),
            (["llm"], [1], Memory(activations={"*": "recompute"}))]},
    ], {"schedule": "interleaved", "virtual_stages": 2, "micro_batches": 4}),
    "encoder-feeding-interleaved-llm": ("tiny-vlm", [
        {"name": "vision", "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "llm", "dp": 2, "stages": [(["llm.embed", "llm.layers.1"], [1, 2]), (["llm"], [3, 4])]},
    ], {"schedule": "interleaved", "virtual_stages": 2, "micro_batches": 4}),
    "pp2xdp2": ("tiny-vlm", [
        {"name": "all", "dp": 2, "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 2}),
    "avlm-non-colocated": ("tiny-avlm", [
        {"name": "vision", "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "audio", "stages": [(["audio", "audio_proj"], [1])]},
        {"name": "llm", "stages": [(["llm.embed", "llm.layers.0"], [2]), (["llm"], [3])]},
    ], {"micro_batches": 4}),
    "avlm-colocated": ("tiny-avlm", [
        {"name": "encoders", "dp": 4, "stages": [(["vision", "vision_proj", "audio", "audio_proj"], [0, 1, 2, 3])]},
        {"name": "llm", "dp": 2, "colocated_with": "encoders",
         "stages": [(["llm.embed", "llm.layers.0"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 2}),
    "flamingo-xattn-2-stages": ("tiny-flamingo", [
        {"name": "vision", "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "llm", "stages": [(["llm.embed", "llm.layers.0", "llm.layers.1"], [1]), (["llm"], [2])]},
    ], {"micro_batches": 2}),
    "tp2": ("tiny-vlm", [
        {"name": "all", "tp": 2, "stages": [(VLM_ALL, [0, 1])]},
    ], {}),
    "tp2xpp2": ("tiny-vlm", [
        {"name": "all", "tp": 2, "stages": [(["vision", "vision_proj", "llm.embed"], [0, 1]), (["llm"], [2, 3])]},
    ], {"micro_batches": 2}),
    "encoder-tp2-llm-tp1": ("tiny-vlm", [
        {"name": "vision", "tp": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "stages": [(["llm"], [2])]},
    ], {}),
    "encoder-tp1-llm-tp2": ("tiny-vlm", [
        {"name": "vision", "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "llm", "tp": 2, "stages": [(["llm"], [1, 2])]},
    ], {}),
    "colocated-encoder-dp2-llm-tp2": ("tiny-vlm", [
        {"name": "vision", "dp": 2, "stages": [(["vision", "vision_proj"], [0, 1])]},
        {"name": "llm", "tp": 2, "colocated_with": "vision", "stages": [(["llm"], [0, 1])]},
    ], {}),
    "clip-disjoint-towers": ("tiny-clip", [
        {"name": "image", "stages": [(["image_tower", "image_proj"], [0])]},
        {"name": "text", "stages": [(["text_tower", "text_proj", "head"], [1])]},
    ], {"micro_batches": 2}),
}

_REFERENCE: dict = {}


def assert_executed_order_is_predicted(plan, model: str, measured: dict[int, list]) -> None:
    """Each rank ran its forward/backward tasks in the order the simulator's timeline predicts (one truth)."""
    from cost_models.pipeline import simulate
    from tests.runtime.plan_builder import profile

    sim = simulate(plan, profile(model))
    for rank in range(plan.world_size):
        predicted = [e.name for e in sim.rank_timeline(rank) if e.lane == "compute" and e.name[:4] in ("fwd ", "bwd ")]
        executed = [name for lane, name, *_ in measured[rank] if name[:4] in ("fwd ", "bwd ")]
        assert executed == predicted, (rank, executed, predicted)


def reference(model: str, job: Job):
    """The single-process reference of the job, cached per (model, training); run at one intra-op thread as every rank
    runs (runtime/launch.RANK_THREADS): at torch's default two, on the shared 2-core box at load ~5, its 20 steps took
    25-53 s instead of 1 s (OpenMP threads spinning against the other jobs)."""
    key = (model, job.plan.training)
    if key not in _REFERENCE:
        from runtime.launch import RANK_THREADS

        previous = torch.get_num_threads()
        torch.set_num_threads(RANK_THREADS)
        try:
            _REFERENCE[key] = reference_run(job)
        finally:
            torch.set_num_threads(previous)
    return _REFERENCE[key]


def run_in_predicted_order(model: str, groups: list[dict], training: dict):
    """(plan, each rank's results, the single-process reference) of a traced STEPS-step run of the plan, whose executed
    order is asserted to be the predicted one."""
    plan = make_plan(model, groups, **training)
    job = Job(plan=plan, model=model, steps=STEPS, seed=0, probe_grads=True, trace=True)
    ref = reference(model, job)
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    assert_executed_order_is_predicted(plan, model, results[0]["trace"])
    return plan, results, ref


@pytest.mark.parametrize("case", list(PLANS))
def test_plan_matches_single_process_reference(case):
    plan, results, ref = run_in_predicted_order(*PLANS[case])
    check_parity(case, results, ref, loss_rtol=1e-4)


@pytest.mark.parametrize("case", ["pp2-1f1b", "pp2xdp2", "tp2"])
def test_a_bf16_plan_trains_in_bf16_with_fp32_masters_like_the_reference(case):
    """Training.dtype bf16: parameters, activations, gradients and the tensors stages exchange in bf16, Adam on fp32
    master copies (runtime/precision.py), on every rank as in the single-process reference."""
    model, groups, training = PLANS[case]
    plan = make_plan(model, groups, dtype="bf16", **training)
    job = Job(plan=plan, model=model, steps=8, seed=0, probe_grads=True)
    ref = reference(model, job)
    assert all(g.dtype == torch.bfloat16 for g in ref["grads"].values())
    results = launch(train_rank, plan.world_size, job, timeout_s=240)
    assert all(g.dtype == torch.bfloat16 for r in results for g in r["grads"].values())  # the ranks trained in bf16
    fp32 = reference(model, Job(plan=make_plan(model, groups, **training), model=model, steps=8, seed=0, probe_grads=True))
    assert ref["losses"] != fp32["losses"]  # bf16 arithmetic, not fp32's
    assert ref["losses"][-1] < ref["losses"][0]  # the fp32 masters take the small updates bf16 weights would lose
    # pipeline and tensor-parallel splits round differently in bf16 than one process: a bf16 ulp is 2^-8
    check_parity(case, results, ref, loss_rtol=2e-2, grad_tol=4e-2)


def check_parity(case: str, results: list, ref: dict, *, loss_rtol: float = 1e-5, grad_floor: float = 1e-3,
                 grad_tol: float = 1e-5) -> None:
    """Rank 0's losses within loss_rtol of the reference's, every probed gradient within grad_tol of it (relative to
    the tensor, or to grad_floor x the largest gradient when that is more)."""
    losses = [m["loss"] for m in results[0]["metrics"]]
    assert len(losses) == len(ref["losses"]) > 0  # the reference ran the job's steps
    for step, (got, want) in enumerate(zip(losses, ref["losses"])):
        assert abs(got - want) <= loss_rtol * abs(want), (case, step, got, want)
    grads = {}
    for r in results:
        grads.update(r["grads"])
    assert set(grads) == set(ref["grads"]), case
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        # within grad_tol relative to the tensor, with a floor for gradients that are zero in exact arithmetic
        tol = grad_tol * max(float(want.abs().max()), grad_floor * scale)
        assert float((grads[name] - want).abs().max()) <= tol, (case, name)


def test_clip_plan_splits_the_towers_on_disjoint_ranks():
    model, groups, training = PLANS["clip-disjoint-towers"]
    plan = make_plan(model, groups, **training)
    image = set(plan.group("image").ranks)
    text = set(plan.group("text").ranks)
    assert image.isdisjoint(text)

def sent_bytes_worker(ctx, job):
    from runtime.train import RankTrainer

    torch.manual_seed(job.seed)
    trainer = RankTrainer(ctx, job)
    try:
        trainer.run()
        return trainer.exchange.bytes_sent
    finally:
        trainer.close()


def test_equal_tp_stages_hand_over_by_scatter_gather_as_priced():
    """tp2 x pp2 (stages on ranks 0,1 and 2,3): each tp rank sends its counterpart half of every floating-point
    piece, forward and backward, and the receivers all-gather (Megatron's scatter/gather, which
    cost_models/pipeline.route_time prices); the losses matching the reference is test_plan_matches_single_process_
    reference[tp2xpp2]. Without it the leader (rank 0 / 2) would send a whole copy to each receiving tp rank."""
    from cost_models.pipeline import route_time
    from plans.stage_graph import stage_graph

    model, groups, training = PLANS["tp2xpp2"]
    plan = make_plan(model, groups, **training)
    job = Job(plan=plan, model=model, steps=1, seed=0)
    sent = launch(sent_bytes_worker, plan.world_size, job, timeout_s=120)
    assert sent[0] == sent[1] > 0 and sent[2] == sent[3] > 0  # every tp rank sends its part
    graph = stage_graph(plan)
    priced = sum(route_time(graph, r, plan.cluster)[1] for r in graph.routes)  # the pieces' bytes, per micro-batch
    m = training["micro_batches"]
    assert (sent[2] + sent[3]) / m == pytest.approx(priced, rel=0.01)  # gradients: once, in halves
    assert (sent[0] + sent[1]) / m == pytest.approx(priced, rel=0.01)  # activations: once, in halves
