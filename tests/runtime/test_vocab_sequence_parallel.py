"""Vocabulary parallelism, sequence parallelism and selective recompute: tp2 equals one process (CPU, gloo)."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn

from plans.plan import Memory, check_plan
from runtime.launch import RankContext, launch
from runtime.models.layers import TransformerLayer, recompute_attention_core
from runtime.reference import reference_run
from runtime.sequence_parallel import sequence_parallel_params, set_sequence_ends, sync_sequence_parallel_grads
from runtime.tensor_parallel import apply_tp, full_parameter_names
from runtime.train import Job, RankTrainer
from runtime.vocab_parallel import shard_embedding, vocab_parallel_cross_entropy
from tests.runtime.plan_builder import make_plan, profile

V, D, B, S = 12, 8, 2, 6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------- vocabulary
def vocab_worker(ctx: RankContext, reduction: str) -> dict:
    """Embedding -> head -> cross-entropy, full and vocabulary-parallel, on the same data."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(V, D), nn.Linear(D, V)
    ids = torch.randint(0, V, (B, S))
    target = torch.randint(0, V, (B * S,))
    target[3] = -100  # an ignored position
    grad_scale = torch.rand(B * S) if reduction == "none" else None

    def run(e: nn.Module, h: nn.Linear, loss_fn) -> dict:
        x = e(ids)  # (B, S, D)
        x.retain_grad()
        logits = h(torch.tanh(x)).flatten(0, 1)  # (B*S, V or V/tp)
        loss = loss_fn(logits, target, reduction=reduction)
        (loss * grad_scale).sum().backward() if grad_scale is not None else loss.backward()
        return {"loss": loss.detach(), "x": x.detach(), "x.grad": x.grad, "emb": e.weight.grad, "head.w": h.weight.grad,
                "head.b": h.bias.grad}

    full = run(copy.deepcopy(emb), copy.deepcopy(head), F.cross_entropy)
    group, r = dist.group.WORLD, ctx.rank
    e = copy.deepcopy(emb)
    assert shard_embedding(e, group, r, 2, V, {})
    h = copy.deepcopy(head)
    h.weight = nn.Parameter(h.weight.detach().chunk(2)[r].clone())
    h.bias = nn.Parameter(h.bias.detach().chunk(2)[r].clone())
    from runtime.vocab_parallel import VocabParallelHead

    h.__class__, h.vocab_start, h.group, h.out_features = VocabParallelHead, r * V // 2, group, V // 2

    def loss_fn(logits, target, reduction):
        return vocab_parallel_cross_entropy(logits, target, reduction=reduction, vocab_start=r * V // 2, vocab=V,
                                            group=group)

    return {"full": full, "tp": run(e, h, loss_fn)}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_embedding_head_and_loss_match_full(reduction):
    results = launch(vocab_worker, 2, reduction, timeout_s=60)
    for r, res in enumerate(results):
        full, tp = res["full"], res["tp"]
        for key in ("loss", "x", "x.grad"):
            assert rel_err(tp[key], full[key]) <= 1e-5, key
        rows = slice(r * V // 2, (r + 1) * V // 2)
        for key in ("emb", "head.w", "head.b"):
            assert rel_err(tp[key], full[key][rows]) <= 1e-5, key
    assert torch.equal(results[0]["tp"]["x.grad"], results[1]["tp"]["x.grad"])


# ----------------------------------------------------------------------------------------------- sequence
def sp_worker(ctx: RankContext, payload: tuple[str, bool]) -> dict:
    """Two layers (one run: slice in, gather out) with sequence parallelism vs the unsharded pair."""
    kind, selective = payload
    torch.manual_seed(0)
    if kind == "llama":
        make = lambda: TransformerLayer(D * 2, 4, 32, n_kv_heads=2, norm="rmsnorm", mlp="swiglu", causal=True,  # noqa: E731
                                        rotary=True, bias=False)
    else:
        make = lambda: TransformerLayer(D * 2, 4, 32, norm="layernorm", mlp="gelu", causal=True)  # noqa: E731
    full = nn.Sequential(make(), make())
    with torch.no_grad():
        for p in full.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = torch.randn(B, S, D * 2)
    grad_out = torch.randn(B, S, D * 2)

    def run(model: nn.Module) -> dict:
        xi = x.clone().requires_grad_()
        with recompute_attention_core() if selective else torch.enable_grad():
            out = model(xi)
        out.backward(grad_out)
        return {"out": out.detach(), "x.grad": xi.grad, "params": {n: p.grad for n, p in model.named_parameters()}}

    ref = run(full)
    sp = copy.deepcopy(full)
    group = dist.group.WORLD
    for i, layer in enumerate(sp):
        apply_tp(layer, group, ctx.rank, 2, sequence_parallel=True)
        set_sequence_ends(layer, group, scatter_in=i == 0, gather_out=i == 1)
    got = run(sp)
    return sharded_result(sp, ref, got, group)


def sharded_result(sp: nn.Module, ref: dict, got: dict, group) -> dict:
    """A worker's result: the reference and the sequence-parallel run, its layers' gradients synced over `group`,
    and where each sharded parameter sits in the full one."""
    sync_sequence_parallel_grads([p for layer in sp for p in sequence_parallel_params(layer)], group)
    got["params"] = {n: p.grad for n, p in sp.named_parameters()}
    shards = {f"{i}.{n}": info for i, layer in enumerate(sp) for n, info in full_parameter_names(layer).items()}
    return {"ref": ref, "got": got, "shards": shards}


def assert_matches_unsharded(res: dict) -> None:
    """Outputs, input gradients and every parameter gradient (its shard of the full one) equal the unsharded run's."""
    ref, got = res["ref"], res["got"]
    for key in ("out", "x.grad"):
        assert rel_err(got[key], ref[key]) <= 1e-5, key
    for name, grad in got["params"].items():
        want = ref["params"][name][res["shards"][name].full_slice()]
        if name.endswith("wk.bias"):  # zero in exact arithmetic: rounding noise only
            assert (grad - want).abs().max() <= 1e-5 * ref["params"][name.replace("bias", "weight")].abs().max()
        else:
            assert rel_err(grad, want) <= 1e-5, name


@pytest.mark.parametrize("kind,selective", [("gpt", False), ("llama", False), ("llama", True)])
def test_sequence_parallel_layers_match_unsharded(kind, selective):
    results = launch(sp_worker, 2, (kind, selective), timeout_s=60)
    for res in results:
        assert_matches_unsharded(res)
    assert torch.equal(results[0]["got"]["out"], results[1]["got"]["out"])


def forward_under(layers, h: torch.Tensor, tier: str) -> torch.Tensor:
    """`layers` applied in turn to `h` under an activation tier: keep, selective (the attention core recomputed) or
    recompute (each layer checkpointed whole)."""
    for layer in layers:
        if tier == "recompute":
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        else:
            with recompute_attention_core() if tier == "selective" else torch.enable_grad():
                h = layer(h)
    return h


def gather_count_worker(ctx: RankContext, tier: str) -> dict:
    """All-gathers in the forward and in the backward of a two-layer sequence-parallel run, per activation tier."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(TransformerLayer(D * 2, 4, 32, norm="layernorm", mlp="gelu", causal=True) for _ in range(2)))
    group = dist.group.WORLD
    for i, layer in enumerate(layers):
        apply_tp(layer, group, ctx.rank, 2, sequence_parallel=True)
        set_sequence_ends(layer, group, scatter_in=i == 0, gather_out=i == 1)
    calls, phase, all_gather = {"fwd": 0, "bwd": 0}, ["fwd"], dist.all_gather

    def counting(*args, **kwargs):
        calls[phase[0]] += 1
        return all_gather(*args, **kwargs)

    dist.all_gather = counting
    try:
        h = torch.randn(B, S, D * 2, requires_grad=True)
        h = forward_under(layers, h, tier)
        phase[0] = "bwd"
        h.sum().backward()
    finally:
        dist.all_gather = all_gather
    return calls


@pytest.mark.parametrize("tier", ["keep", "selective", "recompute"])
def test_sequence_parallel_backward_regathers_each_regions_input_under_every_tier(tier):
    """What compute.tp_collectives prices for sequence parallelism: per layer, the forward all-gathers each region's
    input (2); the backward all-gathers each region's output gradient (2) and re-gathers each region's saved input
    slice (2, compute.regather_time) -- under full recompute too, on top of the recomputed forward's 2. One more
    each way at the run's ends (the last layer's output gathered; the first layer's input-slice gradient)."""
    calls = launch(gather_count_worker, 2, tier, timeout_s=60)[0]
    layers = 2
    assert calls["fwd"] == 2 * layers + 1
    assert calls["bwd"] == (2 + 2 + (2 if tier == "recompute" else 0)) * layers + 1


# ----------------------------------------------------------------------------------------------- whole runs
def train_with_info(ctx: RankContext, job: Job) -> dict:
    torch.manual_seed(job.seed)
    trainer = RankTrainer(ctx, job)
    try:
        info = {k: (v.vocab_blocks, v.sequence_blocks) for k, v in trainer.stage_tp.items()}
        return {**trainer.run(), "info": info}
    finally:
        trainer.close()


def assert_matches_reference(losses: list[float], results: list[dict], ref: dict) -> None:
    """Every step's loss within 1e-5 relative of one process, and every parameter's gradient (gathered from the
    ranks' probes) within 1e-5 of its largest entry (or of 1e-3 of the largest gradient, for near-zero ones)."""
    for got, want in zip(losses, ref["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    grads = {k: v for r in results for k, v in r["grads"].items()}
    assert set(grads) == set(ref["grads"])
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    for name, want in ref["grads"].items():
        assert float((grads[name] - want).abs().max()) <= 1e-5 * max(float(want.abs().max()), 1e-3 * scale), name


def tiny_plan(*, sp: bool, tier: str | None = None, pp: int = 1, dp: int = 1):
    memory = Memory(activations={"*": tier} if tier else {})
    llm = [(["llm"], list(range(1, 1 + 2 * dp)), memory)] if pp == 1 else \
        [(["llm.embed", "llm.layers.0"], [1, 2], memory), (["llm"], [3, 4], memory)]
    plan = make_plan("tiny-vlm", [
        {"name": "vision", "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "llm", "tp": 2, "dp": dp, "stages": llm},
    ], micro_batches=2)
    groups = tuple(replace(g, sequence_parallel=sp) if g.name == "llm" else g for g in plan.groups)
    return check_plan(replace(plan, groups=groups), profile("tiny-vlm"))


@pytest.mark.parametrize("sp,tier,pp,dp", [(False, None, 1, 1), (True, None, 1, 1), (True, "selective", 1, 1),
                                           (True, "recompute", 1, 1), (True, "offload-cpu", 1, 1), (True, None, 2, 1),
                                           (True, None, 1, 2)])
def test_tiny_vlm_tp2_vocab_and_sequence_parallel_match_reference(sp, tier, pp, dp):
    plan = tiny_plan(sp=sp, tier=tier, pp=pp, dp=dp)
    # dp 2: the sequence-parallel partial gradients go through 4 KB buckets during the backward, then the tp sum
    job = Job(plan=plan, model="tiny-vlm", steps=3, seed=0, probe_grads=True, bucket_bytes=4096)
    ref = reference_run(job)
    results = launch(train_with_info, plan.world_size, job, timeout_s=120)
    if pp == 1:
        assert results[1]["info"]["llm/0"] == (["llm.embed", "llm.head"], ["llm.layers.0", "llm.layers.1"] if sp else [])
    else:  # the embedding on the first stage, the head and loss on the second; one sp layer on each
        assert results[1]["info"]["llm/0"] == (["llm.embed"], ["llm.layers.0"])
        assert results[3]["info"]["llm/1"] == (["llm.head"], ["llm.layers.1"])
    losses = [m["loss"] for m in results[0]["metrics"]]
    assert_matches_reference(losses, results, ref)


def test_checkpoint_of_a_vocab_and_sequence_parallel_run_resumes_under_tp1(tmp_path):
    """The sharded embedding/head (and their Adam state) are written unsharded: a tp1 plan continues exactly."""
    from runtime.train import train_rank

    sharded = tiny_plan(sp=True)
    first = Job(plan=sharded, model="tiny-vlm", steps=2, seed=0, checkpoint_every=2, checkpoint_dir=str(tmp_path))
    launch(train_rank, sharded.world_size, first, timeout_s=120)
    plain = make_plan("tiny-vlm", [
        {"name": "vision", "stages": [(["vision", "vision_proj"], [0])]},
        {"name": "llm", "stages": [(["llm"], [1])]},
    ], micro_batches=2)
    resumed = launch(train_rank, plain.world_size, replace(first, plan=plain, steps=3, checkpoint_every=0,
                                                           checkpoint_dir=None, resume=str(tmp_path)), timeout_s=120)
    want = reference_run(replace(first, plan=plain, steps=3))["losses"][2]
    (row,) = resumed[0]["metrics"]
    assert abs(row["loss"] - want) <= 1e-5 * abs(want)
