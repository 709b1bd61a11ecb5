"""The stage tail: gradient sync, optimizer step and parameter all-gather after a stage's last backward, per ZeRO stage."""
from __future__ import annotations

import pytest

from cost_models.comm import all_gather_time, all_reduce_time, reduce_scatter_time
from cost_models.compute import optimizer_step_time
from cost_models.hardware import catalog_cluster
from cost_models.tail import stage_tail, tail_over
from plans.plan import Group, Memory, Stage, Training

CLUSTER = catalog_cluster("16xh100-sxm")
PARAMS = 1e9


def group(zero: int, ranks: range) -> Group:
    return Group("g", dp=len(ranks) // 2, tp=2, pp=1, zero=zero, stages=(Stage(("b0",), tuple(ranks)),))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_tail_per_zero_stage(zero):
    training = Training(64, 8)
    tail = stage_tail(group(zero, range(16)), 0, PARAMS, training, CLUSTER)
    link, nbytes, dp = CLUSTER.inter_node, 2 * PARAMS, 8  # the dp group of tp-rank 0 spans both nodes
    sync = {0: all_reduce_time(nbytes, dp, link), 1: reduce_scatter_time(nbytes, dp, link)}.get(zero, 0.0)
    gather = all_gather_time(nbytes, dp, link) if zero in (1, 2) else 0.0
    step = optimizer_step_time(PARAMS / (dp if zero else 1), Memory(), CLUSTER)
    assert (tail.grad_sync, tail.optimizer, tail.param_gather) == (sync, step, gather)
    assert tail.total == sync + step + gather
    assert tail.bytes_sent == pytest.approx({0: 2, 1: 2, 2: 1, 3: 0}[zero] * 7 / 8 * nbytes)


def test_one_node_syncs_over_nvlink_and_tail_over_is_the_same_formula():
    training = Training(64, 8)
    inside = stage_tail(group(0, range(8)), 0, PARAMS, training, CLUSTER)
    assert inside == tail_over(PARAMS, dp=4, zero=0, memory=Memory(), link=CLUSTER.intra_node, cluster=CLUSTER)
    assert inside.grad_sync < stage_tail(group(0, range(16)), 0, PARAMS, training, CLUSTER).grad_sync
