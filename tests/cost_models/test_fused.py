"""The fused kernel flavour: a layer's saved bytes per op (Korthikanti et al. 2022 with flash attention), applied to
a profile's plain layers only; eager profiles are unchanged."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.fused import fused_layer_bytes, is_layer_of, shape_layer_params, with_kernels
from cost_models.memory import kept_activation_bytes
from plans.errors import MmplanError
from plans.graph import Block, Edge, ModelShape, Profile, load_profile, save_profile

GPT = ModelShape(group="llm", layers=2, hidden=1024, heads=16, ffn=4096, sequence=512, norm="layernorm", mlp="gelu",
                 dropout=True)
LLAMA = ModelShape(group="llm", layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, sequence=8192, norm="rmsnorm",
                   mlp="swiglu")


def test_gpt_layer_is_table_2_without_the_softmax_terms():
    # Korthikanti et al. 2022, Table 2: TP + selective recompute, sbh(10 + 24/t), per token and t = 1: 34h, plus
    # flash attention's fp32 logsumexp per head (4a) and the two LayerNorms' fp32 mean and rstd (2 x 8 bytes)
    h, a = GPT.hidden, GPT.heads
    saved = fused_layer_bytes(GPT, "bf16", dropout=True)
    assert saved.total == 34 * h + 4 * a + 16
    assert saved.replicated == 10 * h + 16  # norms' inputs 4h, QKV and fc1 inputs 4h, two dropout masks 2h
    assert saved.core == 4 * a
    assert fused_layer_bytes(GPT, "bf16", dropout=False).total == 32 * h + 4 * a + 16


def test_llama_layer_with_grouped_query_attention_and_swiglu():
    h, a, f, kv = 4096, 32, 14336, 8 * 128
    saved = fused_layer_bytes(LLAMA, "bf16")
    # norms 2 x (2h + 4), QKV and fc1 inputs 4h; Q, K, V 2(h + 2kv), O 2h, logsumexp 4a; SwiGLU 3 x 2f
    assert saved.total == 2 * (2 * h + 4) + 4 * h + 2 * (h + 2 * kv) + 2 * h + 4 * a + 6 * f
    assert saved.replicated == 2 * (2 * h + 4) + 4 * h
    assert fused_layer_bytes(LLAMA, "fp32").total > saved.total  # fp32 activations: 4 bytes per element


def test_incomplete_shape_is_refused_in_one_line():
    with pytest.raises(MmplanError, match="fused kernel flavour needs"):
        fused_layer_bytes(dataclasses.replace(GPT, norm=""), "bf16")


def _profile(shape: ModelShape) -> Profile:
    layer = int(shape_layer_params(shape))
    blocks = (Block("embed", "llm", "Embedding", 1000, 2000, 0.0, 0.0, 7.0, 5.0),
              *(Block(f"layers.{i}", "llm", "Layer", layer, 2 * layer, 1.0, 2.0, 48.0 * shape.hidden * shape.sequence,
                      5.0, supports_tp=True, sequence=shape.sequence, activation_replicated_bytes=11.0,
                      attention_core_bytes=3.0) for i in range(2)),
              Block("head", "llm", "Linear", 1000, 2000, 1.0, 2.0, 9.0, 5.0, supports_tp=True))
    names = [b.name for b in blocks]
    return Profile.build("m", "bf16", 1, blocks, tuple(Edge(a, b, 5.0) for a, b in zip(names, names[1:])),
                         shapes=(shape,))


def test_with_kernels_replaces_only_the_plain_layers(tmp_path):
    eager = _profile(GPT)
    assert eager.kernels == "eager" and with_kernels(eager, "eager") is eager
    fused = with_kernels(eager, "fused")  # dropout as the shape says (True)
    saved = fused_layer_bytes(GPT, "bf16", dropout=True)
    for before, after in zip(eager.blocks, fused.blocks):
        if before.name.startswith("layers."):
            assert after.activation_bytes == saved.total * 512
            assert after.activation_replicated_bytes == saved.replicated * 512
            assert after.attention_core_bytes == saved.core * 512
            # what one tp rank keeps: Table 2's sbh(10 + 24/t) (plus the statistics and the logsumexp's share)
            assert kept_activation_bytes(after, 8) == pytest.approx((saved.replicated + (saved.total - saved.replicated) / 8) * 512)
        else:
            assert after == before  # embeddings and heads keep their measured bytes
    assert fused.fingerprint == eager.fingerprint
    save_profile(fused, tmp_path / "f.json")
    save_profile(eager, tmp_path / "e.json")
    assert '"kernels": "fused"' in (tmp_path / "f.json").read_text()
    assert '"kernels"' not in (tmp_path / "e.json").read_text()  # omitted when eager: older readers see no change
    assert load_profile(tmp_path / "f.json") == fused
    with pytest.raises(MmplanError, match="cannot be turned back"):
        with_kernels(fused, "eager")
    with pytest.raises(MmplanError, match="kernels must be one of"):
        with_kernels(eager, "tensorrt")


def test_a_block_of_other_parameters_is_not_a_layer():
    block = _profile(GPT).blocks[1]
    assert is_layer_of(block, GPT)
    assert not is_layer_of(dataclasses.replace(block, params=int(block.params * 1.5)), GPT)  # e.g. cross-attention
    assert not is_layer_of(dataclasses.replace(block, group="vision"), GPT)


def test_frozen_layers_keep_their_measured_bytes():
    eager = _profile(GPT)
    frozen = dataclasses.replace(eager, blocks=tuple(dataclasses.replace(b, frozen=b.name == "layers.0") for b in eager.blocks))
    fused = with_kernels(frozen, "fused")
    assert fused.blocks[1] == frozen.blocks[1]  # profiled frozen: it saves only what earlier gradients need
    assert fused.blocks[2].activation_bytes != frozen.blocks[2].activation_bytes
