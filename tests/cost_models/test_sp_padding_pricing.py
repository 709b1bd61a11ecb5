"""Sequence parallelism priced at the padded length where tp does not divide the sequence; the tensor-parallel
projector priced as one region (cost_models/compute.py, memory.py; plans/capabilities.py)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.cluster_spec import parse_cluster
from cost_models.comm import all_gather_time, all_reduce_time, reduce_scatter_time
from cost_models.compute import _memory_share, regather_time, tp_collectives
from cost_models.memory import kept_activation_bytes
from plans.capabilities import sequence_parallel_padding
from plans.graph import Block

LAYER = Block("l", "vision", "TransformerLayer", 1000, 2000, 1.0, 2.0, activation_bytes=1700.0, output_bytes=340.0,
              supports_tp=True, activation_replicated_bytes=680.0, replicated_memory_fraction=0.4, sequence=17)
PROJ = Block("p", "vision_proj", "Projector", 1000, 2000, 1.0, 2.0, activation_bytes=500.0, output_bytes=340.0,
             supports_tp=True, activation_replicated_bytes=200.0, replicated_memory_fraction=0.3, sequence=17)
LINK = parse_cluster("8xa100-80g").intra_node


@pytest.mark.parametrize("sequence,tp,want", [(17, 2, 18 / 17), (577, 2, 578 / 577), (577, 8, 584 / 577),
                                              (16, 2, 1.0), (16, 1, 1.0), (0, 4, 1.0)])
def test_padding_factor_is_the_next_multiple_of_tp(sequence, tp, want):
    assert sequence_parallel_padding(sequence, tp) == pytest.approx(want)


def test_sequence_parallel_activations_are_held_padded():
    """What was replicated is split over tp but over 18 positions, not 17; an even sequence as before."""
    got = kept_activation_bytes(LAYER, 2, sequence_parallel=True)
    assert got == pytest.approx(680.0 * 18 / 17 / 2 + (1700.0 - 680.0) / 2)
    even = replace(LAYER, sequence=16)
    assert kept_activation_bytes(even, 2, sequence_parallel=True) == pytest.approx(1700.0 / 2)
    assert kept_activation_bytes(LAYER, 2) == pytest.approx(680.0 + 1020.0 / 2)


def test_sequence_parallel_collectives_and_norm_work_move_the_padded_sequence():
    size = 340.0 * 3 * 18 / 17
    fwd, bwd = tp_collectives(LAYER, 3, 2, LINK, sequence_parallel=True)
    gather, scatter = all_gather_time(size, 2, LINK), reduce_scatter_time(size, 2, LINK)
    assert fwd == pytest.approx(2 * (gather + scatter))
    assert bwd == pytest.approx(2 * (gather + scatter) + 2 * gather)
    assert regather_time(LAYER, 3, 2, LINK) == pytest.approx(2 * gather)
    assert _memory_share(LAYER, 2, True) == pytest.approx(0.4 * 18 / 17 / 2 + 0.6 / 2)
    assert _memory_share(LAYER, 2, False) == pytest.approx(0.4 + 0.6 / 2)


def test_projector_is_one_region_and_never_sequence_parallel():
    """fc1 column-, fc2 row-parallel: one all-reduce forward, one backward -- in a sequence-parallel group too (the
    runtime runs it plainly tensor-parallel), its activations and norm-free work as without sequence parallelism."""
    one = all_reduce_time(340.0 * 3, 2, LINK)
    for sp in (False, True):
        assert tp_collectives(PROJ, 3, 2, LINK, sequence_parallel=sp) == pytest.approx((one, one))
        assert kept_activation_bytes(PROJ, 2, sequence_parallel=sp) == pytest.approx(200.0 + 300.0 / 2)
        assert _memory_share(PROJ, 2, sp) == pytest.approx(0.3 + 0.7 / 2)
