"""GPU allocation across units: an ILP choosing one candidate layout (and so its GPU count) per unit, then concrete ranks."""
from __future__ import annotations

import functools
import heapq
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pulp

from planner.solver.bounds import Layout, boundary_bound, counted_bwd
from planner.solver.space import Unit, allowed_gpus
from planner.solver.structure import Structure
from plans.cluster import Cluster
from plans.errors import MmplanError

Solver = Literal["highs", "cbc"]

# Formulation. Units U: sources E feeding one sink s (or one chain unit). Candidates C_u of unit u come
# from planner/solver/candidates.py, each fixing m (micro-batches), tp, dp, pp, ZeRO stage, cut points and
# tiers, hence its GPU count g_c and the terms of its lower bound on the simulated step time.
#   x[u,c] in {0,1}: unit u takes candidate c;  y[m] in {0,1}: the step has m micro-batches;  T >= 0.
# (one)      sum_c x[u,c] = 1                                        for every unit u
# (batch)    sum_{c in C_u, m_c = m} x[u,c] = y[m] for every u, m;   sum_m y[m] = 1
#            (solved as one sub-ILP per m and sink (pp, tp, dp), which also makes (depth) hold and bnd exact:
#            the same optimum, far tighter relaxations)
# (depth)    1F1B: a source candidate sized for d downstream stages only with a sink of pp = d:
#            sum_{c in C_e, d_c not in {None, P}} x[e,c] + sum_{c in C_s, pp_c = P} x[s,c] <= 1   for e, P
# (gpus)     non-colocated: sum_u sum_c g_c x[u,c] <= N              (disjoint rank sets, run concurrently)
#            colocated: sum_c g_c x[e,c] = sum_c g_c x[s,c]          for every e (the same ranks)
# (memory)   colocated: sum_e sum_c gpu_c x[e,c] + sum_c maxgpu_c x[s,c] <= device memory (ranks hold both)
# (own)      T >= sum_c own_c x[u,c]                                  for every unit u
# (sink)     X_e = sum_c (fwd_out_c + bnd_c) x[e,c],  Y_e = sum_c (bwd_in_c + bnd_c) x[e,c]  (bnd: the boundary's
#            lower bound for source c and the sub-problem's sink tp, dp -- bounds.boundary_bound; non-colocated only)
#            T >= sum_c k2[e]_c x[s,c] + Y_e;   T >= sum_c k3[e]_c x[s,c] + X_e;
#            T >= sum_c k4[e][e']_c x[s,c] + X_e + Y_e'               for every e, e'
# (busy)     colocated: T >= sum_e sum_c busy_c x[e,c] + sum_c busy_c x[s,c]   (groups time-share the ranks: the work
#            on one rank's compute lane, a lower bound whether a source's tasks stop every sink stage at once or fill
#            each stage's idle slots apart, Group.fill_bubbles; the schedule's overlap is in the simulated step only)
# (exclude)  sum_{(u,c) in S} x[u,c] <= |U| - 1                       for every combination S already simulated
# minimise T: the min-max of the non-colocated pipeline of units (the slowest unit bounds the step, plus
# the boundaries' latencies), or the sum of colocated units' times. An encoder gets GPUs in proportion to
# what it takes to keep up with the LLM -- its compute density -- because any fewer would make it the
# bottleneck term and any more would be taken from the LLM's term (the modality-aware allocation).


@dataclass(frozen=True, slots=True)
class Choice:
    """One layout per unit (in unit order) and bounds of the step time.

    bound: a lower bound of this combination's simulated step (combined_bound); floor: a lower bound of
    every combination its sub-problem has not proposed yet (the ILP's optimum, proved when `optimal`)."""

    layouts: tuple[Layout, ...]
    bound: float
    floor: float
    optimal: bool = True


def solver_available(name: Solver) -> bool:
    return _solver(name, 1.0).available() is not False


def _solver(name: Solver, time_limit: float):
    """The pulp solver object; a relative gap of 1e-9 (defaults are 1e-4): the optimum is used as a lower bound."""
    if name == "highs":
        _silence_highs_banner()
        return pulp.HiGHS(msg=False, timeLimit=max(0.01, time_limit), gapRel=1e-9, gapAbs=0.0)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=max(1, math.ceil(time_limit)), gapRel=1e-9, gapAbs=0.0)


@functools.cache
def _silence_highs_banner() -> None:
    """highspy prints its banner on stdout when the process creates its first Highs object, before any
    option can turn output off; create that first one with stdout pointed at /dev/null (keeps --json clean)."""
    try:
        import highspy
    except ImportError:
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def pick_solver(name: Solver) -> Solver:
    """The requested ILP solver, or CBC when HiGHS (highspy) is not installed; an error if neither is."""
    if solver_available(name):
        return name
    if name == "highs" and solver_available("cbc"):
        return "cbc"
    raise MmplanError(f"the ILP solver {name!r} is not available here; install highspy (pip install highspy) or use --solver cbc")


def combined_bound(units: Sequence[Unit], layouts: Sequence[Layout], structure: Structure, cluster: Cluster) -> float:
    """The ILP's objective for one combination (the same terms, evaluated directly), and for colocated units the
    serial work of the least favourable sink stage's ranks (_colocated_ranks), which the ILP leaves out: a bound at
    least the ILP's floor."""
    if len(units) == 1:
        return layouts[0].bound.own
    sink = next(i for i, u in enumerate(units) if u.feeds)
    s = layouts[sink]
    sources = [i for i in range(len(units)) if i != sink]
    names = [f.producer for f in units[sink].feeds]
    x, y = [], []
    for f in names:
        e = next(i for i in sources if units[i].name == f)
        bnd = boundary_bound(layouts[e], s, cluster) if structure == "non-colocated" else 0.0
        x.append(layouts[e].bound.fwd_out + bnd)
        y.append(layouts[e].bound.bwd_in + bnd * layouts[e].bound.trained)
    b = s.bound
    terms = [lay.bound.own for lay in layouts]
    terms += [k + y[e] for e, k in enumerate(b.k2)]
    terms += [k + x[e] for e, k in enumerate(b.k3)]
    terms += [b.k4[e][f] + x[e] + y[f] for e in range(len(x)) for f in range(len(y))]
    if structure == "colocated":
        terms.append(sum(lay.bound.busy for lay in layouts))
        terms.append(_colocated_ranks(layouts, sink))
    return max(terms)


def _colocated_ranks(layouts: Sequence[Layout], sink: int) -> float:
    """Colocated ranks of sink stage k also run every (pp = 1) source stage, all on one compute lane: the
    forwards and backwards of all, then after the last of them (of stage s*) s*'s sync, optimizer and gather,
    or all optimizer steps and one gather -- whichever is larger for the least favourable s*."""
    m = layouts[sink].micro_batches
    src = [lay for i, lay in enumerate(layouts) if i != sink]
    fb = sum(m * (lay.fwd[0] + counted_bwd(lay)[0]) for lay in src)  # a frozen source runs forwards only
    s = layouts[sink]
    best = 0.0
    for k in range(s.pp):
        tails = [lay.tail[0] for lay in src] + [s.tail[k]]
        opts = sum(lay.optimizer[0] for lay in src) + s.optimizer[k]
        gathers = [lay.gather[0] for lay in src] + [s.gather[k]]
        best = max(best, fb + m * (s.fwd[k] + counted_bwd(s)[k]) + max(min(tails), opts + min(gathers)))
    return best


class Allocator:
    """The ILP above for one structure, decomposed into sub-problems that fix m (so (batch) holds), the sink's
    pp (so (depth) holds: its sources' candidates are those sized for that depth), the sink's tp and dp (so the
    boundaries' bound is a constant per source candidate) and, for colocated units, the shared rank count;
    each sub-ILP is re-solved with every simulated combination excluded. next() returns combinations in non-decreasing order of bound: sub-problems wait in
    a heap keyed by a bound valid for all their combinations (the largest of the units' smallest `own`
    terms) and are solved only when they reach the top. A branch-and-bound driver stops once the next bound
    reaches the best simulated step. One unit: the ILP reduces to sorting by the bound."""

    def __init__(self, units: Sequence[Unit], candidates: Sequence[Sequence[Layout]], structure: Structure,
                 cluster: Cluster, solver: Solver = "highs", enumerate_limit: int | None = None):
        self.units, self.structure, self.cluster, self.solver = tuple(units), structure, cluster, solver
        self.enumerate_limit = ENUMERATE_LIMIT if enumerate_limit is None else enumerate_limit
        self.size = sum(len(c) for c in candidates)
        self.solves, self.solve_s = 0, 0.0
        buckets: dict[tuple, list[list[Layout]]] = {}
        sink = next((i for i, u in enumerate(units) if u.feeds), None)
        if sink is None:  # one unit: a sub-problem per m
            for lay in candidates[0]:
                buckets.setdefault((lay.micro_batches,), [[]])[0].append(lay)
        else:  # a sub-problem per m, sink pp (and shared rank count when colocated)
            def base(lay: Layout) -> tuple:
                return (lay.micro_batches, lay.gpus) if structure == "colocated" else (lay.micro_batches,)

            shapes: dict[tuple, set[tuple[int, int, int]]] = {}  # base -> sink (pp, tp, dp)
            for lay in candidates[sink]:
                shape = (lay.pp, lay.tp, lay.dp)
                buckets.setdefault((*base(lay), *shape), [[] for _ in units])[sink].append(lay)
                shapes.setdefault(base(lay), set()).add(shape)
            for u, lays in enumerate(candidates):
                if u == sink:
                    continue
                for lay in lays:
                    for shape in shapes.get(base(lay), ()):
                        if lay.downstream is None or lay.downstream == shape[0]:
                            buckets[(*base(lay), *shape)][u].append(lay)
        self._heap: list[tuple[float, int, object]] = []
        self._tick = 0
        self._owner: dict[int, _SubProblem] = {}  # id of a proposed Choice -> the sub-problem that proposed it
        for key, cands in sorted(buckets.items()):
            if all(cands):
                self._push(max(min(lay.bound.own for lay in c) for c in cands), _SubProblem(self, cands))

    def _push(self, bound: float, item: object) -> None:
        heapq.heappush(self._heap, (bound, self._tick, item))
        self._tick += 1

    def next(self, time_limit: float = 60.0) -> Choice | None:
        """The combination of smallest bound not excluded yet, or None when none is left."""
        deadline = time.perf_counter() + time_limit
        while self._heap:
            _, _, item = self._heap[0]
            if isinstance(item, Choice):
                return item
            heapq.heappop(self._heap)
            choice = item.solve(max(0.01, deadline - time.perf_counter()))
            if choice is not None:
                self._push(choice.floor, choice)
                self._owner[id(choice)] = item
        return None

    def exclude(self, choice: Choice) -> None:
        """Remove a combination (after it has been simulated); its sub-problem goes back to wait its turn."""
        _, _, item = heapq.heappop(self._heap)
        assert item is choice
        sub = self._owner.pop(id(choice))
        sub.exclude(choice)
        self._push(choice.floor, sub)  # its next solution is no better than this one


# A sub-problem of at most this many combinations is not solved as an ILP: its objective is evaluated for every
# combination at once (numpy, the same terms and constraints) and the combinations are proposed in that order -- the
# same sequence of optima, exact, where HiGHS re-solving the sub-ILP with each exclusion added took 25-80 ms a solve
# (tiny-avlm on 8 GPUs: 447 solves of 450-combination colocated sub-problems, 7.9 s of an 11.7 s solve).
ENUMERATE_LIMIT = 200_000


class _SubProblem:
    """One sub-ILP of an Allocator: candidates of one m (and shared rank count), as in the formulation."""

    def __init__(self, alloc: Allocator, candidates: list[list[Layout]]):
        self.alloc, self.candidates = alloc, candidates
        self.units, self.structure = alloc.units, alloc.structure
        self._prob = None  # the sub-ILP, built on its first solve (most sub-problems are never solved)
        self._order = None  # or, for a small one, every feasible combination by objective (_enumerate)
        if len(self.units) == 1:
            self._order = sorted(candidates[0], key=lambda lay: lay.bound.own)
            self._next = 0

    def _terms(self) -> np.ndarray:
        """The sub-ILP's objective for every combination (one array axis per unit, its candidates along it): the max
        of its (own), (busy) and (sink) terms, +inf where the combination breaks (gpus) or (memory)."""
        units, cands, cl = self.units, self.candidates, self.alloc.cluster
        n = len(units)

        def axis(u: int, values) -> np.ndarray:
            return np.asarray(values, dtype=float).reshape([-1 if i == u else 1 for i in range(n)])

        sink = next(i for i, u in enumerate(units) if u.feeds)
        sources = [i for i in range(n) if i != sink]
        T = np.zeros([len(c) for c in cands])
        for u in range(n):
            T = np.maximum(T, axis(u, [lay.bound.own for lay in cands[u]]))
        if self.structure == "non-colocated":
            used = sum(axis(u, [lay.gpus for lay in cands[u]]) for u in range(n))
            feasible = used <= cl.world_size
        else:
            held = sum(axis(u, [max(lay.gpu_bytes) for lay in cands[u]]) for u in range(n))
            feasible = held <= cl.device.memory_bytes
            T = np.maximum(T, sum(axis(u, [lay.bound.busy for lay in cands[u]]) for u in range(n)))
        own_ranks = self.structure == "non-colocated"
        feeds = [next(e for e in sources if units[e].name == f.producer) for f in units[sink].feeds]
        head, cs = cands[sink][0], cands[sink]
        X, Y = [], []
        for e in feeds:
            bnd = [boundary_bound(lay, head, cl) if own_ranks else 0.0 for lay in cands[e]]
            X.append(axis(e, [lay.bound.fwd_out + b for lay, b in zip(cands[e], bnd)]))
            Y.append(axis(e, [lay.bound.bwd_in + b * lay.bound.trained for lay, b in zip(cands[e], bnd)]))
        for i in range(len(feeds)):
            T = np.maximum(T, axis(sink, [_finite(lay.bound.k2[i]) for lay in cs]) + Y[i])
            T = np.maximum(T, axis(sink, [_finite(lay.bound.k3[i]) for lay in cs]) + X[i])
            for j in range(len(feeds)):
                T = np.maximum(T, axis(sink, [_finite(lay.bound.k4[i][j]) for lay in cs]) + X[i] + Y[j])
        return np.where(feasible, T, np.inf)

    def _enumerate(self) -> None:
        T = self._terms().ravel()
        order = np.argsort(T, kind="stable")
        order = order[np.isfinite(T[order])]
        self._order, self._objective, self._next = order, T, 0

    def _enumerated(self) -> Choice | None:
        if self._next >= len(self._order):
            return None
        flat = int(self._order[self._next])
        picked = np.unravel_index(flat, [len(c) for c in self.candidates])
        layouts = tuple(cu[int(c)] for cu, c in zip(self.candidates, picked))
        floor = float(self._objective[flat])
        return Choice(layouts, max(floor, combined_bound(self.units, layouts, self.structure, self.alloc.cluster)), floor)

    def _build(self) -> None:
        units, cands, cl = self.units, self.candidates, self.alloc.cluster
        prob = pulp.LpProblem("allocate", pulp.LpMinimize)
        T = prob.add_variable("T", lowBound=0)
        prob += T
        x = [[prob.add_variable(f"x_{u}_{c}", cat="Binary") for c in range(len(cands[u]))] for u in range(len(units))]
        self._x = x
        sink = next(i for i, u in enumerate(units) if u.feeds)
        sources = [i for i in range(len(units)) if i != sink]
        for u in range(len(units)):
            prob += pulp.lpSum(x[u]) == 1, f"one_{u}"
        if self.structure == "non-colocated":
            prob += pulp.lpSum(lay.gpus * v for u in range(len(units)) for v, lay in zip(x[u], cands[u])) <= cl.world_size, "gpus"
        else:  # colocated: every candidate of the sub-problem has the same rank count
            prob += pulp.lpSum(max(lay.gpu_bytes) * v for u in range(len(units)) for v, lay in zip(x[u], cands[u])) \
                <= cl.device.memory_bytes, "memory"
            prob += T >= pulp.lpSum(lay.bound.busy * v for u in range(len(units)) for v, lay in zip(x[u], cands[u])), "busy"
        for u in range(len(units)):
            prob += T >= pulp.lpSum(lay.bound.own * v for v, lay in zip(x[u], cands[u])), f"own_{u}"
        own_ranks = self.structure == "non-colocated"
        feeds = [next(e for e in sources if units[e].name == f.producer) for f in units[sink].feeds]
        head = cands[sink][0]  # every sink candidate of the sub-problem has the same tp and dp
        bnd = [[boundary_bound(lay, head, cl) if own_ranks else 0.0 for lay in cands[e]] for e in range(len(units))]
        X = [pulp.lpSum((lay.bound.fwd_out + bnd[e][c]) * v for c, (v, lay) in enumerate(zip(x[e], cands[e]))) for e in feeds]
        Y = [pulp.lpSum((lay.bound.bwd_in + bnd[e][c] * lay.bound.trained) * v for c, (v, lay) in enumerate(zip(x[e], cands[e])))
             for e in feeds]
        xs, cs = x[sink], cands[sink]
        for i in range(len(feeds)):
            prob += T >= pulp.lpSum(_finite(lay.bound.k2[i]) * v for v, lay in zip(xs, cs)) + Y[i], f"sink_k2_{i}"
            prob += T >= pulp.lpSum(_finite(lay.bound.k3[i]) * v for v, lay in zip(xs, cs)) + X[i], f"sink_k3_{i}"
            for j in range(len(feeds)):
                prob += T >= pulp.lpSum(_finite(lay.bound.k4[i][j]) * v for v, lay in zip(xs, cs)) + X[i] + Y[j], f"sink_k4_{i}_{j}"
        self._prob, self._excluded = prob, 0

    def solve(self, time_limit: float) -> Choice | None:
        if len(self.units) == 1:
            if self._next >= len(self._order):
                return None
            lay = self._order[self._next]
            return Choice((lay,), lay.bound.own, lay.bound.own)
        if self._order is None and self._prob is None and math.prod(len(c) for c in self.candidates) <= self.alloc.enumerate_limit:
            self._enumerate()
        if self._order is not None:
            return self._enumerated()
        if self._prob is None:
            self._build()
        start = time.perf_counter()
        status = self._prob.solve(_solver(self.alloc.solver, time_limit))
        self.alloc.solves += 1
        self.alloc.solve_s += time.perf_counter() - start
        if self._prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) or status != pulp.LpStatusOptimal:
            return None
        picked = tuple(next(c for c, v in enumerate(xu) if (v.value() or 0) > 0.5) for xu in self._x)
        layouts = tuple(cu[c] for cu, c in zip(self.candidates, picked))
        self._picked = picked
        floor = float(pulp.value(self._prob.objective))
        return Choice(layouts, max(floor, combined_bound(self.units, layouts, self.structure, self.alloc.cluster)), floor,
                      optimal=self._prob.sol_status == pulp.LpSolutionOptimal)

    def exclude(self, choice: Choice) -> None:
        if self._order is not None:  # one unit, or enumerated: the next in order
            self._next += 1
            return
        picked = [xu[c] for xu, c in zip(self._x, self._picked)]  # the choice the last solve proposed
        self._prob += pulp.lpSum(picked) <= len(picked) - 1, f"exclude_{self._excluded}"
        self._excluded += 1


def _finite(v: float) -> float:
    """-inf terms (a feed entering after the stage) drop out of the max: any value below the others works."""
    return v if math.isfinite(v) else -1e9


# --- concrete ranks --------------------------------------------------------------------------------------


def assign_ranks(layouts: Sequence[Layout], structure: Structure, cluster: Cluster) -> tuple[tuple[int, ...], ...] | None:
    """Ranks of each unit in Megatron order (tp fastest, then dp, then pp), or None when they do not pack.

    non-colocated: disjoint contiguous ranges, the largest unit first, so that units of whole nodes start at a
    node's first rank and smaller ones (dividing a node) pack inside one node; every TP group stays in a node.
    colocated / chain: every unit on ranks 0..n-1.
    """
    if structure != "non-colocated":
        return tuple(tuple(range(lay.gpus)) for lay in layouts)
    order = sorted(range(len(layouts)), key=lambda u: (-layouts[u].gpus, -layouts[u].tp, u))
    offset, out = 0, [()] * len(layouts)
    g = cluster.gpus_per_node
    for u in order:
        lay = layouts[u]
        if not allowed_gpus(lay.gpus, cluster) or offset % lay.tp:
            return None
        if lay.gpus <= g and offset // g != (offset + lay.gpus - 1) // g:
            return None  # a group smaller than a node must not straddle two
        out[u] = tuple(range(offset, offset + lay.gpus))
        offset += lay.gpus
    if offset > cluster.world_size:
        return None
    return tuple(out)
