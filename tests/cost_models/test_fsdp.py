"""cost_models/fsdp.py: FSDP2's per-block timing, its vectorised segment form, and what it exposes."""
import numpy as np
import pytest

from cost_models.catalog import CATALOG
from cost_models.fsdp import (gather_exposure, overlap_share, overlapped, pass_times, segment_gather_exposure,
                              segment_times)


@pytest.mark.parametrize("again", [True, False])
def test_segment_times_equal_pass_times_on_every_segment(again):
    rng = np.random.default_rng(0)
    n = 7
    f, b, g, r = (rng.uniform(0, 2, n) for _ in range(4))
    g[2] = r[4] = 0.0  # blocks without parameters
    sf, sb = segment_times(f, b, g, r, share=0.2, backward_gather=again, host_s=0.3)
    for i in range(n):
        for j in range(i + 1, n + 1):
            pf, pb = pass_times(f[i:j], b[i:j], g[i:j], r[i:j], share=0.2, backward_gather=again, host_s=0.3)
            assert sf[i, j] == pytest.approx(pf) and sb[i, j] == pytest.approx(pb)


def test_first_gather_and_last_reduce_scatter_are_exposed():
    fwd, bwd = pass_times([1.0] * 4, [2.0] * 4, [0.5] * 4, [0.25] * 4, share=0.0)
    assert fwd == pytest.approx(0.5 + 4.0)  # only the first gather shows
    assert bwd == pytest.approx(0.5 + 8.0 + 0.25)  # the first backward gather and the last reduce-scatter


def test_collectives_longer_than_compute_set_the_pace():
    fwd, _ = pass_times([0.1] * 4, [0.2] * 4, [1.0] * 4, [0.0] * 4, share=0.0)
    assert fwd == pytest.approx(4 * 1.0 + 0.1)


def test_overlap_slows_compute_by_the_sms_nccl_holds():
    share = overlap_share(CATALOG["h100-sxm"])
    assert share == pytest.approx(24 / 132)
    assert overlapped(1.0, 0.5, share) == pytest.approx(1.0 + 0.5 * share)
    assert overlapped(0.1, 0.5, share) == 0.5
    assert overlap_share(CATALOG["local-cpu"]) == 0.0


def test_no_backward_gather_without_reshard_after_forward():
    _, again = pass_times([1.0] * 3, [1.0] * 3, [3.0] * 3, [0.0] * 3, share=0.0)
    _, kept = pass_times([1.0] * 3, [1.0] * 3, [3.0] * 3, [0.0] * 3, share=0.0, backward_gather=False)
    assert kept == pytest.approx(3.0) and again > kept


def test_zero_1_2_gather_exposes_its_first_block_and_what_outlasts_the_compute():
    # ZeRO 1-2's gathers in the next first forward (fsdp.first_forward_gather): behind longer compute only the first
    # block's gather shows, plus the SMs NCCL holds beside each next block; shorter compute lets the gathers set the pace
    assert gather_exposure([1.0] * 4, [0.5] * 4, [0.0] * 4, share=0.0) == pytest.approx(0.5)
    assert gather_exposure([1.0] * 4, [0.5] * 4, [0.0] * 4, share=0.2) == pytest.approx(0.5 + 3 * 0.2 * 0.5)
    assert gather_exposure([0.1] * 4, [1.0] * 4, [0.0] * 4, share=0.0) == pytest.approx(4 * 1.0 + 0.1 - 0.4)
    # never more than the serial gather when the blocks' host floor does not bind
    assert gather_exposure([0.3, 0.1, 2.0], [0.5, 0.7, 0.2], [0.0] * 3, share=0.2) <= 1.4


def test_segment_gather_exposure_equals_gather_exposure_on_every_segment():
    rng = np.random.default_rng(1)
    n = 6
    f, g, r = (rng.uniform(0, 2, n) for _ in range(3))
    g[3] = r[1] = 0.0
    seg = segment_gather_exposure(f, g, r, share=0.2, host_s=0.5)
    for i in range(n):
        for j in range(i + 1, n + 1):
            assert seg[i, j] == pytest.approx(gather_exposure(f[i:j], g[i:j], r[i:j], share=0.2, host_s=0.5))
