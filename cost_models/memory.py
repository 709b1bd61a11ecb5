"""Per-rank bytes of a pipeline stage in each tier: ZeRO shares, model states, activations in flight, tier residency."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

from plans.capabilities import sequence_parallel_applies, sequence_parallel_padding
from plans.errors import MmplanError
from plans.graph import Block, Profile
from plans.plan import ActivationTier, Memory, Schedule, Tier

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GradBuffer = Literal["dtype", "fp32"]  # gradients in the training dtype (mmplan's runtime) | fp32 main_grad (Megatron-LM)
MAIN_GRAD_BYTES = 4  # Megatron-LM's main_grad: fp32 (see grad_buffer_bytes)

# Every function here works on plain floats and, unchanged, on numpy arrays of them (the solver's vectorised
# figures over every segment of a unit call these same functions; planner/solver/candidates.py).


@dataclass(frozen=True, slots=True)
class TierBytes:
    """Bytes one rank holds in each tier."""

    gpu: float = 0.0
    cpu: float = 0.0
    nvme: float = 0.0

    def __add__(self, other: "TierBytes") -> "TierBytes":
        return TierBytes(self.gpu + other.gpu, self.cpu + other.cpu, self.nvme + other.nvme)

    def put(self, tier: str, nbytes: float) -> "TierBytes":
        """A copy with `nbytes` more in `tier` ("gpu" | "cpu" | "nvme")."""
        return self + TierBytes(**{tier: nbytes})

    def scaled(self, factor: float) -> "TierBytes":
        return TierBytes(self.gpu * factor, self.cpu * factor, self.nvme * factor)


@dataclass(frozen=True, slots=True)
class ModelState:
    """Bytes of one rank's share of parameters, gradients and optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


class ZeroDivisors(NamedTuple):
    """Over how many data-parallel ranks each model state is sharded (1: replicated)."""

    params: int
    grads: int
    optimizer: int


def zero_divisors(zero: int, dp: int) -> ZeroDivisors:
    """The ZeRO shares: stage 1 (P_os) shards the optimizer states over the dp ranks, stage 2 (P_os+g) also the
    gradients, stage 3 (P_os+g+p) also the parameters (Rajbhandari et al. 2020, ZeRO, section 5 and Figure 1).
    Every ZeRO-sharded figure of the cost model and the solver divides by these."""
    if zero not in (0, 1, 2, 3) or isinstance(zero, bool):
        raise MmplanError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero}")
    return ZeroDivisors(dp if zero >= 3 else 1, dp if zero >= 2 else 1, dp if zero >= 1 else 1)


class StateTiers(Protocol):
    """Where a stage's model states live: plans.plan.Memory, or the solver's uniform Policy."""

    params: Tier
    grads: Tier
    optimizer: Tier


def optimizer_bytes_per_param(dtype: str, optimizer: str) -> int:
    """K of the ZeRO paper: optimizer-state bytes per parameter.

    Mixed-precision Adam keeps an fp32 master copy, momentum and variance: K = 4 + 4 + 4 = 12
    (Rajbhandari et al. 2020, section 3.1). Without mixed precision (fp32) the master copy is the
    parameter itself: K = 8. SGD keeps momentum (4) plus, in mixed precision, the master copy (4).
    """
    master = 4 if DTYPE_BYTES[dtype] < 4 else 0
    return master + (8 if optimizer == "adam" else 4)


def model_state_bytes(params: float, *, dp: int, zero: int, dtype: str = "bf16", optimizer: str = "adam") -> ModelState:
    """One rank's model states for `params` parameters replicated over `dp` ranks with ZeRO stage `zero`.

    Rajbhandari et al. 2020 (ZeRO), section 5 and Figure 1: with mixed-precision Adam the states are
    2Psi (fp16 params) + 2Psi (fp16 grads) + 12Psi (optimizer); stage 1 shards the optimizer states over
    dp, stage 2 also the gradients, stage 3 also the parameters (zero_divisors). Pass params already divided by tp.
    """
    share = zero_divisors(zero, dp)
    width = DTYPE_BYTES[dtype]
    p, g, o = width * params, width * params, optimizer_bytes_per_param(dtype, optimizer) * params
    return ModelState(params=p / share.params, grads=g / share.grads, optimizer=o / share.optimizer)


def state_residency(params: float, largest: float, *, dp: int, zero: int, memory: StateTiers, dtype: str = "bf16",
                    optimizer: str = "adam", trained: Any = None, reshard_after_forward: bool = True) -> TierBytes:
    """Bytes per tier of one rank's model states: `params` parameters on the rank (tp-parallel blocks divided
    by tp), the largest block's `largest` of them; `trained` of them (default: all) are not frozen and have gradients
    and optimizer state.

    Each of params / grads / optimizer state (model_state_bytes, ZeRO-sharded) sits in the tier `memory` names.
    Streaming from another tier needs GPU buffers, as runtime/param_tiers.py holds them: parameters off the GPU
    keep the block in use and the one prefetched (2 x the largest block's share; ZeRO-Infinity style, Rajbhandari
    et al. 2021, section 5); gradients off the GPU keep one block's gradients on the device while they move out
    (GradTier moves each gradient out as soon as it has accumulated); ZeRO-3 keeps a double buffer of the largest
    gathered block (the one in use and the one being all-gathered, ZeRO section 7.2). ZeRO-3 without
    `reshard_after_forward` (FSDP2's reshard_after_forward=False) holds every block's gathered parameters from its
    forward to its backward: at the peak, with a micro-batch between the two, the stage's whole parameters unsharded,
    beside the rank's own shard. ZeRO-2 as runtime/zero.py runs it on FSDP2 keeps the parameters unsharded across
    the step's micro-batches (resharded after the last backward) and, like ZeRO-3, keeps the rank's shard (the
    DTensor the optimizer steps) beside them: 1 + 1/dp of the parameters, as measured on FSDP2's storages
    (tests/runtime/test_zero_working_set.py). ZeRO-1 is counted as Megatron-LM's distributed optimizer holds it
    (whole parameters, no second copy of the shard), which FSDP2 exceeds by the same 1/dp.
    """
    share = zero_divisors(zero, dp)
    state = model_state_bytes(params, dp=dp, zero=zero, dtype=dtype, optimizer=optimizer)
    if trained is not None:  # `trained` of the params are not frozen: only they have gradients and optimizer state
        of_trained = model_state_bytes(trained, dp=dp, zero=zero, dtype=dtype, optimizer=optimizer)
        state = ModelState(params=state.params, grads=of_trained.grads, optimizer=of_trained.optimizer)
    out = TierBytes().put(memory.params, state.params).put(memory.grads, state.grads).put(memory.optimizer, state.optimizer)
    block = largest * DTYPE_BYTES[dtype]  # bytes, the largest block's parameters (or gradients)
    if memory.params != "gpu":
        out = out.put("gpu", 2 * block / share.params)
    if memory.grads != "gpu":
        out = out.put("gpu", block / share.grads)
    if zero >= 3:
        out = out.put("gpu", 2 * block)
    if zero >= 3 and not reshard_after_forward:
        out = out.put("gpu", state.params * share.params)  # the unsharded parameters, beside the rank's shard
    if zero == 2 and memory.params == "gpu":
        out = out.put("gpu", state.params / dp)  # the rank's shard, beside the unsharded parameters kept all step
    return out


def kept_activation_bytes(block: Block, tp: int, *, sequence_parallel: bool = False, tier: ActivationTier = "keep") -> float:
    """Bytes per sample of a block's saved activations on one tp rank, as Megatron's tensor parallelism stores them
    (Korthikanti et al. 2022, section 4 and Table 2): what its TP regions save is split over the t ranks; what is
    saved outside them (norm and column-parallel linear inputs, residual dropout masks:
    activation_replicated_bytes) is held whole by every rank unless sequence parallelism splits it too; selective
    recompute drops the attention core (attention_core_bytes) -- per layer sbh(10 + 24/t + 5as/(ht)) with TP,
    sbh(34/t + 5as/(ht)) with TP + SP, sbh(10 + 24/t) / sbh(34/t) with selective recompute. Vocabulary-parallel
    blocks split everything (their logits and the cross-entropy's). Under sequence parallelism a sequence t does not
    divide is held padded (S rounded up to a multiple of t, runtime/sequence_parallel.py); blocks of a sequence-parallel
    group that do not run sequence-parallel (projectors, cross-attention layers) as without it. Full recompute is
    activation_residency's."""
    t = tp if (block.supports_tp or block.vocab_parallel) else 1
    total = block.activation_bytes
    core = block.attention_core_bytes if tier == "selective" else 0.0
    replicated = 0.0 if block.vocab_parallel else block.activation_replicated_bytes
    if sequence_parallel and sequence_parallel_applies(block.kind):  # split too, over the padded sequence
        return replicated * sequence_parallel_padding(block.sequence, t) / t + (total - core - replicated) / t
    return replicated + (total - core - replicated) / t


def activation_residency(tier: ActivationTier, act: float, checkpoint: float) -> TierBytes:
    """Bytes per tier, per micro-batch in flight, of a block's saved activations (`act` bytes of one micro-batch;
    `checkpoint` the bytes of its inputs): keep = on the GPU; recompute = only the block input stays, as a
    checkpoint (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"); offload-cpu / offload-nvme
    = in that tier."""
    if tier in ("keep", "selective"):  # selective: act already excludes the attention core (kept_activation_bytes)
        return TierBytes(gpu=act)
    if tier == "recompute":
        return TierBytes(gpu=checkpoint)
    return TierBytes().put(tier.removeprefix("offload-"), act)


def activation_transient(tier: ActivationTier, act: float) -> float:
    """GPU bytes a block's activations need while it runs, beyond those in flight: a recomputed block rebuilds
    its activations during its backward (one block at a time, Chen et al. 2016); an offloaded one keeps two
    blocks' worth on the GPU, the one being offloaded or prefetched and the one in use (ZeRO-Offload's
    double buffer, Ren et al. 2021, section 4.2). Linear and non-decreasing in `act`: the stage's transient is
    this of its largest block."""
    if tier in ("keep", "selective"):  # selective: the core of one block, added by stage_memory
        return 0.0 * act
    return (1 if tier == "recompute" else 2) * act


def warmup_forwards(schedule: Schedule, micro_batches: int, downstream: int, chunks: int = 1, pp: int = 1) -> int:
    """Forward ops (model chunk x micro-batch) a rank runs before its first backward.

    `downstream` is the number of pipeline stages after this one on the data path (pp - i - 1 for stage
    i of a lone group; an encoder feeding a pp-stage LLM counts the LLM's stages too). GPipe runs every
    forward first (Huang et al. 2019). 1F1B warms up with the downstream stages (PipeDream-Flush,
    Narayanan et al. 2021 section 2.2.1). Interleaved 1F1B with v chunks per rank warms up with
    2 * downstream + (v - 1) * pp (Megatron-LM schedules.py, forward_backward_pipelining_with_interleaving).
    """
    total = micro_batches * chunks
    if schedule == "gpipe":
        return total
    if chunks == 1:
        return min(total, downstream)
    return min(total, 2 * downstream + (chunks - 1) * pp)


def in_flight(schedule: Schedule, micro_batches: int, warmup: int, chunks: int = 1) -> float:
    """Micro-batches whose activations a rank holds at its peak, in units of its whole stage, given its
    warm-up (warmup_forwards): GPipe all m; otherwise the warm-up forwards plus the one of the first
    1F1B pair, divided by the v chunks. That is min(m, pp - i) on stage i of 1F1B (Narayanan et al. 2021,
    2.2.1) and p(1 + (p-1)/(p v)) on the first stage of the interleaved schedule (Korthikanti et al. 2022,
    section 4.2.3).
    """
    if schedule == "gpipe":
        return float(micro_batches)
    return min(micro_batches * chunks, warmup + 1) / chunks


def block_input_bytes(profile: Profile) -> dict[str, float]:
    """Per-sample bytes of each block's inputs (its checkpoint under recompute): the edges and model
    inputs into it, or the previous block's output when the profile records no edges into it."""
    into: dict[str, float] = {}
    for e in profile.edges:
        into[e.dst] = into.get(e.dst, 0.0) + e.bytes
    for i in profile.inputs:
        into[i.dst] = into.get(i.dst, 0.0) + i.bytes
    out, previous = {}, 0.0
    for b in profile.blocks:
        out[b.name] = into.get(b.name, previous)
        previous = b.output_bytes
    return out


def stage_memory(
    blocks: Sequence[Block],
    *,
    samples: float,
    tp: int,
    dp: int,
    zero: int,
    memory: Memory,
    in_flight_micro_batches: float,
    input_bytes: dict[str, float],
    dtype: str = "bf16",
    optimizer: str = "adam",
    sequence_parallel: bool = False,
    reshard_after_forward: bool = True,
    grad_buffer: GradBuffer = "dtype",
) -> TierBytes:
    """Peak bytes per tier on one rank of a stage running `blocks` on `samples` samples per micro-batch.

    Model states: state_residency of the rank's parameters (tp-parallel blocks divided by tp) in the tiers of
    the plan's Memory. Activations (per sample, as profiled, on one tp rank: kept_activation_bytes) times the
    micro-batches in flight, each block's by activation_residency of its tier, plus the largest
    activation_transient of its blocks (under selective recompute: the attention core of one block, rebuilt
    during its backward). `grad_buffer="fp32"`: gradients kept as Megatron-LM keeps them (grad_buffer_bytes).
    """
    shard = {b.name: (tp if (b.supports_tp or b.vocab_parallel) else 1) for b in blocks}
    params = sum(b.params / shard[b.name] for b in blocks)
    trained = sum(b.params / shard[b.name] for b in blocks if not b.frozen)  # frozen blocks: no grads, no optimizer state
    largest = max((b.params / shard[b.name] for b in blocks), default=0.0)
    out = state_residency(params, largest, dp=dp, zero=zero, memory=memory, dtype=dtype, optimizer=optimizer, trained=trained,
                          reshard_after_forward=reshard_after_forward)
    out = out.put(memory.grads, grad_buffer_bytes(trained, dp=dp, zero=zero, dtype=dtype, grad_buffer=grad_buffer))
    transient = 0.0  # bytes: the one block being recomputed, or the two being offloaded / prefetched
    for b in blocks:
        tier = memory.activations.get(b.name, "keep")
        act = kept_activation_bytes(b, tp, sequence_parallel=sequence_parallel, tier=tier) * samples  # one micro-batch
        # the checkpoint of a recomputed block: its input, split over the tp ranks only with sequence parallelism
        sp = sequence_parallel and sequence_parallel_applies(b.kind)
        checkpoint = input_bytes.get(b.name, 0.0) * samples * (
            sequence_parallel_padding(b.sequence, shard[b.name]) / shard[b.name] if sp else 1)
        out = out + activation_residency(tier, act, checkpoint).scaled(in_flight_micro_batches)
        transient = max(transient, activation_transient(tier, act))
        if tier == "selective":
            transient = max(transient, b.attention_core_bytes * samples / shard[b.name])
    return out.put("gpu", transient)


def grad_buffer_bytes(trained: Any, *, dp: int, zero: int, dtype: str = "bf16", grad_buffer: GradBuffer = "dtype") -> Any:
    """Bytes one rank's gradients take beyond model_state_bytes' (gradients in the training dtype) for `trained`
    trained parameters on the rank: 0 with grad_buffer="dtype" (mmplan's runtime: gradients in the parameters' dtype);
    with "fp32", Megatron-LM's: with bf16 / fp16 parameters its DistributedDataParallel accumulates and reduces every
    gradient in a contiguous fp32 buffer (`param.main_grad`, megatron/core/distributed/param_and_grad_buffer.py; the
    default --accumulate-allreduce-grads-in-fp32 for bf16) and no separate half-precision .grad is kept (gradient
    accumulation fusion writes the weight gradient into main_grad). That is 4 bytes per parameter where
    model_state_bytes counts 2: Megatron-LM's megatron/training/theoretical_memory_usage.py counts 18 bytes per
    parameter (2 weight + 4 main_grad + 12 Adam) without the distributed optimizer and 6 + 12/dp with it (ZeRO-1: the
    gradient buffer is not sharded). Sharded like the gradients under ZeRO-2/3 (zero_divisors)."""
    if grad_buffer not in ("dtype", "fp32"):
        raise MmplanError(f"grad_buffer must be 'dtype' or 'fp32', got {grad_buffer!r}")
    if grad_buffer == "dtype":
        return 0.0 * trained
    return max(0, MAIN_GRAD_BYTES - DTYPE_BYTES[dtype]) * trained / zero_divisors(zero, dp).grads
