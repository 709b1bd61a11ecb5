"""The cost model's single entry: evaluate(plan, profile) -> step time, throughput, MFU, memory, timeline."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, replace

from cost_models.hardware import peak_flops
from cost_models.memory import GradBuffer, TierBytes, block_input_bytes, stage_memory
from cost_models.workspace import GpuOverhead, Seen, gpu_overhead
from cost_models.pipeline import Busy, Event, Simulation, StageCost, simulate
from cost_models.ties import plan_stages, with_copies
from plans.cluster import Cluster
from plans.errors import ImpossiblePrediction
from plans.graph import Profile
from plans.plan import Plan, Predicted, RankMemory

# How memory is counted (evaluate's grad_buffer / overhead): "tensors" -- mmplan's runtime: the tensors it holds, as
# its own measurement counts them (gradients in the training dtype); "megatron" -- a Megatron-LM run on GPUs: fp32
# gradient buffer (memory.grad_buffer_bytes) and the device's whole use (workspace.GpuOverhead, "device").
MEMORY_MODELS: dict[str, dict] = {"tensors": {}, "megatron": {"grad_buffer": "fp32", "overhead": "device"}}

TOKEN_INPUTS = ("tokens", "input_ids")  # model-input names that carry the LLM's token ids
TOKEN_ID_BYTES = 8  # int64, torch's default for token ids (runtime/models/build.py example_batch)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What the cost model predicts for a plan: the Predicted figures, the simulated step, per-stage memory."""

    predicted: Predicted
    simulation: Simulation
    stage_memory: tuple[TierBytes, ...]  # bytes on one rank of each stage, aligned with simulation.stages

    @property
    def stages(self) -> tuple[StageCost, ...]:
        return self.simulation.stages

    @property
    def timeline(self) -> tuple[Event, ...]:
        """Events of one representative rank per rank class; rank_timeline(r) gives any rank's."""
        return self.simulation.timeline

    @property
    def memory(self) -> tuple[RankMemory, ...]:
        return self.predicted.memory

    @property
    def busy(self) -> dict[int, Busy]:
        return self.simulation.busy

    def rank_timeline(self, rank: int) -> tuple[Event, ...]:
        return self.simulation.rank_timeline(rank)


def evaluate(plan: Plan, profile: Profile, cluster: Cluster | None = None, *, grad_sync_overlap: bool = True,
             blocking_p2p: bool = False, fused_grad_accumulation: bool = False,
             overlapped_tp_backward: bool = False, optimizer_extra_bytes: float = 0.0, grad_sync_bytes: int | None = None,
             overlapped_param_gather: bool = False, tp_comm_overlap: bool = False,
             cross_entropy_bytes: tuple[float, float] | None = None, selective: str = "attention",
             attention: str = "fused", grad_buffer: GradBuffer = "dtype", overhead: Seen | None = None) -> Evaluation:
    """Simulate one step of `plan` and derive its throughput, MFU, memory per rank and whether it fits.

    TFLOP/s per GPU = model FLOPs per step (forward + backward of every block for every sample; the
    recomputed forward is not counted) / step time / ranks of the plan; MFU = that / peak[dtype]
    (Chowdhery et al. 2022, PaLM, appendix B). tokens/s = samples/s x tokens_per_sample(profile), 0 when
    the profile does not say how many tokens a sample has.

    Memory: each rank's tensors (memory.stage_memory; `grad_buffer="fp32"`: gradients as Megatron-LM keeps them,
    memory.grad_buffer_bytes); with `overhead`, its GPU tier as that measurement counts it beyond the tensors
    (workspace.GpuOverhead.seen_by: "allocated", "reserved" or "device"; nothing on CPU clusters). Without, tensors
    only, as mmplan's own runtime measures them.
    """
    cluster = cluster or plan.cluster
    training = plan.training
    sim = simulate(plan, profile, cluster, grad_sync_overlap=grad_sync_overlap, blocking_p2p=blocking_p2p,
                   fused_grad_accumulation=fused_grad_accumulation, overlapped_tp_backward=overlapped_tp_backward,
                   optimizer_extra_bytes=optimizer_extra_bytes, grad_sync_bytes=grad_sync_bytes,
                   overlapped_param_gather=overlapped_param_gather, tp_comm_overlap=tp_comm_overlap,
                   cross_entropy_bytes=cross_entropy_bytes, selective=selective, attention=attention)
    inputs = block_input_bytes(profile)

    blocks = with_copies(profile, plan_stages(plan))  # a stage holding a tied copy counts it (cost_models/ties.py)
    per_stage: list[TierBytes] = []
    per_rank: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # rank -> bytes in gpu, cpu, nvme
    layouts: dict[int, set] = defaultdict(set)  # rank -> (group, tp, dp, pp) of the groups it runs
    for sc in sim.stages:
        g = plan.group(sc.group)
        stage = g.stages[sc.index]
        tb = stage_memory(
            [blocks[b] for b in stage.blocks], samples=plan.micro_batch_of(g) / g.dp, tp=g.tp, dp=g.dp,
            zero=g.zero, memory=stage.memory, in_flight_micro_batches=sc.in_flight, input_bytes=inputs,
            dtype=training.dtype, optimizer=training.optimizer, sequence_parallel=g.sequence_parallel,
            reshard_after_forward=g.reshard_after_forward, grad_buffer=grad_buffer,
        )
        per_stage.append(tb)
        for r in stage.ranks:
            acc = per_rank[r]
            acc[0] += tb.gpu
            acc[1] += tb.cpu
            acc[2] += tb.nvme
            layouts[r].add((g.name, g.tp, g.dp, g.pp))
    if overhead is not None:
        for r, acc in per_rank.items():
            acc[0] = rank_overhead(cluster, layouts[r]).seen_by(acc[0], overhead)
    memory = tuple(RankMemory(r, *per_rank[r]) for r in sorted(per_rank))

    step = sim.step_time_s
    world = len(per_rank)
    flops = sum(b.fwd_flops + b.bwd_flops for b in profile.blocks) * training.global_batch  # FLOPs per step
    achieved = flops / step / world if step > 0 else 0.0  # FLOP/s per GPU
    samples_per_s = training.global_batch / step if step > 0 else 0.0
    predicted = Predicted(
        step_time_s=step,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * (tokens_per_sample(profile) or 0.0),
        tflops_per_gpu=achieved / 1e12,
        mfu=achieved / peak_flops(cluster.device, training.dtype),
        bubble_fraction=sim.bubble_fraction,
        comm_bytes=sim.comm_bytes,
        fits=fits(memory, cluster),
        memory=memory,
        bottleneck=sim.bottleneck,
    )
    check_possible(predicted, sim, profile, cluster, training.dtype)
    return Evaluation(predicted=predicted, simulation=sim, stage_memory=tuple(per_stage))


def check_possible(predicted: Predicted, sim: Simulation, profile: Profile, cluster: Cluster, dtype: str) -> None:
    """Impossible figures are an error, never a prediction: a negative time anywhere in the step, or more FLOP/s
    than the device's peak (MFU > 1), which only inconsistent inputs give (block times measured elsewhere or under
    other settings than the FLOPs were counted for, a peak below the measured rate)."""
    times = [sim.step_time_s, sim.pipeline_time_s] + [t for s in sim.stages for t in (
        s.fwd_s, s.bwd_s, s.grad_sync_s, s.optimizer_s, s.param_gather_s)]
    if any(not t >= 0 for t in times):  # also NaN
        raise ImpossiblePrediction(f"impossible prediction for {profile.model} on {cluster.name}: a negative or undefined time "
                          f"({min(times, key=lambda t: t if t == t else -1.0):g} s); check the profile's measured times")
    if predicted.mfu > 1 + 1e-9:
        raise ImpossiblePrediction(
            f"impossible prediction for {profile.model} on {cluster.name}: {predicted.tflops_per_gpu * 1e3:.4g} GFLOP/s "
            f"per rank is {predicted.mfu:.0%} of the {dtype} peak ({peak_flops(cluster.device, dtype) / 1e9:.4g} GFLOP/s); "
            f"the profile's measured times (measured on {profile.measured_on or 'no device'}) or the cluster's peak are "
            f"wrong: re-measure the profile on this device or calibrate the cluster")


def rank_overhead(cluster: Cluster, layouts) -> GpuOverhead:
    """The GpuOverhead of a rank running the groups `layouts` ((group, tp, dp, pp) each): one CUDA context, cuBLAS
    workspace and fragmentation share, and each group's own NCCL communicators (colocated groups do not share them)."""
    parts = [gpu_overhead(cluster, tp=tp, dp=dp, pp=pp) for _, tp, dp, pp in sorted(layouts)] or [gpu_overhead(cluster, tp=1, dp=1, pp=1)]
    return replace(parts[0], nccl=sum(p.nccl for p in parts))


def fits(memory: tuple[RankMemory, ...], cluster: Cluster) -> bool:
    """Every rank's gpu tier within the device memory, each node's cpu and nvme tiers within its host memory and NVMe."""
    cpu: dict[int, float] = defaultdict(float)
    nvme: dict[int, float] = defaultdict(float)
    for m in memory:
        if m.gpu > cluster.device.memory_bytes:
            return False
        cpu[cluster.node_of(m.rank)] += m.cpu
        nvme[cluster.node_of(m.rank)] += m.nvme
    return all(v <= cluster.host_memory_bytes for v in cpu.values()) and all(v <= cluster.nvme_bytes for v in nvme.values())


def tokens_per_sample(profile: Profile) -> float | None:
    """Tokens the LLM processes per sample, inferred from the profile; None when it cannot be.

    The token-id input (TOKEN_INPUTS, int64) gives the text tokens; the block it feeds (the embedding)
    outputs text tokens x hidden width bytes, which gives the width; the most common output size among
    that group's tensor-parallel blocks (its decoder layers; all its blocks if none is) divided by the
    width is the LLM's sequence length: text plus encoder tokens for prefix models, text only for
    cross-attention ones.
    """
    ids = next((i for i in profile.inputs if i.input in TOKEN_INPUTS), None)
    if ids is None or ids.bytes <= 0:
        return None
    text = ids.bytes / TOKEN_ID_BYTES
    embed = profile.block(ids.dst)
    if embed.output_bytes <= 0:
        return text
    width = embed.output_bytes / text  # bytes of one token's hidden state
    group = profile.group_blocks(embed.group)
    layers = [b for b in group if b.supports_tp] or group
    sizes = Counter(b.output_bytes for b in layers)
    most = max(sizes.values())
    seq = max(size for size, count in sizes.items() if count == most) / width
    return float(round(seq))
