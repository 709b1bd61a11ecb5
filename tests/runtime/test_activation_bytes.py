"""The per-layer saved-activation measurement: exact counts for a tiny layer, equal to the runtime's own accounting."""
from __future__ import annotations

import pytest
import torch

from runtime.activation_bytes import LayerShape, korthikanti_table2, measure_layer, measure_option, table
from runtime.activations import ActivationTiers
from runtime.budget import DeviceBudget

GPT = LayerShape(hidden=64, heads=4, seq=16, micro_batch=2)  # mlp 4h, LayerNorm, GeLU, biases


def expected_gpt(shape: LayerShape, t: int, sp: bool, selective: bool) -> int:
    """Bytes a GPT layer saves in bf16 with the fused attention kernel, tensor by tensor (see activation_bytes)."""
    b, s, h, a = shape.micro_batch, shape.seq, shape.hidden, shape.heads
    act = 2  # bf16
    norm_rows = b * s // t if sp else b * s  # rows the norms see: a sequence slice under sp
    norms = 2 * (2 * norm_rows * h * act + 2 * norm_rows * act)  # per norm: input, output, bf16 mean and rstd
    qkv = 3 * b * s * h // t * act
    core_out = b * s * h // t * act  # saved by the kernel and (the same storage, a view) by the out-projection
    lse = 0 if selective else b * (a // t) * s * 4  # float32 log-sum-exp of the fused kernel
    mlp = 2 * b * s * 4 * h // t * act  # GeLU input and output
    return norms + qkv + core_out + lse + mlp


@pytest.mark.parametrize("t,sp,selective", [(1, False, False), (1, False, True), (2, False, False),
                                            (2, True, False), (2, True, True), (4, True, False)])
def test_tiny_gpt_layer_saves_exactly_the_expected_bytes(t, sp, selective):
    got = measure_layer(GPT, tp=t, sequence_parallel=sp, tier="selective" if selective else "keep")
    assert got.bytes == expected_gpt(GPT, t, sp, selective)


def test_full_recompute_keeps_the_input_only():
    got = measure_option(GPT, "full", 4)
    assert got.bytes == 2 * GPT.seq * GPT.micro_batch * GPT.hidden == korthikanti_table2(GPT, "full", 4)


@pytest.mark.parametrize("tier", ["keep", "selective", "recompute"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_measurement_equals_the_runtime_accounting_on_real_tensors(kind, tier):
    """The fake-tensor measurement counts what the runtime's activation tiers count while training (fp32, CPU)."""
    shape = LayerShape(hidden=32, heads=4, seq=8, micro_batch=2, kv_heads=2 if kind == "llama" else None, kind=kind)
    torch.manual_seed(0)
    layer = shape.build()
    x = torch.randn(2, 8, 32, requires_grad=True)
    budget = DeviceBudget()
    tiers = ActivationTiers(budget)
    out, saved = tiers.run_block(layer, (x,), {}, tier)
    assert measure_layer(shape, tier=tier, dtype=torch.float32).bytes == saved.saved_bytes
    out.sum().backward()
    tiers.close()


def test_sequence_parallel_and_selective_shrink_as_table_2_says():
    """GPT-3 175B's layer at t = 8 (h 12288, a 96, s 2048): the runtime's rows, in units of sbh."""
    rows = {r["option"]: r for r in table(LayerShape(hidden=12288, heads=96, seq=2048), 8)}
    sbh = {k: r["measured_sbh"] for k, r in rows.items()}
    assert sbh["tp"] == pytest.approx(8 + 24 / 8, abs=0.01)  # norms' inputs and outputs replicated
    assert sbh["tp+sp"] == pytest.approx(32 / 8, abs=0.01)
    assert sbh["tp+sp+selective"] == pytest.approx(32 / 8, abs=0.001)
    assert sbh["full"] == 2
    assert rows["tp+sp+selective"]["ratio"] == pytest.approx(32 / 34, abs=0.001)  # no dropout masks: 2sbh less


def _tp_saved(ctx, payload):
    """Bytes the runtime's keep / selective tier counts for one tp-sharded (and sequence-parallel) layer."""
    import torch.distributed as dist

    from runtime.sequence_parallel import set_sequence_ends
    from runtime.tensor_parallel import apply_tp

    shape, sp, tier = payload
    torch.manual_seed(0)
    layer = apply_tp(shape.build(), dist.group.WORLD, ctx.rank, 2, sequence_parallel=sp)
    if sp:
        set_sequence_ends(layer, dist.group.WORLD, scatter_in=False, gather_out=False)
    seq = shape.seq // 2 if sp else shape.seq
    x = torch.randn(shape.micro_batch, seq, shape.hidden, requires_grad=True)
    tiers = ActivationTiers(DeviceBudget())
    out, saved = tiers.run_block(layer, (x,), {}, tier)
    out.sum().backward()  # the re-gathered slices are valid in the backward
    tiers.close()
    return saved.saved_bytes


@pytest.mark.parametrize("sp,tier", [(False, "keep"), (True, "keep"), (True, "selective")])
def test_measurement_equals_the_runtime_accounting_under_tp2(sp, tier):
    from runtime.launch import launch

    shape = LayerShape(hidden=32, heads=4, seq=8, micro_batch=2, kv_heads=2, kind="llama")
    counted = launch(_tp_saved, 2, (shape, sp, tier), timeout_s=60)
    assert counted[0] == counted[1] == measure_layer(shape, tp=2, sequence_parallel=sp, tier=tier,
                                                     dtype=torch.float32).bytes
