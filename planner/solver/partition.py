"""Pipeline cut points of one group's block chain: dynamic programming minimising the slowest stage."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# The DP table, built from the END of the chain so that one table serves every pipeline depth:
#
#   slowest[q][i] = the smallest possible time of the slowest stage when blocks [i, L) are split into
#                   q + 1 consecutive non-empty stages (the first of them has q stages after it), every
#                   stage within its memory limit; inf when no such split exists.
#
#   slowest[0][i] = cost(0)[i, L]
#   slowest[q][i] = min over i < j < L of  max(cost(q)[i, j], slowest[q-1][j])
#
# cost(q)[i, j] is the time of one stage made of blocks [i, j) that has q stages after it (so that its
# memory limit can depend on the micro-batches in flight there): inf when the stage cannot fit. The
# caller folds its per-stage choices (keep or recompute activations, the send of the stage's output)
# into cost(q); choice[q][i] remembers the argmin j (the smallest on ties), so the cut points of a
# p-stage split of the whole chain are read back from slowest[p - 1][0] in O(p).
# Cost: O(P * L^2) time and O(P * L) memory for all depths p <= P at once (Alpa's stage DP, Zheng et al.
# 2022 section 5.2, with the device-mesh dimension fixed by the caller).

StageCost = Callable[[int], np.ndarray]  # q -> (L+1, L+1) stage times, row i = first block, column j = end


@dataclass(frozen=True, slots=True)
class Partition:
    """A split of a chain of blocks into pipeline stages."""

    cuts: tuple[int, ...]  # block indices where stages 1..pp-1 start
    slowest: float  # time of the slowest stage

    @property
    def pp(self) -> int:
        return len(self.cuts) + 1


@dataclass(frozen=True, slots=True)
class CutTable:
    """slowest[q][i] and its argmin choice[q][i] (see the comment above) for q < max_stages."""

    slowest: np.ndarray  # (P, L+1)
    choice: np.ndarray  # (P, L+1) int

    @property
    def max_stages(self) -> int:
        return self.slowest.shape[0]

    def best(self, pp: int) -> Partition | None:
        """The min-max split of the whole chain into pp stages, or None if none fits."""
        if not 1 <= pp <= self.max_stages or not np.isfinite(self.slowest[pp - 1][0]):
            return None
        cuts, i = [], 0
        for q in range(pp - 1, 0, -1):
            i = int(self.choice[q][i])
            cuts.append(i)
        return Partition(tuple(cuts), float(self.slowest[pp - 1][0]))


def cut_table(num_blocks: int, cost: StageCost, max_stages: int) -> CutTable:
    """The DP table for splits of `num_blocks` blocks into at most `max_stages` stages."""
    n = num_blocks
    depth = max(1, min(max_stages, n))
    slowest = np.full((depth, n + 1), np.inf)
    choice = np.zeros((depth, n + 1), dtype=np.int64)
    slowest[0, :n] = cost(0)[:n, n]
    choice[0, :n] = n
    columns = np.arange(n + 1)
    for q in range(1, depth):
        c = cost(q)
        # max(cost[i, j], slowest[q-1][j]) for j < L only: the last stage is the one counted in slowest[q-1]
        table = np.maximum(c[:, :n], slowest[q - 1][None, :n])
        table[columns[:, None] >= columns[None, :n]] = np.inf  # stages are non-empty: j > i
        choice[q] = np.argmin(table, axis=1)
        slowest[q] = table[columns, choice[q]]
    return CutTable(slowest, choice)


def partition(num_blocks: int, cost: StageCost, pp: int) -> Partition | None:
    """The split of a chain into pp stages minimising its slowest stage (None when nothing fits)."""
    if pp > num_blocks:
        return None
    return cut_table(num_blocks, cost, pp).best(pp)


def reference_partition(num_blocks: int, cost: StageCost, pp: int) -> Partition | None:
    """Slow reference of partition(): every set of pp - 1 cut points, O(C(L-1, pp-1) * pp)."""
    if not 1 <= pp <= num_blocks:
        return None
    costs = [cost(q) for q in range(pp)]
    best: Partition | None = None
    for cuts in itertools.combinations(range(1, num_blocks), pp - 1):
        bounds = (0, *cuts, num_blocks)
        slowest = max(float(costs[pp - 1 - k][bounds[k], bounds[k + 1]]) for k in range(pp))
        if np.isfinite(slowest) and (best is None or slowest < best.slowest):
            best = Partition(cuts, slowest)
    return best
