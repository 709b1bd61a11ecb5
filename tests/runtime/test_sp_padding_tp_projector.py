"""Sequence parallelism on a sequence tp does not divide (padded, runtime/sequence_parallel.py) and tensor-parallel
projectors (runtime/tensor_parallel.py): tp2 equals one process (CPU, gloo)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plans.plan import Memory, check_plan
from runtime.launch import RankContext, launch
from runtime.models.layers import TransformerLayer
from runtime.models.projector import Projector
from runtime.reference import reference_run
from runtime.sequence_parallel import SequenceRun, set_sequence_ends
from runtime.tensor_parallel import apply_tp, full_parameter_names
from runtime.train import Job
from tests.runtime.plan_builder import make_plan, profile
from tests.runtime.test_vocab_sequence_parallel import (assert_matches_reference, assert_matches_unsharded, forward_under,
                                                      sharded_result, train_with_info)

B, S, D = 2, 7, 16  # 7 positions: tp=2 pads them to 8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def padded_worker(ctx: RankContext, tier: str) -> dict:
    """Two causal LLaMA layers, one sequence-parallel run over 7 positions, vs the unsharded pair."""
    torch.manual_seed(0)
    make = lambda: TransformerLayer(D, 4, 32, n_kv_heads=2, norm="layernorm", mlp="gelu", causal=True,  # noqa: E731
                                    rotary=True)
    full = nn.Sequential(make(), make())
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x, grad_out = torch.randn(B, S, D), torch.randn(B, S, D)

    def run(layers: nn.Module) -> dict:
        h = xi = x.clone().requires_grad_()
        h = forward_under(layers, h, tier)
        h.backward(grad_out)
        return {"out": h.detach(), "x.grad": xi.grad}

    ref = run(full)
    ref["params"] = {n: p.grad for n, p in full.named_parameters()}
    sp, group, seq_run = copy.deepcopy(full), dist.group.WORLD, SequenceRun()
    for i, layer in enumerate(sp):
        apply_tp(layer, group, ctx.rank, 2, sequence_parallel=True)
        set_sequence_ends(layer, group, scatter_in=i == 0, gather_out=i == 1, run=seq_run)
    got = run(sp)
    return sharded_result(sp, ref, got, group)


@pytest.mark.parametrize("tier", ["keep", "selective", "recompute"])
def test_sequence_parallel_pads_an_odd_sequence_exactly(tier):
    """Padded positions change nothing: outputs, input gradients and every parameter gradient equal the unsharded
    layers' (the norms and row-parallel biases included, whose gradients sum over the padded slices)."""
    for res in launch(padded_worker, 2, tier, timeout_s=60):
        assert res["got"]["out"].shape == (B, S, D)
        assert_matches_unsharded(res)


def projector_worker(ctx: RankContext, merge: int) -> dict:
    torch.manual_seed(0)
    full = Projector(8, 12, hidden=24, merge=merge)
    x, grad_out = torch.randn(B, 6, 8), torch.randn(B, 6 // merge, 12)

    def run(m: nn.Module) -> dict:
        xi = x.clone().requires_grad_()
        out = m(xi)
        out.backward(grad_out)
        return {"out": out.detach(), "x.grad": xi.grad, "params": {n: p.grad for n, p in m.named_parameters()}}

    ref = run(full)
    tp = apply_tp(copy.deepcopy(full), dist.group.WORLD, ctx.rank, 2)
    shapes = {n: tuple(p.shape) for n, p in tp.named_parameters()}
    return {"ref": ref, "got": run(tp), "shards": full_parameter_names(tp), "shapes": shapes}


@pytest.mark.parametrize("merge", [1, 2])
def test_projector_is_column_then_row_parallel(merge):
    for res in launch(projector_worker, 2, merge, timeout_s=60):
        assert res["shapes"]["fc1.weight"] == (12, 8 * merge) and res["shapes"]["fc2.weight"] == (12, 12)
        assert res["shards"]["fc1.weight"].dim == 0 and res["shards"]["fc2.weight"].dim == 1
        assert res["shards"]["fc2.bias"].dim is None
        for key in ("out", "x.grad"):
            assert rel_err(res["got"][key], res["ref"][key]) <= 1e-5, key
        for name, grad in res["got"]["params"].items():
            assert rel_err(grad, res["ref"]["params"][name][res["shards"][name].full_slice()]) <= 1e-5, name


# ----------------------------------------------------------------------------------------------- whole runs
def vision_tp_plan(*, sp: bool, tier: str | None = None):
    """tiny-vlm with its ViT (17 tokens: 16 patches and a class token) and projector at tp=2 on ranks 0-1, the LLM
    on rank 2."""
    memory = Memory(activations={"*": tier} if tier else {})
    plan = make_plan("tiny-vlm", [
        {"name": "vision", "tp": 2, "stages": [(["vision", "vision_proj"], [0, 1], memory)]},
        {"name": "llm", "stages": [(["llm"], [2])]},
    ], micro_batches=2)
    groups = tuple(replace(g, sequence_parallel=sp) if g.name == "vision" else g for g in plan.groups)
    return check_plan(replace(plan, groups=groups), profile("tiny-vlm"))


@pytest.mark.parametrize("sp,tier", [(True, None), (True, "recompute"), (False, None)])
def test_tiny_vlm_vision_tp2_padded_sequence_parallel_and_tp_projector_match_reference(sp, tier):
    """20 steps: the loss within 1e-5 relative of one process at every step; the projector sharded."""
    plan = vision_tp_plan(sp=sp, tier=tier)
    job = Job(plan=plan, model="tiny-vlm", steps=20, seed=0, probe_grads=True)
    ref = reference_run(job)
    results = launch(train_with_info, plan.world_size, job, timeout_s=240)
    layers = [b for b in plan.group("vision").blocks if b.startswith("vision.layers.")]
    assert results[0]["info"]["vision/0"] == ([], layers if sp else [])
    losses = [m["loss"] for m in results[2]["metrics"]] or [m["loss"] for m in results[0]["metrics"]]
    assert len(losses) == 20
    assert_matches_reference(losses, results, ref)
