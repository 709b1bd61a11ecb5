"""Compute by op class, vocabulary-parallel blocks, activations as TP stores them, the bucketed gradient sync."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.comm import all_reduce_time
from cost_models.compute import block_time, gemm_kernels_time, gemm_time, memory_time
from cost_models.cluster_spec import catalog_cluster
from cost_models.hardware import stream_bandwidth
from cost_models.memory import kept_activation_bytes
from cost_models.tail import BUCKET_BYTES, tail_over
from plans.graph import Block
from plans.plan import Memory

S, H, A = 2048, 4096, 32
SBH = S * H


def layer(**kw) -> Block:
    """A GPT layer per sample with Korthikanti's activations: 10 sbh replicated, 24 sbh sharded, 5as^2 core."""
    fields = dict(name="l", group="g", kind="Layer", params=12 * H * H, param_bytes=24 * H * H,
                  fwd_flops=24 * S * H * H, bwd_flops=48 * S * H * H, activation_bytes=(34 + 5 * A * S / H) * SBH,
                  output_bytes=2 * SBH, supports_tp=True, fwd_matmul_flops=24 * S * H * H,
                  bwd_matmul_flops=48 * S * H * H, fwd_memory_bytes=200 * SBH, bwd_memory_bytes=400 * SBH,
                  replicated_memory_fraction=0.25, matmuls=6, activation_replicated_bytes=10 * SBH,
                  attention_core_bytes=5 * A * S * S)
    fields.update(kw)
    return Block(**fields)


def test_korthikanti_table_2_per_option():
    b, t = layer(), 8
    assert kept_activation_bytes(b, 1) == pytest.approx(SBH * (34 + 5 * A * S / H))
    assert kept_activation_bytes(b, t) == pytest.approx(SBH * (10 + 24 / t + 5 * A * S / (H * t)))
    assert kept_activation_bytes(b, t, sequence_parallel=True) == pytest.approx(SBH * (34 / t + 5 * A * S / (H * t)))
    assert kept_activation_bytes(b, t, tier="selective") == pytest.approx(SBH * (10 + 24 / t))
    assert kept_activation_bytes(b, t, sequence_parallel=True, tier="selective") == pytest.approx(SBH * 34 / t)


def test_compute_is_gemms_plus_memory_bound_bytes():
    cluster = catalog_cluster("a100-80g")
    b = layer()
    op = block_time(b, 1, 1, cluster)
    expected = gemm_time(b.fwd_matmul_flops, 6, cluster, "bf16") + memory_time(b.fwd_memory_bytes, cluster)
    assert op.fwd == pytest.approx(expected)
    assert memory_time(1e9, cluster) == pytest.approx(1e9 / (0.9 * cluster.device.memory_bandwidth))
    assert stream_bandwidth(cluster.device) < cluster.device.memory_bandwidth
    # memory-bound work outside the TP regions is repeated on every tp rank unless sequence parallelism splits it
    tp8, sp8 = block_time(b, 1, 8, cluster), block_time(b, 1, 8, cluster, sequence_parallel=True)
    assert tp8.fwd > sp8.fwd
    assert op.fwd / 8 <= sp8.fwd <= 1.1 * op.fwd / 8  # smaller GEMMs: a little less efficient


def test_selective_recompute_costs_less_than_full():
    cluster = catalog_cluster("h100-sxm")
    b = layer(fwd_attention_flops=2 * S * S * H, bwd_attention_flops=5 * S * S * H)
    keep, sel, full = (block_time(b, 1, 8, cluster, recompute=r) for r in (False, "selective", "recompute"))
    assert keep.bwd < sel.bwd < full.bwd
    assert sel.bwd_comm == keep.bwd_comm < full.bwd_comm


def test_selective_recompute_reruns_a_math_attention_cores_gemms():
    # QK^T and AV (2 s^2 h FLOPs each per sample) are part of the forward's GEMMs; selective recompute reruns them
    cluster = catalog_cluster("a100-80g")
    core = ((2.0 * S * S * H, 3.0 * S * H + 2.0 * A * S * S, 2),)
    plain = layer(fwd_matmul_flops=24 * S * H * H + 4 * S * S * H)
    math = replace(plain, attention_core_gemms=core)
    t = 8
    extra = block_time(math, 1, t, cluster, recompute="selective").bwd - block_time(plain, 1, t, cluster, recompute="selective").bwd
    assert extra == pytest.approx(gemm_kernels_time(core, 1 / t, cluster, "bf16"))
    assert extra > 0
    # nothing else moves: the forward and the kept backward are the same
    assert block_time(math, 1, t, cluster).fwd == block_time(plain, 1, t, cluster).fwd


def test_vocabulary_parallel_head_and_embedding_shard_over_tp():
    cluster = catalog_cluster("a100-80g")
    V = 51200
    head = Block("head", "g", "Linear", V * H, 2 * V * H, 2.0 * S * V * H, 4.0 * S * V * H, 2 * SBH, 2.0 * S * V,
                 fwd_matmul_flops=2.0 * S * V * H, bwd_matmul_flops=4.0 * S * V * H, matmuls=1, vocab_parallel="head")
    one, eight = block_time(head, 1, 1, cluster), block_time(head, 1, 8, cluster, input_bytes=2 * SBH)
    assert eight.fwd < one.fwd / 6
    assert eight.bwd_comm == pytest.approx(all_reduce_time(2 * SBH, 8, cluster.intra_node))
    emb = Block("embed", "g", "Embedding", V * H, 2 * V * H, 0.0, 0.0, 0.0, 2 * SBH, fwd_memory_bytes=4 * SBH,
                vocab_parallel="embedding")
    op = block_time(emb, 1, 8, cluster)
    assert op.fwd_comm == pytest.approx(all_reduce_time(2 * SBH, 8, cluster.intra_node)) and op.bwd_comm == 0


def test_gradient_sync_hides_all_but_the_last_bucket():
    cluster = catalog_cluster("a100-80g")
    params = 1e9
    full = all_reduce_time(2 * params, 8, cluster.inter_node)
    exposed = tail_over(params, dp=8, zero=0, memory=Memory(), link=cluster.inter_node, cluster=cluster)
    assert exposed.grad_sync == pytest.approx(full)
    hidden = tail_over(params, dp=8, zero=0, memory=Memory(), link=cluster.inter_node, cluster=cluster, overlap_s=10.0)
    # behind a long backward: the last bucket, or the SMs NCCL held from the backward's GEMMs while it ran, if longer
    from cost_models.fsdp import overlap_share
    bucket = all_reduce_time(BUCKET_BYTES, 8, cluster.inter_node)
    assert hidden.grad_sync == pytest.approx(max(bucket, overlap_share(cluster) * full))
    assert bucket < hidden.grad_sync < full  # a GPU pays for the SMs; a CPU (share 0) the last bucket only
    cpu = catalog_cluster("local-cpu")
    on_cpu = tail_over(params, dp=8, zero=0, memory=Memory(), link=cpu.inter_node, cluster=cpu, overlap_s=1e3)
    assert on_cpu.grad_sync == pytest.approx(all_reduce_time(BUCKET_BYTES, 8, cpu.inter_node))
    assert hidden.bytes_sent == exposed.bytes_sent


def test_pipeline_route_between_tp_stages_is_scatter_then_all_gather():
    from cost_models.comm import all_gather_time, p2p_time
    from cost_models.pipeline import route_time
    from plans.stage_graph import stage_graph
    from tests.cost_models.test_pipeline import make_cluster, make_group, make_plan, make_profile
    from plans import plan as P

    nbytes = 8e7  # per sample, between the two stages
    profile = make_profile([("llm", 2, 1e9)], edge_bytes=nbytes)
    for b in profile.blocks:
        assert b.output_bytes == nbytes
    profile = type(profile).build(profile.model, profile.dtype, 1,
                                  tuple(replace(b, supports_tp=True) for b in profile.blocks), profile.edges)
    cluster = make_cluster(nodes=2, gpus_per_node=8)
    plan = make_plan(profile, [make_group("llm", [["llm.0"], ["llm.1"]], tp=8)], P.Training(1, 1), cluster)
    graph = stage_graph(plan)
    lag, sent = route_time(graph, graph.routes[0], cluster)
    # each of 8 tp ranks sends 1/8 across the nodes, then the receivers all-gather inside theirs (Narayanan et al.
    # 2021, section 4.1): not 8 whole copies from one rank
    assert lag == pytest.approx(p2p_time(nbytes / 8, cluster.inter_node) + all_gather_time(nbytes, 8, cluster.intra_node))
    assert lag < 8 * p2p_time(nbytes, cluster.inter_node) / 4
    assert sent == pytest.approx(nbytes)


def test_stage_memory_selective_keeps_all_but_the_core_and_rebuilds_one():
    from cost_models.memory import stage_memory

    b = layer(params=0, param_bytes=0)
    keep = stage_memory([b], samples=1, tp=8, dp=1, zero=0, memory=Memory(), in_flight_micro_batches=2,
                        input_bytes={"l": 2 * SBH})
    sel = stage_memory([b], samples=1, tp=8, dp=1, zero=0, memory=Memory(activations={"l": "selective"}),
                       in_flight_micro_batches=2, input_bytes={"l": 2 * SBH})
    full = stage_memory([b], samples=1, tp=8, dp=1, zero=0, memory=Memory(activations={"l": "recompute"}),
                        in_flight_micro_batches=2, input_bytes={"l": 2 * SBH})
    core = 5 * A * S * S / 8
    assert keep.gpu - sel.gpu == pytest.approx(2 * core - core)  # two micro-batches in flight, one core rebuilt
    assert full.gpu == pytest.approx(2 * 2 * SBH + kept_activation_bytes(b, 8))  # checkpoints + one rebuilt block


def test_userbuffers_overlap_exposes_the_last_reduce_scatter_split_and_the_comm_sms():
    # TransformerEngine's userbuffers (--tp-comm-overlap), per region: ring-exchange all-gathers hidden behind GEMM
    # chunks longer than a send, the 4-split pipelined GEMM + reduce-scatter exposing its last split, the bulk
    # backward overlaps hidden behind their GEMMs; the 16 comm SMs slow the GEMMs they run beside (H100: 132 SMs)
    from cost_models.comm import all_gather_time, reduce_scatter_time
    from cost_models.compute import _UB_COMM_SMS, tp_collectives, userbuffers_tp_time
    from cost_models.hardware import sm_count

    # tp 2, hidden 8192: every GEMM (chunk) is longer than its communication (chunk) on NVLink (at tp 8 an h x h
    # projection is ~t F / (h B) = 2-4x shorter than its reduce-scatter on an H100, which then shows through)
    cluster, t, samples, h = catalog_cluster("h100-sxm", 8), 2, 2, 2 * H
    link = cluster.intra_node
    block = layer(sequence=S, output_bytes=2 * S * h, fwd_gemms=((2 * S * h * h, 0.0, 4), (8 * S * h * h, 0.0, 2)))
    fwd, bwd = userbuffers_tp_time(block, samples, t, link, cluster, "bf16")
    rs = reduce_scatter_time(2 * S * h * samples, t, link)
    share = _UB_COMM_SMS / sm_count(cluster.device)
    assert sm_count(cluster.device) == 132
    # every GEMM is longer than its communication here: what stays is the last split per region, the SMs the first
    # three splits take from the exit GEMM, and the split GEMMs' extra kernels (entry in t chunks, exit in 4;
    # the backward's exit dgrad in t)
    def split(flops, n):
        return gemm_time(flops * samples / t, n, cluster, "bf16") - gemm_time(flops * samples / t, 1, cluster, "bf16")
    proj, fc = 2 * S * h * h, 8 * S * h * h
    chunks_fwd = split(3 * proj, t) + split(proj, 4) + split(fc, t) + split(fc, 4)
    assert fwd == pytest.approx(2 * rs / 4 * (1 + 3 * share) + chunks_fwd, rel=1e-9)
    ag = all_gather_time(2 * S * h * samples, t, link)
    assert bwd == pytest.approx(2 * share * (ag + rs) + split(proj, t) + split(fc, t), rel=1e-9)  # bulk overlaps' SMs
    blocking_fwd, hidden_bwd = tp_collectives(block, samples, t, link, sequence_parallel=True, overlapped_tp_backward=True)
    assert fwd < blocking_fwd / 2 and bwd < hidden_bwd
    # GEMMs too short to hide their chunks: the communication shows through
    tiny = replace(block, fwd_gemms=((2 * S * h * h / 1e3, 0.0, 4), (8 * S * h * h / 1e3, 0.0, 2)))
    slow_fwd, slow_bwd = userbuffers_tp_time(tiny, samples, t, link, cluster, "bf16")
    assert slow_fwd > fwd and slow_bwd > bwd
    # block_time applies it only to sequence-parallel layers: without sequence parallelism, as before
    on = block_time(block, samples, t, cluster, sequence_parallel=True, tp_comm_overlap=True)
    off = block_time(block, samples, t, cluster, sequence_parallel=True, overlapped_tp_backward=True)
    assert on.fwd_comm == pytest.approx(fwd) and on.bwd_comm == pytest.approx(bwd) and on.fwd == off.fwd
    assert block_time(block, samples, t, cluster, tp_comm_overlap=True) == block_time(block, samples, t, cluster)


def test_cross_entropy_bytes_price_the_head_loss_per_logit():
    # default: a fused vocabulary-parallel cross-entropy, two fp32 passes each way (8 B per 16-bit logit); a runtime
    # that moves (38, 14) B per logit (Megatron-LM's unfused loss on an fp32 copy) pays the difference at the
    # stream bandwidth on this shard's logits, nowhere else
    cluster = catalog_cluster("a100-80g")
    V, t, samples = 51200, 8, 2
    head = Block("head", "g", "Linear", V * H, 2 * V * H, 2.0 * S * V * H, 4.0 * S * V * H, 2 * SBH, 2.0 * S * V,
                 fwd_matmul_flops=2.0 * S * V * H, bwd_matmul_flops=4.0 * S * V * H, matmuls=1, vocab_parallel="head")
    default = block_time(head, samples, t, cluster)
    assert block_time(head, samples, t, cluster, cross_entropy_bytes=(8, 8)) == default
    unfused = block_time(head, samples, t, cluster, cross_entropy_bytes=(38, 14))
    logits = S * V * samples / t
    assert unfused.fwd - default.fwd == pytest.approx(30 * logits / stream_bandwidth(cluster.device))
    assert unfused.bwd - default.bwd == pytest.approx(6 * logits / stream_bandwidth(cluster.device))
    assert block_time(layer(), samples, t, cluster, cross_entropy_bytes=(38, 14)) == block_time(layer(), samples, t, cluster)


def test_torchtitan_op_sac_reruns_every_other_gemm_and_the_memory_bound_forward():
    """selective="op": the forward's memory-bound work and half of each GEMM shape class (LLaMA: wk, wo, w3), not the
    attention kernel; "attention" (Korthikanti) reruns the attention kernel only."""
    cl = catalog_cluster("h100-sxm", 8)
    gemms = ((2 * S * H * H, 6 * SBH, 2), (2 * S * H * H // 4, 3 * SBH, 2), (7 * S * H * H, 10 * SBH, 3))
    b = layer(fwd_gemms=gemms, bwd_gemms=tuple((f, n, 2 * c) for f, n, c in gemms), fwd_attention_flops=2 * S * S * H,
              bwd_attention_flops=5 * S * S * H, attention_core_bytes=0)
    keep = block_time(b, 1, 1, cl)
    op = block_time(b, 1, 1, cl, recompute="selective", selective="op")
    core = block_time(b, 1, 1, cl, recompute="selective")
    rerun = gemm_kernels_time(tuple((f, n, c // 2) for f, n, c in gemms), 1, cl, "bf16") + memory_time(200 * SBH * 1, cl)
    assert op.bwd - keep.bwd == pytest.approx(rerun)
    assert core.bwd - keep.bwd == pytest.approx(keep.fwd - gemm_kernels_time(gemms, 1, cl, "bf16") - memory_time(200 * SBH, cl))


def test_pytorch_sdpa_runs_at_flashattention2_share_on_hopper():
    from cost_models.hardware import attention_efficiency

    h100, a100 = catalog_cluster("h100-sxm", 8).device, catalog_cluster("a100-80g", 8).device
    assert attention_efficiency(h100, 1e12, "sdpa") == 0.35  # Shah et al. 2024, abstract
    assert attention_efficiency(h100, 1e12) == 0.50
    assert attention_efficiency(a100, 1e12, "sdpa") == attention_efficiency(a100, 1e12) == 0.60
