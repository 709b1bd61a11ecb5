"""bench/memory_bench.py's Megatron-LM table: the reimplemented theoretical memory on a hand-checked config, and (slow)
every row within the must-show's +-10 % of mmplan's prediction under the matching options."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import memory_bench as mb  # noqa: E402


def test_theoretical_memory_of_a_small_gpt_by_hand():
    # theoretical_memory_usage.py for h 1024, 4 layers, vocab 1000, tp 2, pp 2, dp 4, seq 128, micro-batch 1, 8
    # micro-batches, SP + selective: a layer 2h(4h + 2) + 2h^2 * 2 = 12h^2 + 4h parameters; the most loaded shard
    # ((4 layers + the final norm) / pp + the embedding) / tp, at 6 + 12/4 bytes each (distributed optimizer)
    run = mb.MegatronRun("small", 4, 1024, 16, 4096, 1000, 128, tp=2, pp=2, dp=4, micro_batches=8, sp_selective=True)
    h = 1024
    block = 4 * (12 * h * h + 4 * h) + 2 * h
    weights, act = mb.megatron_theoretical(run)
    assert weights == ((block / 2 + h * 1000) / 2) * 9
    # activations: sbh (18 + 4 * 4) per layer x all 4 layers + 8 s p + s h p, over tp (pp > 1: no output layer term)
    assert act == (128 * h * 34 * 4 + 8 * 128 * 2 + 128 * h * 2) / 2


@pytest.mark.slow
def test_every_megatron_row_is_within_ten_percent():
    assert mb.megatron_table() == 0
