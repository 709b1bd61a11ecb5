"""Where a plan's step goes (compute, exposed communication, offload, bubble per group and stage), and why one
plan beats another, in sentences derived from those numbers (`mmplan compare`, `mmplan solve`)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from cost_models.evaluate import Evaluation
from cost_models.offload import overlaps_compute
from plans.plan import Group, Plan

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


def _work(sc, micro_batches: int, hides: bool) -> tuple[float, float, float]:
    """(compute, comm, offload) seconds of one stage on one of its ranks for a whole step. The op time beyond compute
    and blocking TP comm is what transfers and ZeRO's gathers / reduce-scatters left exposed; offload counts only what
    the stage's tier transfers can account for (their time beyond the compute they hide behind, `hides`: on GPUs), the
    rest is ZeRO communication -- so a plan that offloads nothing shows no offload."""
    t = sc.time
    compute = micro_batches * (t.fwd + t.bwd) + sc.optimizer_s
    blocking = t.fwd_comm + t.bwd_comm
    comm = micro_batches * blocking + sc.grad_sync_s + sc.param_gather_s
    offload = 0.0
    for op_s, compute_s, op_comm, transfer in ((sc.fwd_s, t.fwd, t.fwd_comm, sc.transfer_fwd_s),
                                               (sc.bwd_s, t.bwd, t.bwd_comm, sc.transfer_bwd_s)):
        extra = max(0.0, op_s - compute_s - op_comm)
        tiers = min(extra, max(0.0, transfer - compute_s) if hides else transfer)
        offload += micro_batches * tiers
        comm += micro_batches * (extra - tiers)
    return compute, comm, offload


def breakdown(plan: Plan, evaluation: Evaluation) -> tuple[StageTime, ...]:
    """Per group and stage, where one step goes on its ranks (a rank hosting stages of several groups, as in
    colocated plans, counts all its work in each of them; its bubble is what is left of the step)."""
    step = evaluation.simulation.step_time_s
    fixed = evaluation.simulation.overhead_s  # the runtime's per-step cost: compute on every rank
    per_rank: dict[int, list[float]] = defaultdict(lambda: [fixed, 0.0, 0.0])
    stage_ranks = {}
    hides = overlaps_compute(plan.cluster)
    for sc in evaluation.stages:
        ranks = plan.group(sc.group).stages[sc.index].ranks
        stage_ranks[sc.group, sc.index] = ranks
        for r in ranks:
            for i, v in enumerate(_work(sc, sc.micro_batches, hides)):
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
    fixed = evaluation.simulation.overhead_s  # the runtime's per-step cost: compute on every rank
    per_rank: dict[int, list[float]] = defaultdict(lambda: [fixed, 0.0, 0.0])
    hides = overlaps_compute(plan.cluster)
    for sc in evaluation.stages:
        for r in plan.group(sc.group).stages[sc.index].ranks:
            for i, v in enumerate(_work(sc, sc.micro_batches, hides)):
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
    named = mechanisms(a if ta <= tb else b, b if ta <= tb else a)
    if named:
        out += f"; it saves {seconds_text(ts - tf)} per step with " + "; ".join(named)
    if gains:
        out += "; per GPU, " + " and ".join(f"{PART_TEXT[p]} falls from {seconds_text(ps[p])} to {seconds_text(pf[p])}"
                                           for _, p in gains[:2])
    out += "."
    if losses:
        out += " It pays " + " and ".join(f"{seconds_text(d)} more {PART_TEXT[p]}" for d, p in losses[:2]) + " for that."
    return out


def mechanisms(fast: Plan, slow: Plan) -> list[str]:
    """What `fast` does differently from `slow`, per group of `fast` (its blocks found in `slow`'s groups): placement
    (its own ranks, colocated, or a share of a pipeline stage), tp, dp, pipeline stages, ZeRO stage, recomputation,
    sequence parallelism, memory tiers; then the step shape (micro-batch, schedule). Empty when they are alike."""
    where = {b: (g, k) for g in slow.groups for k, st in enumerate(g.stages) for b in st.blocks}
    out = []
    for g in fast.groups:
        if g.blocks[0] not in where:
            continue
        h, k = where[g.blocks[0]]
        diffs = [d for d in (_placement(fast, g, h, k), *_degrees(g, h, where)) if d]
        if g.micro_batches is not None and fast.micro_batch_of(g) != slow.micro_batch_of(h):  # per-group step shape
            k = fast.micro_batches_of(g)
            diffs.append(f"a per-group micro-batch ({k} micro-batch{'es' * (k > 1)} of {fast.micro_batch_of(g)} samples)")
        if diffs:
            out.append(f"{g.name}: " + ", ".join(diffs))
    ta, tb = fast.training, slow.training
    shape = []
    if ta.micro_batch != tb.micro_batch:
        shape.append(f"{ta.micro_batch} samples per micro-batch instead of {tb.micro_batch}")
    if (ta.schedule, ta.virtual_stages) != (tb.schedule, tb.virtual_stages):
        shape.append(f"schedule {_schedule(ta)} instead of {_schedule(tb)}")
    return out + ([", ".join(shape)] if shape else [])


def plan_mechanisms(plan: Plan) -> list[str]:
    """The per-group mechanisms `plan` itself uses, one phrase each (none for a plan without them): a group's own
    micro-batch count (Group.micro_batches), a source running ahead of its sink (Group.lookahead), a colocated
    group's tasks in its host's pipeline bubbles (Group.fill_bubbles)."""
    reads = set(plan.flow.loss) if plan.flow is not None else set()
    loss = next((g.name for g in plan.groups if reads & set(g.blocks)), None)
    out = []
    for g in plan.groups:
        if g.micro_batches is not None:
            k, host = plan.micro_batches_of(g), f" beside {loss}'s {plan.training.micro_batches}" if loss and loss != g.name else ""
            out.append(f"per-group micro-batch count: {g.name} in {k} micro-batch{'es' * (k > 1)} of "
                       f"{plan.micro_batch_of(g)} samples{host}")
        if g.lookahead:
            out.append(f"encoder ahead: {g.name} runs {g.lookahead} micro-batch{'es' * (g.lookahead > 1)} ahead")
        if g.fill_bubbles:
            out.append(f"bubble filling: {g.name} in the pipeline bubbles of {g.colocated_with}")
    return out


def _schedule(training) -> str:
    return f"interleaved:{training.virtual_stages}" if training.virtual_stages > 1 else training.schedule


def _placement(fast: Plan, g: Group, h: Group, k: int) -> str:
    """Where group g of `fast` runs, against stage k of group h of the slower plan, which holds g's first block."""
    if len(fast.groups) == 1 or any(o.colocated_with == g.name for o in fast.groups):
        return ""  # one layout, or a group whose ranks colocated groups share: not on ranks of its own
    others = set(h.stages[k].blocks) - set(g.blocks)
    if g.colocated_with:
        return f"colocated on the ranks of {g.colocated_with}"
    if others and len(g.ranks) != len(h.stages[k].ranks):
        return f"on its own {len(g.ranks)} GPUs instead of sharing stage {k} of {h.name} ({len(h.stages[k].ranks)} GPUs)"
    return f"on its own {len(g.ranks)} GPUs" if others else ""


def _degrees(g: Group, h: Group, where: dict) -> list[str]:
    spanned = len({(where[b][0].name, where[b][1]) for b in g.blocks if b in where})
    out = [f"{name} {x} instead of {y}" for name, x, y in (("tp", g.tp, h.tp), ("dp", g.dp, h.dp)) if x != y]
    if g.pp != spanned:
        out.append(f"{g.pp} pipeline stage{'s' * (g.pp > 1)} instead of {spanned}")
    if g.zero != h.zero:
        out.append(f"ZeRO-{g.zero} instead of ZeRO-{h.zero}")
    mine, theirs = _activations(g, g.blocks), _activations(h, g.blocks)
    if mine != theirs:
        out.append(f"activations {mine} instead of {theirs}")
    if g.tp > 1 and g.sequence_parallel != (h.sequence_parallel and h.tp > 1):
        out.append("sequence parallelism " + ("on" if g.sequence_parallel else "off"))
    mine_tiers, their_tiers = _state_tiers(g), _state_tiers(h)
    if mine_tiers != their_tiers:
        out.append("parameters / gradients / optimizer state in " + "/".join(sorted(mine_tiers)) + " instead of "
                   + "/".join(sorted(their_tiers)))
    return out


def _state_tiers(g: Group) -> set[str]:
    """The tiers holding a group's parameters, gradients and optimizer state (gpu, cpu, nvme)."""
    return {t for s in g.stages for t in (s.memory.params, s.memory.grads, s.memory.optimizer)}


def _activations(g: Group, blocks) -> str:
    """Where group g keeps the saved activations of `blocks`, in words: kept, selective / full recompute, offloaded,
    or the mix of those."""
    acts = {b: t for s in g.stages for b, t in s.memory.activations.items()}
    words = {"keep": "kept", "selective": "selective recompute", "recompute": "full recompute"}
    kinds = sorted({words.get(acts.get(b, "keep"), acts.get(b, "keep")) for b in blocks})
    return kinds[0] if len(kinds) == 1 else "partly " + " / ".join(kinds)


def seconds_text(seconds: float) -> str:
    if seconds < 1e-9:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
