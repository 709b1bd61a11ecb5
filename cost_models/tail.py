"""A pipeline stage's per-step tail after its last backward: gradient sync, optimizer step, parameter all-gather
(ZeRO 1-2's, whose exposed part the tail keeps wherever the runtime runs it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.comm import all_gather_time, all_reduce_time, dp_link, reduce_scatter_time, ring_bytes_sent
from cost_models.fsdp import overlap_share
from cost_models.memory import DTYPE_BYTES, StateTiers, zero_divisors
from cost_models.overhead import optimizer_time, zero_optimizer_time
from plans.cluster import Cluster, Link
from plans.plan import Group, Training


@dataclass(frozen=True, slots=True)
class StageTail:
    """Per-step work of a stage after its last backward (seconds, on each of its ranks), and the bytes one of its
    ranks sends for it."""

    grad_sync: float
    optimizer: float
    param_gather: float
    bytes_sent: float

    @property
    def total(self) -> float:
        """The three run one after another: sync, then step, then gather."""
        return self.grad_sync + self.optimizer + self.param_gather


# PyTorch DDP's default gradient bucket (torch.nn.parallel.DistributedDataParallel, bucket_cap_mb=25; Li et al.
# 2020, "PyTorch Distributed", section 3.2.3); the runtime's bucketed reduction uses the same size.
BUCKET_BYTES = 25 * 2**20


def stage_tail(group: Group, stage_index: int, params_per_rank: float, training: Training, cluster: Cluster,
               *, overlap_s: float = 0.0, tensors: int = 0, grad_bytes: int | None = None,
               gather_overlap_s: float | None = None, gather_exposed_s: float | None = None) -> StageTail:
    """The tail of stage `stage_index` of `group` holding `params_per_rank` parameters on each rank (tp-parallel
    blocks divided by tp), its collectives over the link of its dp group (dp_link); see tail_over."""
    stage = group.stages[stage_index]
    return tail_over(params_per_rank, dp=group.dp, zero=group.zero, memory=stage.memory,
                     link=dp_link(cluster, stage.ranks, group.tp), cluster=cluster, dtype=training.dtype,
                     optimizer=training.optimizer, overlap_s=overlap_s, tensors=tensors, grad_bytes=grad_bytes,
                     gather_overlap_s=gather_overlap_s, gather_exposed_s=gather_exposed_s)


def hidden_exposure(total_s, last_bucket_s, overlap_s, share: float):
    """Seconds a bucketed collective of `total_s` adds to a rank when it runs beside `overlap_s` seconds of compute,
    but for its last bucket (`last_bucket_s`), which is ready only when that compute ends: the larger of that bucket,
    what outlasts the compute, and the compute's slowdown while the collective holds `share` of the SMs (FSDP2's
    rule, fsdp.overlapped: c beside x takes max(x, c + share x), the x - c or share x beyond c). No compute to hide
    behind (overlap_s 0): the whole collective. Works on numpy arrays (the solver's segments)."""
    hidden = np.maximum(np.minimum(total_s, overlap_s), 0.0)
    return np.maximum(last_bucket_s, np.maximum(total_s - overlap_s, share * hidden * (overlap_s > 0)))


def tail_over(params_per_rank: float, *, dp: int, zero: int, memory: StateTiers, link: Link, cluster: Cluster,
              dtype: str = "bf16", optimizer: str = "adam", overlap_s: float = 0.0, tensors: int = 0,
              grad_bytes: int | None = None, gather_overlap_s: float | None = None,
              gather_exposed_s: float | None = None) -> StageTail:
    """The tail of a stage whose dp group communicates over `link` (stage_tail, for callers that know the link
    but not the ranks yet: the solver's candidates).

    ZeRO 0: ring all-reduce of the gradients; ZeRO 1: reduce-scatter, then all-gather of the updated
    parameters (Megatron's distributed optimizer; the same 2(n-1)/n volume, ZeRO section 7.2.1);
    ZeRO 2: the reduce-scatter ran after every backward, the all-gather remains; ZeRO 3: nothing. The
    optimizer step updates the rank's ZeRO share of the parameters (zero_divisors; optimizer_step_time).
    Collective times: cost_models/comm.py (Thakur, Rabenseifner & Gropp 2005).
    The gradient sync (ZeRO 0-1) is bucketed (BUCKET_BYTES) and each bucket is reduced asynchronously as soon as
    the last micro-batch's backward has produced it (DDP's overlap, Li et al. 2020, section 3.2.3): it hides
    behind the `overlap_s` seconds of that backward, except the last bucket, which is ready only at its end.
    `grad_sync` is the exposed part: besides what outlasts that backward, the SMs NCCL's kernels take from the GEMMs
    they run beside while the hidden part lasts (fsdp.overlap_share, the same share FSDP2's overlap pays:
    hidden_exposure). `tensors`: the stage's trained parameter tensors, for a cluster with a measured
    per-tensor optimizer cost (cost_models/overhead.py; each rank steps every tensor's shard under ZeRO too).
    ZeRO 1-2's parameter all-gather: mmplan's runtime (FSDP2, runtime/zero.py) runs it lazily, block by block, in
    the next step's first forward of each chunk (nothing gathers after the optimizer step); on a GPU cluster the
    caller passes what it adds there as `gather_exposed_s` (fsdp.first_forward_gather: the first block's gather
    exposed, the others beside the previous block's compute), kept here as the tail's part, so a step's order of
    ops stays. Without it (CPU ranks: nothing overlaps there, offload.overlaps_compute) the whole all-gather, one
    after the other with the compute.
    Two keywords price other runtimes than mmplan's (cost_models.pipeline.simulate's switches): `grad_bytes`, the
    bytes of a gradient element as the runtime reduces it (default: `dtype`'s; Megatron-LM reduces fp32 gradients
    of bf16 models); `gather_overlap_s`, ZeRO 1-2's parameter all-gather issued bucket by bucket ahead of the next
    step's forward and hidden behind that many seconds of it but for its first bucket (Megatron-LM's
    `--overlap-param-gather`); it pays the same SM share (it takes precedence over `gather_exposed_s`).
    """
    nbytes = params_per_rank * DTYPE_BYTES[dtype]  # this rank's gradients (and parameters)
    gbytes = nbytes if grad_bytes is None else params_per_rank * grad_bytes
    sync, sent = 0.0, 0.0
    collective = all_reduce_time if zero == 0 else reduce_scatter_time
    share = overlap_share(cluster)
    if zero in (0, 1):
        sync = hidden_exposure(collective(gbytes, dp, link), collective(min(gbytes, BUCKET_BYTES), dp, link),
                               overlap_s, share)
        sent = ring_bytes_sent(gbytes, dp, all_reduce=zero == 0)
    gather = all_gather_time(nbytes, dp, link) if zero in (1, 2) else 0.0
    if gather and gather_overlap_s is not None:
        gather = hidden_exposure(gather, all_gather_time(min(nbytes, BUCKET_BYTES), dp, link), gather_overlap_s, share)
    elif gather and gather_exposed_s is not None:
        gather = gather_exposed_s
    sent += ring_bytes_sent(nbytes, dp, all_reduce=False) if zero in (1, 2) else 0.0
    updated = params_per_rank / zero_divisors(zero, dp).optimizer
    opt = optimizer_time(updated, memory, cluster, dtype=dtype, optimizer=optimizer, tensors=tensors) \
        + zero_optimizer_time(tensors, zero, cluster)
    return StageTail(sync, opt, gather, sent)


def tie_sync_time(params_per_rank: float, holders: int, link: Link, *, dtype: str = "bf16",
                  grad_bytes: int | None = None) -> float:
    """The all-reduce of a parameter tied across `holders` pipeline stages (cost_models/ties.py): each holder's
    gradient of its copy (`params_per_rank` elements on one rank: its tp and, under ZeRO, its dp share) summed over
    the stages holding it after their data-parallel sync, Megatron-LM's embedding-group all-reduce (Narayanan et al.
    2021, section 3); a ring over `link` (comm.all_reduce_time)."""
    width = DTYPE_BYTES[dtype] if grad_bytes is None else grad_bytes
    return all_reduce_time(params_per_rank * width, holders, link)
