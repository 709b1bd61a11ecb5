"""Plan -> torchtitan Python config: a ParallelismConfig (data-parallel replicate/shard degrees, tensor and pipeline
degrees, module_fqns_per_model_part for the cut points, schedule, micro-batch size), the TrainingConfig batch and
precision fields, and the activation-checkpointing policy; one layout for the whole model (torchtitan has one mesh)."""
from __future__ import annotations

from planner.export.common import (
    Drops,
    Roles,
    activation_tiers,
    header,
    nearest_chain,
    offloaded_as_recomputed,
    recompute_of,
    uniform_tier,
)
from planner.export.megatron import model_chunks
from plans.plan import Plan

# torchtitan's mesh is ["pp", "dp_replicate", "dp_shard", "cp", "tp"] (torchtitan/distributed/parallel_dims.py):
# tp fastest, then data parallel, then pp -- mmplan's rank order. ZeRO over data parallelism is FSDP2:
# 0 = DDP (replicate), 2 = FSDP without resharding after forward (SHARD_GRAD_OP), 3 = FSDP.
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
PRECISION = {"bf16": "bfloat16", "fp32": "float32"}


def export(plan: Plan, drops: Drops, source: str) -> str:
    roles = Roles.of(plan)
    if len(plan.groups) > 1 and any(g.colocated_with for g in plan.groups):
        what = "colocated groups with their own layouts (torchtitan applies one ParallelismConfig to the whole model)"
    else:
        what = "groups with their own layouts (torchtitan applies one ParallelismConfig to the whole model)"
    chain = nearest_chain(plan, drops, why=what)
    notes = [chain.note] if chain.note else []
    stages = chain.stages
    offloaded = sorted(activation_tiers(stages) - {"keep", "recompute", "selective"})
    if offloaded:
        drops.cannot(f"activation offload ({', '.join(offloaded)}; torchtitan checkpoints activations, it does not offload them)",
                     "those activations recomputed")
        stages = tuple(offloaded_as_recomputed(s) for s in stages)
    t = plan.training
    chunks = model_chunks(stages, t.virtual_stages, roles, drops)
    zero = chain.zero
    if zero == 1:
        drops.cannot("ZeRO-1 (torchtitan shards data parallelism with FSDP2: ZeRO-2 or ZeRO-3)", "ZeRO-2 (FSDP without resharding after forward)")
        zero = 2
    cpu_offload = _cpu_offload(stages, drops)
    if cpu_offload and zero < 3:
        drops.cannot(f"CPU offload with ZeRO-{zero} (torchtitan's CPU offload is FSDP2's, which shards parameters)", "ZeRO-3 (FSDP)")
        zero = 3
    mbs = t.micro_batch // chain.dp
    fields = {
        "data_parallel_replicate_degree": chain.dp if zero == 0 else 1,
        "data_parallel_shard_degree": 1 if zero == 0 else chain.dp,
        "tensor_parallel_degree": chain.tp,
    }
    if chain.tp > 1:
        fields["enable_sequence_parallel"] = any(g.sequence_parallel for g in plan.groups)  # the plan's Group.sequence_parallel
    if zero == 2:
        fields["fsdp_reshard_after_forward"] = "never"
    fields["pipeline_parallel_degree"] = chain.pp
    if chain.pp > 1:
        fields["pipeline_parallel_schedule"] = SCHEDULES[t.schedule] if len(chunks) > chain.pp or t.schedule != "interleaved" else "1F1B"
        fields["pipeline_parallel_microbatch_size"] = mbs
        fields["module_fqns_per_model_part"] = [list(blocks) for blocks, _ in chunks]
    # local_batch_size: samples per data-parallel rank per optimizer step (with pp, split into micro-batches);
    # without pp torchtitan accumulates gradients over global / (local * dp) micro-steps.
    local = mbs * t.micro_batches if chain.pp > 1 else mbs
    training = {"local_batch_size": local, "global_batch_size": t.global_batch}
    if t.dtype == "fp16":
        drops.cannot("fp16 mixed precision (torchtitan's FSDP mixed precision is bfloat16 or float32)", "bfloat16")
    training["mixed_precision_param"] = PRECISION.get(t.dtype, "bfloat16")
    if cpu_offload:
        training["enable_cpu_offload"] = True
    if t.optimizer != "adam":
        drops.cannot(f"the {t.optimizer} optimizer (torchtitan's default_adamw)", "AdamW")
    recompute = recompute_of(list(chunks), roles, drops)
    if recompute.kind == "block":
        drops.cannot(f"recomputing the first {recompute.layers} layers of each stage (torchtitan's FullAC wraps every "
                     "transformer block)", "every transformer block recomputed (FullAC)")
    if "selective" in activation_tiers(stages):
        drops.cannot("selective recomputation of the attention core (here: FullAC; torchtitan's own SAC is op-based)",
                     "every transformer block recomputed (FullAC)")
    ac = "None" if recompute.kind == "none" else "FullAC.Config()"
    lines = [f"# {line}" for line in header(plan, source, "torchtitan", drops.dropped, notes)]
    body = "".join(f"    {k}={v!r},\n" for k, v in fields.items())
    train = "".join(f"    {k}={v!r},\n" for k, v in training.items())
    return "\n".join(lines) + f'''

from torchtitan.config import ParallelismConfig
from torchtitan.distributed.activation_checkpoint import FullAC

WORLD_SIZE = {chain.world}  # ranks: tp fastest, then data parallel, then pp (torchtitan's mesh order)

parallelism = ParallelismConfig(
{body})

# fields of torchtitan.config.TrainingConfig
training = dict(
{train})

activation_checkpoint = {ac}


def apply(config):
    """Set these on a torchtitan Trainer.Config (e.g. one your model's config_registry returns); returns it."""
    config.parallelism = parallelism
    for name, value in training.items():
        setattr(config.training, name, value)
    if activation_checkpoint is not None:
        config.activation_checkpoint = activation_checkpoint
    return config
'''


def _cpu_offload(stages, drops: Drops) -> bool:
    """torchtitan's training.enable_cpu_offload puts parameters, gradients and optimizer state on the CPU together."""
    tiers = {kind: uniform_tier(stages, kind, drops) for kind in ("params", "grads", "optimizer")}
    if "nvme" in tiers.values():
        drops.cannot("NVMe tiers (torchtitan offloads to CPU memory only)", "CPU memory")
        tiers = {k: ("cpu" if v == "nvme" else v) for k, v in tiers.items()}
    if set(tiers.values()) == {"gpu"}:
        return False
    if set(tiers.values()) != {"cpu"}:
        kept = ", ".join(k for k, v in tiers.items() if v == "gpu")
        drops.cannot(f"offloading only some of parameters, gradients and optimizer state ({kept} on the GPU)",
                     "all three in CPU memory (training.enable_cpu_offload)")
    return True
