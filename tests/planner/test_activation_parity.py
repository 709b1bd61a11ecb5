"""The cost model's saved-activation bytes of the runtime's own layer equal what the runtime saves, for every
activation option (no parallelism, TP, TP+SP, selective, full recompute): bench/memory_bench.runtime_layer_rows."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from memory_bench import runtime_layer_rows  # noqa: E402

from runtime.activation_bytes import LayerShape  # noqa: E402


@pytest.mark.parametrize("shape", [LayerShape(hidden=64, heads=4, seq=32),
                                   LayerShape(hidden=64, heads=4, seq=32, mlp=96, kv_heads=2, kind="llama")],
                         ids=["gpt", "llama"])
def test_cost_model_bytes_equal_the_runtime_saved_bytes_per_option(shape):
    rows = runtime_layer_rows(shape, 2)
    assert [r[0] for r in rows] == ["none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full recompute"]
    for option, predicted, measured in rows:
        if shape.kind == "llama" and "selective" in option:
            continue  # test_llama_selective_keeps_rotated_q_k_v below
        if shape.kind == "llama" and option not in ("none", "full recompute"):
            # Known residue: the rotary cos/sin tables (s x head_dim/2 each) are saved inside the attention region,
            # so the profile books them as sharded over tp, but every tp rank holds them whole: 2 x 32 x 8 x 2 B
            # / 2 = 512 B here (0.9 %), under 0.1 % of a real layer (s = 4096, head_dim 128).
            assert measured - 512 <= predicted <= measured, option
        else:
            assert predicted == pytest.approx(measured, rel=1e-9), option


@pytest.mark.xfail(strict=True, reason="known gap: under selective recompute the runtime keeps the core's inputs "
                   "(q and k after rotary, k and v expanded to every head for grouped-query attention), which the "
                   "profile books as attention core (saved in the region, not made by a Linear) and the cost model drops")
def test_llama_selective_keeps_rotated_q_k_v():
    shape = LayerShape(hidden=64, heads=4, seq=32, mlp=96, kv_heads=2, kind="llama")
    for option, predicted, measured in runtime_layer_rows(shape, 2):
        if "selective" in option:
            assert predicted == pytest.approx(measured, rel=2e-2), option
