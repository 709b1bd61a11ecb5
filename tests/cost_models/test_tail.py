"""The stage tail: gradient sync, optimizer step and parameter all-gather after a stage's last backward, per ZeRO stage."""
from __future__ import annotations

import pytest

from cost_models.comm import all_gather_time, all_reduce_time, collective_link, reduce_scatter_time
from cost_models.fsdp import overlap_share
from cost_models.offload import optimizer_step_time
from cost_models.cluster_spec import catalog_cluster
from cost_models.tail import BUCKET_BYTES, stage_tail, tail_over
from plans.plan import Group, Memory, Stage, Training

CLUSTER = catalog_cluster("16xh100-sxm")
PARAMS = 1e9


def group(zero: int, ranks: range) -> Group:
    return Group("g", dp=len(ranks) // 2, tp=2, pp=1, zero=zero, stages=(Stage(("b0",), tuple(ranks)),))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_tail_per_zero_stage(zero):
    training = Training(64, 8)
    tail = stage_tail(group(zero, range(16)), 0, PARAMS, training, CLUSTER)
    # the dp group of tp-rank 0 (ranks 0, 2, .., 14) spans both nodes, 4 ranks on each: it leaves a node through 4 NICs
    link, nbytes, dp = collective_link(CLUSTER, range(0, 16, 2)), 2 * PARAMS, 8
    assert link.bandwidth == 4 * CLUSTER.inter_node.bandwidth
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


@pytest.mark.parametrize("zero", [0, 1])
def test_fp32_gradient_reduction_moves_twice_the_bytes_of_bf16(zero):
    # grad_bytes=4 (Megatron-LM reduces fp32 gradients of a bf16 model): the collective's volume doubles; nothing
    # else moves
    link = CLUSTER.inter_node
    bf16 = tail_over(PARAMS, dp=8, zero=zero, memory=Memory(), link=link, cluster=CLUSTER)
    fp32 = tail_over(PARAMS, dp=8, zero=zero, memory=Memory(), link=link, cluster=CLUSTER, grad_bytes=4)
    collective = all_reduce_time if zero == 0 else reduce_scatter_time
    assert fp32.grad_sync == collective(4 * PARAMS, 8, link)
    assert fp32.bytes_sent - bf16.bytes_sent == pytest.approx((2 if zero == 0 else 1) * 7 / 8 * 2 * PARAMS)
    assert (fp32.optimizer, fp32.param_gather) == (bf16.optimizer, bf16.param_gather)


def test_parameter_gather_ahead_of_the_next_forward_exposes_what_the_forward_does_not_hide():
    # gather_overlap_s (Megatron-LM's --overlap-param-gather): the ZeRO-1 all-gather hides behind that much of the
    # next forward, but its first bucket is waited for before the forward starts
    link, dp = CLUSTER.inter_node, 8
    full = all_gather_time(2 * PARAMS, dp, link)
    plain = tail_over(PARAMS, dp=dp, zero=1, memory=Memory(), link=link, cluster=CLUSTER)
    assert plain.param_gather == full
    some = tail_over(PARAMS, dp=dp, zero=1, memory=Memory(), link=link, cluster=CLUSTER, gather_overlap_s=full / 2)
    assert some.param_gather == pytest.approx(full / 2)
    hidden = tail_over(PARAMS, dp=dp, zero=1, memory=Memory(), link=link, cluster=CLUSTER, gather_overlap_s=10 * full)
    # all of it behind the forward: its first bucket, or the SMs it held from the forward's GEMMs, if longer
    assert hidden.param_gather == pytest.approx(max(all_gather_time(BUCKET_BYTES, dp, link), overlap_share(CLUSTER) * full))
    assert tail_over(PARAMS, dp=dp, zero=0, memory=Memory(), link=link, cluster=CLUSTER,
                     gather_overlap_s=full).param_gather == 0.0  # ZeRO 0 gathers nothing
