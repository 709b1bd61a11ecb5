"""Plan -> torchtitan Python config: a ParallelismConfig (data-parallel replicate/shard degrees, tensor and pipeline
degrees, module_fqns_per_model_part for the cut points, schedule, micro-batch size), the TrainingConfig batch and
precision fields, and the activation-checkpointing policy; one layout for the whole model (torchtitan has one mesh)."""
from __future__ import annotations

from planner.export.common import (
    Drops,
    Roles,
    activation_tiers,
    chain_sequence_parallel,
    header,
    nearest_chain,
    offloaded_as_recomputed,
    recompute_of,
    top,
    uniform_tier,
)
from planner.export.megatron import model_chunks
from planner.export.model import model_of, titan_model, torchrun
from plans.graph import Profile
from plans.plan import Plan

# torchtitan's mesh is ["pp", "dp_replicate", "dp_shard", "cp", "tp"] (torchtitan/distributed/parallel_dims.py):
# tp fastest, then data parallel, then pp -- mmplan's rank order. ZeRO over data parallelism is FSDP2:
# 0 = DDP (replicate), 2 = FSDP without resharding after forward (SHARD_GRAD_OP), 3 = FSDP resharding after it.
SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}
PRECISION = {"bf16": "bfloat16", "fp32": "float32"}


# torchtitan 0.3.0's Decoder (models/common/decoder.py; Llama3Model and the other LLMs): the names its
# module_fqns_per_model_part takes, for mmplan's llama-like LLM blocks.
DECODER = {"embed": "tok_embeddings", "norm": "norm", "head": "lm_head"}
# fsdp_reshard_after_forward: "default" resolves to no resharding when pp > 1 (distributed/fsdp.py
# get_fsdp_reshard_after_forward_policy), i.e. ZeRO-2; each ZeRO stage says its policy outright.
RESHARD = {0: "default", 2: "never", 3: "always"}  # 0: no FSDP (data_parallel_shard_degree 1)


def export(plan: Plan, drops: Drops, source: str, profile: Profile | None = None) -> str:
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
    chunks = model_chunks(stages, plan.training.virtual_stages, roles, drops)
    fields, cpu_offload = _parallelism(plan, chain, stages, chunks, roles, drops, notes)
    training = _training(plan, chain, cpu_offload, drops)
    ac = _activation_checkpoint(chunks, stages, roles, drops)
    section, apply_model = titan_model(model_of(plan, profile), notes)
    notes.append(f"launch on every node: {torchrun(plan, chain.world, '-m torchtitan.train --module YOUR_MODULE --config YOUR_CONFIG')} "
                 "with your config function calling apply() from this file")
    lines = [f"# {line}" for line in header(plan, source, "torchtitan", drops.dropped, notes)]
    body = "".join(f"    {k}={v!r},\n" for k, v in fields.items())
    train = "".join(f"    {k}={v!r},\n" for k, v in training.items())
    text = TEMPLATE.format(world=chain.world, body=body, train=train, ac=ac, model=section)
    return "\n".join(lines) + text.replace("    return config\n", apply_model + "    return config\n")


TEMPLATE = '''

from torchtitan.config import ParallelismConfig
from torchtitan.distributed.activation_checkpoint import FullAC

WORLD_SIZE = {world}  # ranks: tp fastest, then data parallel, then pp (torchtitan's mesh order)

parallelism = ParallelismConfig(
{body})

# fields of torchtitan.config.TrainingConfig
training = dict(
{train})

# Trainer.Config.activation_checkpoint: None is torchtitan's "none" policy (--activation_checkpoint:none), no
# checkpointing; Trainer.Config's default is SelectiveAC, so apply() always sets it
activation_checkpoint = {ac}
{model}

def apply(config):
    """Set these on a torchtitan Trainer.Config (e.g. one your model's config_registry returns); returns it."""
    config.parallelism = parallelism
    for name, value in training.items():
        setattr(config.training, name, value)
    config.activation_checkpoint = activation_checkpoint
    return config
'''


def _parallelism(plan: Plan, chain, stages, chunks, roles: Roles, drops: Drops, notes: list[str]) -> tuple[dict, bool]:
    """ParallelismConfig's fields (every one the plan decides), and whether training offloads to the CPU."""
    t = plan.training
    zero = chain.zero
    if zero == 1:
        drops.cannot("ZeRO-1 (torchtitan shards data parallelism with FSDP2: ZeRO-2 or ZeRO-3)", "ZeRO-2 (FSDP without resharding after forward)")
        zero = 2
    cpu_offload = _cpu_offload(stages, drops)
    if cpu_offload and zero < 3:
        drops.cannot(f"CPU offload with ZeRO-{zero} (torchtitan's CPU offload is FSDP2's, which shards parameters)", "ZeRO-3 (FSDP)")
        zero = 3
    fields = {
        "data_parallel_replicate_degree": chain.dp if zero == 0 else 1,
        "data_parallel_shard_degree": 1 if zero == 0 else chain.dp,
        "fsdp_reshard_after_forward": RESHARD[zero],
        "tensor_parallel_degree": chain.tp,
        # torchtitan's default is on: off must be said (it shards along tp only, so at tp 1 it does nothing)
        "enable_sequence_parallel": chain_sequence_parallel(chain, plan, drops),
        "pipeline_parallel_degree": chain.pp,
    }
    if chain.pp > 1:
        fields["pipeline_parallel_schedule"] = SCHEDULES[t.schedule] if len(chunks) > chain.pp or t.schedule != "interleaved" else "1F1B"
        fields["pipeline_parallel_microbatch_size"] = t.micro_batch // chain.dp
        fields["module_fqns_per_model_part"] = model_parts(chunks, roles, notes)
    return fields, cpu_offload


def model_parts(chunks, roles: Roles, notes: list[str]) -> list[list[str]]:
    """module_fqns_per_model_part in torchtitan's names: a llama-like LLM's blocks (embed, layers.N, norm, head) as
    its Decoder's (tok_embeddings, layers.N, norm, lm_head); other blocks keep mmplan's names, and a note says so."""
    def name(block: str) -> str | None:
        if not roles.is_llm(block):
            return None
        rest = roles.local(block)
        if roles.is_layer(block) and rest.startswith("layers."):
            return rest
        return DECODER.get(rest)

    kept = [b for blocks, _ in chunks for b in blocks if name(b) is None]
    parts = [[name(b) or b for b in blocks] for blocks, _ in chunks]
    llm_kept = [b for b in kept if roles.is_llm(b)]
    if llm_kept:
        notes.append(f"module_fqns_per_model_part: the LLM is not llama-like ({', '.join(llm_kept[:3])} have no torchtitan "
                     "Decoder name); mmplan's block names are kept: rename them to your model's module FQNs")
    elif kept:
        notes.append(f"module_fqns_per_model_part: the LLM's blocks carry torchtitan's Decoder names (tok_embeddings, "
                     f"layers.N, norm, lm_head); {', '.join(sorted({top(b) for b in kept}))} keep mmplan's names: torchtitan's "
                     "VLMs hold the encoder as `vision_encoder` in the first part; rename them to your model's FQNs")
    return parts


def _training(plan: Plan, chain, cpu_offload: bool, drops: Drops) -> dict:
    """TrainingConfig's batch, precision and offload fields."""
    t = plan.training
    mbs = t.micro_batch // chain.dp
    # local_batch_size: samples per data-parallel rank per optimizer step (with pp, split into micro-batches);
    # without pp torchtitan accumulates gradients over global / (local * dp) micro-steps.
    local = mbs * t.micro_batches if chain.pp > 1 else mbs
    training = {"local_batch_size": local, "global_batch_size": t.global_batch}
    if t.dtype == "fp16":
        drops.cannot("fp16 mixed precision (torchtitan's FSDP mixed precision is bfloat16 or float32)", "bfloat16")
    training["mixed_precision_param"] = PRECISION.get(t.dtype, "bfloat16")
    training["enable_cpu_offload"] = cpu_offload
    if t.optimizer != "adam":
        drops.cannot(f"the {t.optimizer} optimizer (torchtitan's default_adamw)", "AdamW")
    return training


def _activation_checkpoint(chunks, stages, roles: Roles, drops: Drops) -> str:
    """The policy as code: None (torchtitan's "none") or FullAC."""
    recompute = recompute_of(list(chunks), roles, drops)
    if recompute.kind == "block":
        drops.cannot(f"recomputing the first {recompute.layers} layers of each stage (torchtitan's FullAC wraps every "
                     "transformer block)", "every transformer block recomputed (FullAC)")
    if "selective" in activation_tiers(stages):
        drops.cannot("selective recomputation of the attention core (here: FullAC; torchtitan's own SAC is op-based)",
                     "every transformer block recomputed (FullAC)")
    return "None" if recompute.kind == "none" else "FullAC.Config()"


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
