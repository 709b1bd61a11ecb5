"""Where a plan's step goes (compute, exposed communication, offload, bubble per group and stage), and why one
plan beats another, in sentences derived from those numbers (`mmplan compare`, `mmplan solve`)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from cost_models.evaluate import Evaluation
from plans.plan import Plan

PARTS = ("compute", "comm", "offload", "bubble")
PART_TEXT = {"compute": "compute", "comm": "exposed communication", "offload": "exposed offload", "bubble": "bubble"}


@dataclass(frozen=True, slots=True)
class StageTime:
    """Seconds of one step on a rank of a stage. compute: forward, backward (with recompute) and optimizer
    of every stage the rank hosts; comm: blocking TP collectives, gradient sync and ZeRO gathers not hidden
    behind compute; offload: waits on tier transfers and ZeRO streaming not hidden behind compute; bubble:
    the rest of the step (pipeline fill and drain, waits on other stages). The four add up to the step."""

    group: str
    stage: int
    ranks: int
    compute: float
    comm: float
    offload: float
    bubble: float


def _work(sc, micro_batches: int) -> tuple[float, float, float]:
    """(compute, comm, offload) seconds of one stage on one of its ranks for a whole step."""
    t = sc.time
    compute = micro_batches * (t.fwd + t.bwd) + sc.optimizer_s
    blocking = t.fwd_comm + t.bwd_comm
    comm = micro_batches * blocking + sc.grad_sync_s + sc.param_gather_s
    offload = max(0.0, micro_batches * (sc.fwd_s + sc.bwd_s - t.fwd - t.bwd - blocking))
    return compute, comm, offload


def breakdown(plan: Plan, evaluation: Evaluation) -> tuple[StageTime, ...]:
    """Per group and stage, where one step goes on its ranks (a rank hosting stages of several groups, as in
    colocated plans, counts all its work in each of them; its bubble is what is left of the step)."""
    step = evaluation.simulation.step_time_s
    m = plan.training.micro_batches
    fixed = evaluation.simulation.overhead_s  # the runtime's per-step cost: compute on every rank
    per_rank: dict[int, list[float]] = defaultdict(lambda: [fixed, 0.0, 0.0])
    stage_ranks = {}
    for sc in evaluation.stages:
        ranks = plan.group(sc.group).stages[sc.index].ranks
        stage_ranks[sc.group, sc.index] = ranks
        for r in ranks:
            for i, v in enumerate(_work(sc, m)):
                per_rank[r][i] += v
    out = []
    for sc in evaluation.stages:
        ranks = stage_ranks[sc.group, sc.index]
        c, k, o = (sum(per_rank[r][i] for r in ranks) / len(ranks) for i in range(3))
        out.append(StageTime(sc.group, sc.index, len(ranks), c, k, o, max(0.0, step - c - k - o)))
    return tuple(out)


def per_gpu(plan: Plan, evaluation: Evaluation) -> dict[str, float]:
    """The breakdown averaged over every rank of the plan: the four parts, which add up to the step time."""
    step = evaluation.simulation.step_time_s
    m = plan.training.micro_batches
    fixed = evaluation.simulation.overhead_s  # the runtime's per-step cost: compute on every rank
    per_rank: dict[int, list[float]] = defaultdict(lambda: [fixed, 0.0, 0.0])
    for sc in evaluation.stages:
        for r in plan.group(sc.group).stages[sc.index].ranks:
            for i, v in enumerate(_work(sc, m)):
                per_rank[r][i] += v
    n = max(len(per_rank), 1)
    parts = {p: sum(w[i] for w in per_rank.values()) / n for i, p in enumerate(PARTS[:3])}
    parts["bubble"] = max(0.0, step - sum(parts.values()))
    return parts


def why(a_name: str, a: Plan, a_eval: Evaluation, b_name: str, b: Plan, b_eval: Evaluation) -> str:
    """One or two sentences on why plan a is faster (or slower) than plan b, from their per-GPU breakdowns:
    the step-time ratio, then the parts whose change accounts for most of the difference."""
    ta, tb = a_eval.predicted.step_time_s, b_eval.predicted.step_time_s
    if not b_eval.predicted.fits and a_eval.predicted.fits:
        return f"{b_name} does not fit in GPU memory, {a_name} does."
    if ta <= 0 or tb <= 0:
        return f"{a_name} and {b_name} have no step time to compare."
    faster, slower, tf, ts, ef, es = (a_name, b_name, ta, tb, a_eval, b_eval) if ta <= tb else (b_name, a_name, tb, ta, b_eval, a_eval)
    pf = per_gpu(a if ta <= tb else b, ef)
    ps = per_gpu(b if ta <= tb else a, es)
    head = f"{faster} is {ts / tf:.2f}x faster than {slower} ({seconds_text(tf)} vs {seconds_text(ts)} per step)"
    if ts - tf < 1e-3 * ts:
        return f"{a_name} and {b_name} take the same time per step ({seconds_text(ta)})."
    deltas = sorted(((ps[p] - pf[p], p) for p in PARTS), reverse=True)
    gains = [(d, p) for d, p in deltas if d > 0.05 * (ts - tf)]
    losses = [(-d, p) for d, p in deltas if -d > 0.05 * (ts - tf)]
    out = head
    if gains:
        out += "; per GPU, " + " and ".join(f"{PART_TEXT[p]} falls from {seconds_text(ps[p])} to {seconds_text(pf[p])}"
                                           for _, p in gains[:2])
    out += "."
    if losses:
        out += " It pays " + " and ".join(f"{seconds_text(d)} more {PART_TEXT[p]}" for d, p in losses[:2]) + " for that."
    return out


def seconds_text(seconds: float) -> str:
    if seconds < 1e-9:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
