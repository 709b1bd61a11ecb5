"""Time of a block's forward and backward for a micro-batch and tp degree, and of the optimizer step."""
from __future__ import annotations

import re

from dataclasses import dataclass

from cost_models.comm import all_gather_time, all_reduce_time, p2p_time, reduce_scatter_time
from cost_models.fsdp import overlap_share
from cost_models.hardware import attention_efficiency, efficiency, peak_flops, sm_count, stream_bandwidth
from cost_models.memory import DTYPE_BYTES
from cost_models.overhead import host_time, measured_compute_scale, with_host
from plans.capabilities import TP_SINGLE_REGION_KINDS, sequence_parallel_applies, sequence_parallel_padding
from plans.cluster import Cluster, Link
from plans.graph import Block, Profile


@dataclass(frozen=True, slots=True)
class OpTime:
    """One micro-batch through some blocks on one rank, in seconds: compute, and the blocking TP collectives."""

    fwd: float = 0.0
    fwd_comm: float = 0.0
    bwd: float = 0.0  # includes the recomputed forward of recompute blocks
    bwd_comm: float = 0.0

    def __add__(self, other: "OpTime") -> "OpTime":
        return OpTime(self.fwd + other.fwd, self.fwd_comm + other.fwd_comm, self.bwd + other.bwd, self.bwd_comm + other.bwd_comm)


def measured_on(profile: Profile, cluster: Cluster) -> bool:
    """Whether the profile's fwd_ms / bwd_ms were measured on the cluster's device.

    Names are compared by their model token: the profiler records "cpu" or CUDA's device name (e.g.
    "NVIDIA H100 80GB HBM3"), the catalog says "local-cpu" or "h100-sxm".
    """
    if profile.measured_on is None:
        return False
    measured, device = profile.measured_on.lower(), cluster.device.name.lower()
    if measured == device:
        return True
    token = re.match(r"[a-z0-9]*", device.removeprefix("local-")).group()  # "h100", "cpu", "a100"
    return bool(token) and token in re.findall(r"[a-z0-9]+", measured)


def measured_ms(ms: float, per_sample: float | None, samples: float, measured_micro_batch: int) -> float:
    """Measured time at `samples`: affine in the batch when the profile measured a slope (two batch sizes),
    else proportional to it. Never below a tenth of the measured time (noise can make a slope negative)."""
    if per_sample is None:
        return ms * samples / measured_micro_batch
    return max(ms + per_sample * (samples - measured_micro_batch), 0.1 * ms * min(1.0, samples / measured_micro_batch))


def tp_shard(block: Block, tp: int) -> int:
    """Over how many ranks tensor parallelism splits a block: tp for Megatron-style layers and for the
    vocabulary-parallel embedding and output head (Shoeybi et al. 2019, section 3), 1 for the rest."""
    return tp if (block.supports_tp or block.vocab_parallel) else 1


def by_op_class(block: Block) -> bool:
    """Whether the profile split the block's work by op class (profiles made before that time all FLOPs as GEMMs)."""
    return (block.fwd_matmul_flops + block.fwd_attention_flops + block.fwd_memory_bytes
            + block.bwd_matmul_flops + block.bwd_attention_flops + block.bwd_memory_bytes) > 0


def gemm_time(flops: float, kernels: int, cluster: Cluster, dtype: str) -> float:
    """GEMMs of `flops` FLOPs in `kernels` launches: each at the device's efficiency for its size (FLOPs per kernel,
    i.e. M x N x K: hardware.efficiency, a roofline with a per-launch cost), at the dense peak of `dtype`."""
    if flops <= 0:
        return 0.0
    per_kernel = flops / max(kernels, 1)
    return flops / (peak_flops(cluster.device, dtype) * efficiency(cluster.device, per_kernel))


def gemm_kernels_time(kernels: tuple[tuple[float, float, int], ...], scale: float, cluster: Cluster, dtype: str) -> float:
    """GEMM kernels by shape, (FLOPs, bytes read + written, count) per sample, `scale` samples per tp shard: each on
    the roofline (Williams et al. 2009), the slower of its compute -- FLOPs / (peak x efficiency of its size) --
    and its traffic -- bytes / stream bandwidth. A GEMM with a short inner dimension (attention's QK^T and AV over
    a head dim of 64-128) is memory-bound however many FLOPs it has (NVIDIA, "Matrix Multiplication Background
    User's Guide", arithmetic intensity)."""
    peak, bandwidth = peak_flops(cluster.device, dtype), stream_bandwidth(cluster.device)
    total = 0.0
    for flops, nbytes, count in kernels:
        f = flops * scale
        if f > 0:
            total += count * max(f / (peak * efficiency(cluster.device, f)), nbytes * scale / bandwidth)
    return total


def attention_time(flops: float, cluster: Cluster, dtype: str, kernel: str = "fused") -> float:
    """A fused attention kernel (flash attention; `kernel` "fused" or "sdpa") executing `flops` FLOPs
    (hardware.attention_efficiency)."""
    if flops <= 0:
        return 0.0
    return flops / (peak_flops(cluster.device, dtype) * attention_efficiency(cluster.device, flops, kernel))


def memory_time(nbytes: float, cluster: Cluster) -> float:
    """Memory-bound work: bytes read + written / attainable memory bandwidth (the roofline's sloped side)."""
    return nbytes / stream_bandwidth(cluster.device) if nbytes > 0 else 0.0


def _compute(block: Block, samples: float, t: int, sequence_parallel: bool, cluster: Cluster, dtype: str,
             cross_entropy_bytes: tuple[float, float] | None = None, attention: str = "fused") -> tuple[float, float, float]:
    """(forward, backward, attention-core forward) seconds of one tp shard's compute, by op class: GEMMs (divided
    over the tp ranks; backward = dgrad + wgrad, two kernels per forward GEMM), fused attention (divided), and
    memory-bound bytes, of which the share outside the TP regions (norms, residual) every tp rank repeats unless
    sequence parallelism splits it (Korthikanti et al. 2022, section 4.2.2)."""
    kernels = max(block.matmuls, 1)
    if block.fwd_gemms or block.bwd_gemms:  # by shape: each kernel on the roofline
        fwd = gemm_kernels_time(block.fwd_gemms, samples / t, cluster, dtype)
        bwd = gemm_kernels_time(block.bwd_gemms, samples / t, cluster, dtype)
    else:  # by size only
        fwd = gemm_time(block.fwd_matmul_flops * samples / t, kernels, cluster, dtype)
        bwd = gemm_time(block.bwd_matmul_flops * samples / t, 2 * kernels, cluster, dtype)
    core = attention_time(block.fwd_attention_flops * samples / t, cluster, dtype, attention)
    fwd += core
    bwd += attention_time(block.bwd_attention_flops * samples / t, cluster, dtype, attention)
    # a math attention's core GEMMs (QK^T, AV: part of fwd_gemms), which selective recompute reruns with the softmax
    core += gemm_kernels_time(block.attention_core_gemms, samples / t, cluster, dtype)
    share = _memory_share(block, t, sequence_parallel) * samples  # memory-bound bytes of this shard per profiled sample
    fwd += memory_time(block.fwd_memory_bytes * share, cluster)
    bwd += memory_time(block.bwd_memory_bytes * share, cluster)
    if block.vocab_parallel == "head":
        # the fused vocabulary-parallel cross-entropy over this shard's logits: max, exp-sum and the loss forward,
        # the softmax gradient backward, each a pass reading and writing the fp32 logits (Megatron-LM
        # tensor_parallel/cross_entropy.py _VocabParallelCrossEntropy); logits are output_bytes in `dtype`.
        # `cross_entropy_bytes`: (forward, backward) bytes per logit of a runtime that moves otherwise
        logits = block.output_bytes * samples / t / DTYPE_BYTES[dtype]
        per_logit = cross_entropy_bytes or (2 * 4, 2 * 4)
        fwd += memory_time(per_logit[0] * logits, cluster)
        bwd += memory_time(per_logit[1] * logits, cluster)
    # selective recompute reruns the core: its fused kernel, and rewrites what it saved (scores, softmax, mask)
    core += memory_time(2 * block.attention_core_bytes * samples / t, cluster)
    return fwd, bwd, core


def sp_runs(block: Block, sequence_parallel: bool) -> bool:
    """Whether a block of a sequence-parallel group runs sequence-parallel (plans/capabilities: transformer layers;
    the projector and cross-attention layers stay plainly tensor-parallel)."""
    return sequence_parallel and sequence_parallel_applies(block.kind)


def _memory_share(block: Block, t: int, sequence_parallel: bool) -> float:
    """The share of a block's memory-bound bytes one of its t shards moves: the part inside the TP regions split,
    the part outside (norms, residual) repeated by every rank, or under sequence parallelism split too, over the
    padded sequence (S rounded up to a multiple of t: runtime/sequence_parallel.py pads it)."""
    rep = block.replicated_memory_fraction
    outside = rep * sequence_parallel_padding(block.sequence, t) / t if sp_runs(block, sequence_parallel) else rep
    return outside + (1 - rep) / t


def op_sac_time(block: Block, samples: float, t: int, sequence_parallel: bool, cluster: Cluster, dtype: str) -> float:
    """Seconds torchtitan's op-level selective activation checkpointing reruns in a block's backward (torchtitan/
    parallelisms/parallelize_llama.py `_apply_ac_to_transformer_block`, `selective_ac_option = "op"`, at 9dec370,
    2024-12): the block's forward is run again under a policy that keeps the outputs of the ops in `_save_list`
    (aten.mm, the SDPA flash / efficient kernels, reduce_scatter, max) "except every second mm", so the rerun is
    every memory-bound op of the forward and every second GEMM in execution order; the attention kernel is not rerun.
    The profile keeps GEMMs by shape, not in order: half of each shape class's kernels, rounded down, are priced
    (exact for LLaMA's wq wk wv wo w1 w3 w2, whose even ones -- wk, wo, w3 -- are one of each class)."""
    rerun = tuple((f, nbytes, count // 2) for f, nbytes, count in block.fwd_gemms)
    share = _memory_share(block, t, sequence_parallel) * samples
    return gemm_kernels_time(rerun, samples / t, cluster, dtype) + memory_time(block.fwd_memory_bytes * share, cluster)


def tp_collectives(block: Block, samples: float, t: int, link: Link, input_bytes: float = 0.0, *,
                   sequence_parallel: bool = False, overlapped_tp_backward: bool = False,
                   share: float = 0.0) -> tuple[float, float]:
    """(forward, backward) seconds of a block's blocking tensor-parallel collectives on one micro-batch.

    Every collective is priced as the call it is (cost_models/comm.py: each pays the link's fixed cost per call,
    Link.collective_s, ~1 ms for gloo on a CPU host). Transformer layers: Megatron's f/g operators all-reduce the
    layer's output twice in the forward and twice in the backward (Shoeybi et al. 2019, Figure 3; Narayanan et al.
    2021, section 3.1); with sequence parallelism each all-reduce becomes an all-gather and a reduce-scatter of the
    same ring volume (Korthikanti et al. 2022, section 4.2.2), twice the calls -- plus, in the backward, one more
    all-gather per region (attention, MLP): the region's linears saved only this rank's sequence slice of their
    input, and the weight gradients need the whole sequence, so the backward gathers it again (regather_time).
    A sequence tp does not divide travels padded (runtime/sequence_parallel.py). The projector (one region, fc1
    column-, fc2 row-parallel) all-reduces once each way. Vocabulary-parallel embedding: one all-reduce of its output in the forward. Vocabulary-parallel head: the
    input is copied (f), so one all-reduce of the input gradient in the backward, plus the cross-entropy's
    all-reduces of one float per token in the forward, latency-bound: two calls in mmplan's runtime (the max, then
    the exp-sum and the target logit stacked: runtime/vocab_parallel.py; Megatron-LM makes three, a few
    microseconds more on NVLink, not priced). Not priced (one call each, per stage rather than per block): a
    sequence-parallel run's gather of its output where it leaves the run and the all-gather of its input
    gradient where it enters, per micro-batch, and the all-reduce of the norms' partial gradients once per step
    (runtime/sequence_parallel.py).

    `overlapped_tp_backward`: a runtime whose column-parallel linears run their backward collectives alongside their
    own GEMMs (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication, megatron/mpu/layers.py: the input-
    gradient all-reduce during the weight-gradient GEMM since 2021-09, `--no-async-tensor-model-parallel-allreduce`
    turns it off; with sequence parallelism, 9aad9203aa 2022-05-20, the input-gradient reduce-scatter during the
    weight-gradient GEMM and the re-gather during the input-gradient GEMM; TransformerEngine's Linear the same,
    transformer_engine/pytorch/module/linear.py backward at 8e039fdcd). Those are priced hidden: each moves b s h
    bytes against a GEMM of 2 b s h (3h or 4h) / t FLOPs on the same tokens, shorter at transformer sizes on NVLink,
    but the GEMM runs on the SMs NCCL's kernels leave it while they last: `share` of the hidden collectives' time is
    added (FSDP2's rule, fsdp.overlapped with the GEMM outlasting the collective; fsdp.overlap_share). What stays
    exposed: without sequence parallelism nothing in the backward (g's backward is the identity), with it the
    row-parallel exits' gradient all-gathers (two calls, one all-reduce's volume)."""
    if t <= 1:
        return 0.0, 0.0
    if block.vocab_parallel == "embedding":
        return all_reduce_time(block.output_bytes * samples, t, link), 0.0
    if block.vocab_parallel == "head":
        return 2 * all_reduce_time(1.0, t, link), all_reduce_time(input_bytes * samples, t, link)
    size = block.output_bytes * samples
    if block.kind in TP_SINGLE_REGION_KINDS:  # the projector: one region, one all-reduce each way
        one = all_reduce_time(size, t, link)
        return one, share * one if overlapped_tp_backward else one
    if not sp_runs(block, sequence_parallel):  # per region: g all-reduces the output forward, f the input gradient backward
        one = all_reduce_time(size, t, link)
        return 2 * one, share * 2 * one if overlapped_tp_backward else 2 * one
    size *= sequence_parallel_padding(block.sequence, t)  # the padded sequence travels
    # per region: all-gather on entry, reduce-scatter at the row-parallel exit; the backward the reverse
    gather, scatter = all_gather_time(size, t, link), reduce_scatter_time(size, t, link)
    if overlapped_tp_backward:  # hidden: the input gradient's reduce-scatter and the saved input's re-gather
        return 2 * (gather + scatter), 2 * gather + share * (2 * scatter + regather_time(block, samples, t, link))
    return 2 * (gather + scatter), 2 * (gather + scatter) + regather_time(block, samples, t, link)


def regather_time(block: Block, samples: float, t: int, link: Link) -> float:
    """Seconds of a sequence-parallel transformer layer's backward re-gathers on one micro-batch: each of its two
    regions (attention, MLP) all-gathers its (b, s, h) input again from the saved 1/t slices, once per backward
    (runtime/sequence_parallel.py `_RegatherSaved`, a blocking all-gather when the backward first unpacks the
    slice). Under full recompute too: the recomputed forward saves slices again, which the backward re-gathers.
    Megatron-LM saves the slice as well, but all-gathers it asynchronously while the input-gradient GEMM runs
    (megatron/mpu/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward, 9aad9203aa, 2022-05-20, the
    sequence-parallelism merge): tp_collectives(overlapped_tp_backward=True) prices that as hidden."""
    return 2 * all_gather_time(block.output_bytes * samples * sequence_parallel_padding(block.sequence, t), t, link)


# TransformerEngine's userbuffers defaults (transformer_engine/pytorch/module/base.py initialize_ub at 8e039fdcd,
# 2024-07, what Megatron-LM f2e5db402c's `--tp-comm-overlap` gets without `--tp-comm-overlap-cfg`): the pipelined
# and bulk overlaps run their communication kernels on 16 SMs (`num_sm`), the pipelined GEMM + reduce-scatter in 4
# splits (`num_splits`); the ring exchange moves chunks with the copy engines (`use_ce`); `set_sm_margin` 0, so
# the GEMMs are launched on every SM (comm_gemm_overlap.h `_math_sms`) and share them with those kernels.
_UB_COMM_SMS = 16
_UB_SPLITS = 4


def userbuffers_tp_time(block: Block, samples: float, t: int, link: Link, cluster: Cluster, dtype: str
                        ) -> tuple[float, float]:
    """(forward, backward) seconds a sequence-parallel transformer layer's tensor-parallel communication adds to one
    micro-batch under TransformerEngine's userbuffers overlap (Megatron-LM `--tp-comm-overlap`), per region
    (attention, MLP) as TE 8e039fdcd runs it (base.py `methods`; module/layernorm_linear.py, layernorm_mlp.py,
    linear.py; csrc/comm_gemm_overlap.h):

    - forward entry (qkv / fc1 fprop), ring exchange (`split_overlap_ag` P2P): the GEMM runs in t chunks, chunk i
      on the slice received at step i - 1; each of the t - 1 sends of size/t bytes (copy engine) exposes what it
      exceeds one GEMM chunk;
    - forward exit (proj / fc2 fprop), pipelined (`split_overlap_rs`): the GEMM in 4 chunks, each chunk's
      reduce-scatter queued on the communication stream after it: exposed max(R/4, R - 3G/4) for a whole
      reduce-scatter R and GEMM G (the last split always; more when the splits outrun the GEMM chunks);
    - backward exit dgrad (proj / fc2), ring exchange of the output gradient: as the forward entry;
    - backward entry (qkv / fc1), bulk: the sequence re-gather of the saved input beside the dgrad GEMM, the input
      gradient's reduce-scatter beside the wgrad GEMM: each exposes what it exceeds its GEMM;
    - the 16-SM kernels (pipelined splits but the last, bulk) take their SMs from the GEMM they run beside: the GEMM
      loses 16 / (SMs of the device) of its throughput for as long as both run (hardware.sm_count; not priced on a
      device of unknown SM count);
    - the split GEMMs are kernels of their own size (t chunks for a ring exchange, 4 for the pipelined split),
      each priced on the device's efficiency curve as every GEMM is (gemm_time: a per-kernel cost, so n chunks
      cost n - 1 more than one kernel). An upper bound: TE launches the chunks on up to 3 compute streams
      (_NUM_MAX_UB_STREAMS), so one chunk's tail may overlap the next one's start.

    GEMMs of the layer, by FLOPs per sample on this rank (1/t): the attention exit (proj) 2 s h^2, its entry (qkv)
    3 x that (multi-head attention; grouped-query entries are smaller: over-estimated), the MLP's entry and exit
    each half of the rest of the forward GEMMs (exact for a 2-GEMM MLP; a gated MLP's exit is over-estimated);
    h = output bytes / (s x dtype bytes), s = block.sequence. A block without a recorded sequence gets the
    GEMMs-longer-than-communication case (only the last split exposed, no contention)."""
    size = block.output_bytes * samples
    R, A, P = reduce_scatter_time(size, t, link), all_gather_time(size, t, link), p2p_time(size / t, link)
    fwd_gemm = sum(f * c for f, _, c in block.fwd_gemms) or block.fwd_matmul_flops
    if block.sequence <= 0 or fwd_gemm <= 0:
        return 2 * R / _UB_SPLITS, 0.0
    h = block.output_bytes / (block.sequence * DTYPE_BYTES[dtype])
    proj = 2 * block.sequence * h * h
    mlp = max(fwd_gemm - 4 * proj, 0.0) / 2
    scale = samples / t
    sms = sm_count(cluster.device)
    share = _UB_COMM_SMS / sms if sms else 0.0
    fwd = bwd = 0.0
    for entry, exit_ in ((3 * proj, proj), (mlp, mlp)):
        g_in, g_out = gemm_time(entry * scale, 1, cluster, dtype), gemm_time(exit_ * scale, 1, cluster, dtype)
        # the split GEMMs: each chunk a kernel of its own size, on the same efficiency curve as every GEMM
        fwd += gemm_time(entry * scale, t, cluster, dtype) - g_in
        fwd += gemm_time(exit_ * scale, _UB_SPLITS, cluster, dtype) - g_out
        bwd += gemm_time(exit_ * scale, t, cluster, dtype) - g_out
        fwd += (t - 1) * max(0.0, P - g_in / t)
        fwd += max(R / _UB_SPLITS, R - (_UB_SPLITS - 1) * g_out / _UB_SPLITS)
        fwd += share * min((_UB_SPLITS - 1) * R, (_UB_SPLITS - 1) * g_out) / _UB_SPLITS
        bwd += (t - 1) * max(0.0, P - g_out / t)
        bwd += max(0.0, A - g_in) + max(0.0, R - g_in) + share * (min(A, g_in) + min(R, g_in))
    return fwd, bwd


def block_time(
    block: Block,
    samples: float,
    tp: int,
    cluster: Cluster,
    *,
    dtype: str = "bf16",
    measured_micro_batch: int | None = None,
    recompute: bool | str = False,
    tp_link: Link | None = None,
    sequence_parallel: bool = False,
    input_bytes: float = 0.0,
    overlapped_tp_backward: bool = False,
    tp_comm_overlap: bool = False,
    cross_entropy_bytes: tuple[float, float] | None = None,
    selective: str = "attention",
    attention: str = "fused",
) -> OpTime:
    """Forward and backward of `block` for `samples` samples on one of its tp shards (tp_shard).

    Compute: with `measured_micro_batch` (the profile's micro-batch, when it was measured on this device) the
    measured fwd_ms / bwd_ms at `samples` (measured_ms: affine in the batch), divided evenly over the shards;
    else by op class (_compute: GEMMs on the efficiency curve by size, fused attention as its own kernel,
    memory-bound bytes at the stream bandwidth), or, for a profile without the split, FLOPs / (peak x
    efficiency) as if every FLOP were one GEMM. Then the host's work of running the block op by op
    (overhead.host_time: per-op dispatch, the runtime's saved-tensor hook; measured clusters only), after the
    arithmetic on a CPU, overlapped with it on a GPU (overhead.with_host).
    TP communication: tp_collectives, over the TP link (inside a node). `recompute`: True / "recompute" runs the
    whole forward again before the backward (Chen et al. 2016), its all-reduces included; "selective" reruns
    only the attention core (Korthikanti et al. 2022, section 5: no communication). `input_bytes`: the block's
    input per sample (the head's backward all-reduce). `overlapped_tp_backward`: the runtime hides the column-
    parallel linears' backward collectives behind their GEMMs (Megatron-LM, TransformerEngine; tp_collectives).
    `tp_comm_overlap`: a sequence-parallel transformer layer's communication runs inside its GEMMs as
    TransformerEngine's userbuffers do (Megatron-LM `--tp-comm-overlap`, which requires sequence parallelism:
    userbuffers_tp_time); other blocks, and layers without sequence parallelism, are priced as without it.
    `cross_entropy_bytes`: (forward, backward) bytes per logit the runtime's cross-entropy moves on the output head
    (default: the fused vocabulary-parallel cross-entropy, two fp32 passes each way: _compute). `selective`: what
    the "selective" tier reruns: "attention", the attention core (Korthikanti et al. 2022), or "op", torchtitan's
    op-level policy (op_sac_time; priced for a block split by op class, else as "attention"). `attention`: the
    fused attention kernel the runtime runs, "fused" (TransformerEngine / cuDNN class) or "sdpa" (PyTorch's SDPA
    flash backend, FlashAttention-2: hardware.attention_efficiency).
    """
    t = tp_shard(block, tp)
    core = 0.0
    measured = measured_micro_batch is not None and block.fwd_ms is not None and block.bwd_ms is not None
    if measured:
        fwd = measured_ms(block.fwd_ms, block.fwd_ms_per_sample, samples, measured_micro_batch) / t / 1e3
        bwd = measured_ms(block.bwd_ms, block.bwd_ms_per_sample, samples, measured_micro_batch) / t / 1e3
        scale = measured_compute_scale(cluster)  # measured in one process, run with every rank busy
        fwd, bwd = fwd * scale, bwd * scale
        if block.fwd_flops > 0:  # the core's share of the measured forward, by FLOPs (fused kernel or its GEMMs)
            core_flops = block.fwd_attention_flops + sum(f * n for f, _, n in block.attention_core_gemms)
            core = fwd * core_flops / block.fwd_flops
    elif by_op_class(block):
        fwd, bwd, core = _compute(block, samples, t, sequence_parallel, cluster, dtype, cross_entropy_bytes, attention)
    else:
        peak = peak_flops(cluster.device, dtype)
        f, b = block.fwd_flops * samples / t, block.bwd_flops * samples / t  # FLOPs of this shard
        fwd = f / (peak * efficiency(cluster.device, f)) if f > 0 else 0.0
        bwd = b / (peak * efficiency(cluster.device, b)) if b > 0 else 0.0
    host_fwd, host_bwd = host_time(block, cluster, measured=measured)
    fwd, bwd = with_host(fwd, host_fwd, cluster), with_host(bwd, host_bwd, cluster)
    if tp_comm_overlap and sp_runs(block, sequence_parallel) and t > 1 and block.supports_tp and not block.vocab_parallel:
        fwd_comm, bwd_comm = userbuffers_tp_time(block, samples, t, tp_link or cluster.intra_node, cluster, dtype)
    else:
        fwd_comm, bwd_comm = tp_collectives(block, samples, t, tp_link or cluster.intra_node, input_bytes,
                                            sequence_parallel=sequence_parallel, overlapped_tp_backward=overlapped_tp_backward,
                                            share=overlap_share(cluster))
    if recompute is True or recompute == "recompute":
        return OpTime(fwd=fwd, fwd_comm=fwd_comm, bwd=bwd + fwd, bwd_comm=bwd_comm + fwd_comm)
    if recompute == "selective":
        if selective == "op" and not measured and by_op_class(block):
            core = op_sac_time(block, samples, t, sequence_parallel, cluster, dtype)
        return OpTime(fwd=fwd, fwd_comm=fwd_comm, bwd=bwd + core, bwd_comm=bwd_comm)
    return OpTime(fwd=fwd, fwd_comm=fwd_comm, bwd=bwd, bwd_comm=bwd_comm)


def grad_accumulation_time(trained: float, *, micro_batches: int, dp: int, zero: int, grads_tier: str, cluster: Cluster,
                           dtype: str = "bf16"):
    """Seconds per backward (a step's average) of adding each micro-batch's weight gradients into the accumulated
    ones, on a rank holding `trained` trained parameters (tp shards; works on numpy arrays of them too).

    Autograd's AccumulateGrad takes the first micro-batch's gradient as `.grad` (zero_grad(set_to_none=True):
    nothing moves) and adds each later one in place, `.grad += g`: read both, write the sum, 3 x `dtype` bytes
    per parameter, a memory-bound elementwise kernel at the stream bandwidth. So m - 1 of m backwards pay it.
    What is accumulated is the runtime's (runtime/zero.py): without ZeRO and under ZeRO-1 (FSDP2 with gradient
    sync off until the last backward) the whole unsharded gradient; under ZeRO-2/3 each backward's gradient is
    reduce-scattered and only this rank's 1/dp shard is added (FSDP2 foreach_reduce: `sharded_param.grad +=`).
    Megatron-LM 2021 (`--DDP-impl torch` or `local` without contiguous buffers, the SC21 runs) accumulates
    the same way in fp16 `.grad`. Gradients in the cpu / nvme tiers are added on the host (param_tiers.GradTier):
    not priced here (their transfers are, cost_models/offload.py)."""
    if micro_batches <= 1 or grads_tier != "gpu":
        return 0.0 * trained
    shard = dp if zero >= 2 else 1
    return (micro_batches - 1) / micro_batches * 3 * DTYPE_BYTES[dtype] * trained / shard / stream_bandwidth(cluster.device)


def mixed_precision_step_bytes(*, grad_bytes: int, zeroed_buffer: bool, loss_scaling: bool) -> int:
    """Bytes per updated parameter that Megatron-LM's mixed-precision optimizer step moves beyond the update
    optimizer_step_time prices (Adam: read and write fp32 master, m and v, read the gradient and write the
    parameter in the compute dtype, 28 B), for a runtime that is not mmplan's (simulate(optimizer_extra_bytes=)).

    Megatron-LM's FP16OptimizerWithFP16Params (152aab304d, 2021-01) / Float16OptimizerWithFloat16Params (de7dc40f88,
    2021-08; 9aad9203aa, 2022-05), megatron/optimizer/optimizer.py `step()`, each a separate pass over every
    parameter: (1) the accumulated gradient to the fp32 main gradient, `.float()` / a multi-tensor copy: read 2 +
    write 4 when the gradient was accumulated in 16 bits (`grad_bytes` 2), nothing when it already is fp32 (a
    contiguous fp32 `main_grad` buffer); (2) with loss scaling (fp16), unscale and check for inf/nan,
    torch._amp_foreach_non_finite_check_and_unscale_: read + write fp32, 8; (3) clip_grad_norm's l2 norm
    (multi_tensor_l2norm): read fp32, 4 (its rescaling pass runs only when the norm exceeds the clip: not counted);
    (4) the fused Adam reads the fp32 gradient: 2 more than the 16-bit gradient priced; (5) the fp32 master
    parameters copied into the 16-bit model parameters: the read, 4 (the write is priced); (6) with a contiguous
    gradient buffer, training.py's zero_grad_buffer() at the start of the step writes it (`grad_bytes`); without one
    the gradients are set to None (nothing)."""
    copy = 2 + 4 if grad_bytes < 4 else 0
    return copy + (8 if loss_scaling else 0) + 4 + 2 + 4 + (grad_bytes if zeroed_buffer else 0)
