"""Tensor parallelism of the zoo's blocks: sharded forward/backward equals the unsharded block (CPU, gloo)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plans.errors import MmplanError
from runtime.launch import RankContext, launch
from runtime.models.configs import DecoderConfig
from runtime.models.flamingo import FlamingoLayer
from runtime.models.layers import TransformerLayer
from runtime.tensor_parallel import (
    RowParallelLinear,
    apply_tp,
    check_tp,
    full_parameter_names,
    supports_tp,
)

B, S, T, D = 2, 6, 5, 32
RTOL = 1e-5


def build(kind: str) -> nn.Module:
    """A small block of each flavour, with every parameter randomised (norm weights and biases included)."""
    if kind == "llama":  # RMSNorm, SwiGLU, rotary, causal, GQA 4 heads / 2 kv heads, no biases
        block = TransformerLayer(
            D, 4, 64, n_kv_heads=2, norm="rmsnorm", mlp="swiglu", causal=True, rotary=True, bias=False
        )
    elif kind == "gpt":  # LayerNorm, GELU MLP, causal, biases everywhere
        block = TransformerLayer(D, 4, 128, norm="layernorm", mlp="gelu", causal=True)
    elif kind == "vit":  # bidirectional, 2 heads
        block = TransformerLayer(D, 2, 64, norm="layernorm", mlp="gelu")
    elif kind == "flamingo":  # gated cross-attention (GQA) + LLaMA self-attention layer
        cfg = DecoderConfig(
            type="llama", hidden=D, layers=1, heads=4, kv_heads=2, mlp=64, vocab=16, text_seq=S,
            cross_attention_every=1,
        )
        block = FlamingoLayer(cfg, cross_attention=True)
    else:
        raise AssertionError(kind)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return block


def forward_backward(block: nn.Module, kind: str, seed: int) -> dict:
    """Output, input gradients and parameter gradients of one forward/backward on seeded data."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, D, generator=gen).requires_grad_()
    context = torch.randn(B, T, D, generator=gen).requires_grad_()
    grad_out = torch.randn(B, S, D, generator=gen)
    out = block(x, context) if kind == "flamingo" else block(x)
    out.backward(grad_out)
    return {
        "out": out.detach(),
        "x.grad": x.grad,
        "context.grad": context.grad if kind == "flamingo" else None,
        "params": {n: p.grad for n, p in block.named_parameters()},
    }


def tp_worker(ctx: RankContext, payload: tuple[str, list[list[int]]]) -> dict:
    """Run the unsharded block and its tp-sharded copy on this rank's tp group; seed data by group."""
    kind, groups = payload
    torch.manual_seed(0)  # the same full block on every rank
    full = build(kind)
    block = copy.deepcopy(full)
    made = [dist.new_group(ranks) for ranks in groups]  # every rank creates every group, in the same order
    g = next(i for i, ranks in enumerate(groups) if ctx.rank in ranks)
    tp_rank = groups[g].index(ctx.rank)
    reference = forward_backward(full, kind, seed=100 + g)
    try:  # the wrong tp rank for this group is refused before anything changes
        apply_tp(block, made[g], 1 - tp_rank, len(groups[g]))
        refused = ""
    except MmplanError as exc:
        refused = str(exc)
    apply_tp(block, made[g], tp_rank, len(groups[g]))
    sharded = forward_backward(block, kind, seed=100 + g)
    return {
        "group": g, "refused": refused, "reference": reference, "sharded": sharded,
        "shards": full_parameter_names(block),
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check_rank(result: dict, kind: str) -> None:
    assert "but apply_tp was told tp=2" in result["refused"]
    ref, got = result["reference"], result["sharded"]
    keys = ["out", "x.grad"] + (["context.grad"] if kind == "flamingo" else [])
    for key in keys:
        assert rel_err(got[key], ref[key]) <= RTOL, key
    assert set(got["params"]) == set(ref["params"])
    for name, grad in got["params"].items():
        info = result["shards"][name]
        assert info.full_name == name and tuple(ref["params"][info.full_name].shape) == info.full_shape
        expected = ref["params"][info.full_name][info.full_slice()]
        assert grad.shape == expected.shape, name
        if name.endswith("wk.bias"):  # zero in exact arithmetic (softmax ignores a shift of all scores): rounding
            scale = ref["params"][name.replace("bias", "weight")].abs().max()  # noise, measured on wk's scale
            assert (grad - expected).abs().max() <= RTOL * scale, name
        else:
            assert rel_err(grad, expected) <= RTOL, name


def check_tp_ranks_agree(results: list[dict], kind: str) -> None:
    """Outputs, input gradients and replicated parameters' gradients are bitwise identical on the tp ranks."""
    first, *others = results
    for other in others:
        for key in ("out", "x.grad", "context.grad"):
            if kind == "flamingo" or key != "context.grad":
                assert torch.equal(other["sharded"][key], first["sharded"][key]), key
        for name, info in first["shards"].items():
            if info.dim is None:
                assert torch.equal(other["sharded"]["params"][name], first["sharded"]["params"][name]), name


@pytest.mark.parametrize("kind", ["llama", "gpt", "vit", "flamingo"])
def test_tp2_matches_unsharded_block(kind):
    results = launch(tp_worker, 2, (kind, [[0, 1]]), timeout_s=60)
    for result in results:
        check_rank(result, kind)
    check_tp_ranks_agree(results, kind)
    sharded = [n for n, i in results[0]["shards"].items() if i.dim is not None]
    assert sharded and all(results[1]["shards"][n].index == 1 for n in sharded)


def test_two_tp_groups_run_independently():
    results = launch(tp_worker, 4, ("llama", [[0, 1], [2, 3]]), timeout_s=60)
    assert [r["group"] for r in results] == [0, 0, 1, 1]
    for result in results:
        check_rank(result, "llama")
    check_tp_ranks_agree(results[:2], "llama")
    check_tp_ranks_agree(results[2:], "llama")
    assert not torch.allclose(results[0]["sharded"]["out"], results[2]["sharded"]["out"])  # different data


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (TransformerLayer(24, 3, 64), "heads=3"),
        (TransformerLayer(32, 4, 64, n_kv_heads=1, mlp="swiglu"), "kv_heads=1"),
        (TransformerLayer(32, 4, 65), "mlp width=65"),
    ],
)
def test_indivisible_sizes_are_rejected(block, message):
    with pytest.raises(MmplanError, match=f"TransformerLayer: tp=2 does not divide .*{message}"):
        check_tp(block, 2)
    with pytest.raises(MmplanError, match=message):
        apply_tp(block, None, 0, 2)  # raises before any communication
    check_tp(block, 1)


def test_flamingo_cross_attention_is_checked():
    cfg = DecoderConfig(type="llama", hidden=D, layers=1, heads=4, vocab=16, text_seq=S, cross_attention_every=1)
    with pytest.raises(MmplanError, match="FlamingoLayer: tp=8 does not divide cross.attn's heads=4"):
        check_tp(FlamingoLayer(cfg, cross_attention=True), 8)


def test_support_and_no_op():
    layer = TransformerLayer(D, 4, 64)
    assert supports_tp(layer) and not supports_tp(nn.Linear(2, 2))
    with pytest.raises(MmplanError, match="Linear does not support tensor parallelism"):
        check_tp(nn.Linear(2, 2), 2)
    assert apply_tp(layer, None, 0, 1) is layer
    assert not any(isinstance(m, RowParallelLinear) for m in layer.modules())
    infos = full_parameter_names(layer)
    assert set(infos) == {n for n, _ in layer.named_parameters()}
    assert all(i.dim is None and i.parts == 1 for i in infos.values())
