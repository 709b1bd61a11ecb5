"""The cut-point DP (planner/solver/partition.py) against its brute-force reference on seeded random stage costs."""
from __future__ import annotations

import numpy as np
import pytest

from planner.solver.partition import cut_table, partition, reference_partition


def random_costs(rng: np.random.Generator, n: int, depths: int, *, holes: float) -> list[np.ndarray]:
    """Per depth q a (n+1, n+1) matrix of stage times: the sum of random block times plus a random send at the
    cut, growing with q like a memory-limited stage would; a fraction `holes` of segments does not fit (inf),
    more of them for stages with more stages after them (more micro-batches in flight)."""
    block = rng.uniform(0.1, 10.0, n)
    prefix = np.concatenate(([0.0], np.cumsum(block)))
    send = np.concatenate(([0.0], rng.uniform(0.0, 2.0, n - 1), [0.0]))
    base = prefix[None, :] - prefix[:, None] + send[None, :]
    out = []
    for q in range(depths):
        c = base * (1 + 0.05 * q) + rng.uniform(0.0, 0.5, base.shape)
        c[rng.uniform(size=c.shape) < holes * (1 + q / depths)] = np.inf
        c[np.arange(n + 1)[:, None] >= np.arange(n + 1)[None, :]] = np.inf
        out.append(c)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_the_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 11))
    depths = int(rng.integers(1, n + 1))
    costs = random_costs(rng, n, depths, holes=float(rng.choice([0.0, 0.1, 0.3])))
    table = cut_table(n, lambda q: costs[q], depths)
    for pp in range(1, depths + 1):
        want = reference_partition(n, lambda q: costs[q], pp)
        got = table.best(pp)
        assert (got is None) == (want is None), (pp, got, want)
        if got is None:
            continue
        assert got.slowest == pytest.approx(want.slowest, rel=1e-12)
        # the cut points read back achieve the value: every stage fits and none is slower
        bounds = (0, *got.cuts, n)
        assert list(bounds) == sorted(set(bounds)) and got.pp == pp
        stages = [costs[pp - 1 - k][bounds[k], bounds[k + 1]] for k in range(pp)]
        assert max(stages) == pytest.approx(got.slowest, rel=1e-12)
        assert partition(n, lambda q: costs[q], pp) == got


def test_one_table_serves_every_depth():
    rng = np.random.default_rng(7)
    costs = random_costs(rng, 12, 6, holes=0.0)
    table = cut_table(12, lambda q: costs[q], 6)
    assert [table.best(p).pp for p in range(1, 7)] == list(range(1, 7))
    slowest = [table.best(p).slowest for p in range(1, 7)]
    assert table.best(7) is None and partition(3, lambda q: costs[q], 4) is None  # deeper than the table / the chain
    assert slowest[0] == pytest.approx(costs[0][0, 12])


def test_balances_equal_blocks_and_respects_memory():
    # 8 equal blocks in 4 stages: 2 each. Then forbid stages of more than one block at depth q >= 2 (the first
    # stages hold more micro-batches): the split must put single blocks first.
    n = 8
    prefix = np.arange(n + 1, dtype=float)
    base = prefix[None, :] - prefix[:, None]
    base[base <= 0] = np.inf
    assert partition(n, lambda q: base, 4).cuts == (2, 4, 6)
    limited = base.copy()
    limited[base > 1] = np.inf

    def cost(q: int) -> np.ndarray:
        return limited if q >= 2 else base

    best = partition(n, cost, 4)
    assert best.cuts[:2] == (1, 2) and best.slowest == 3.0
    assert reference_partition(n, cost, 4).slowest == 3.0
