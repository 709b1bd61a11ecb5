"""Plan -> DeepSpeed ds_config.json: batch sizes, precision, ZeRO stage with offload_param / offload_optimizer on the
plan's memory tiers (cpu | nvme), activation checkpointing, AutoTP degree; one layout for the whole model."""
from __future__ import annotations

import json

from planner.export.common import Drops, Roles, header, nearest_chain, recompute_of, uniform_tier
from planner.export.model import describe, model_of, torchrun
from plans.graph import Profile
from plans.plan import Plan

NVME_PATH = "/local_nvme"  # DeepSpeed needs a path for the nvme device; the comment asks the user to set theirs


def export(plan: Plan, drops: Drops, source: str, profile: Profile | None = None) -> str:
    roles = Roles.of(plan)
    notes: list[str] = []
    chain = nearest_chain(plan, drops, why="groups with their own layouts (one DeepSpeed engine trains the whole model with one layout)")
    if chain.note:
        notes.append(chain.note)
    t = plan.training
    config: dict = {}
    mbs = t.micro_batch // chain.dp
    # DeepSpeedConfig checks train_batch = micro * accumulation * its world size, which is the data-parallel size
    # only when deepspeed.initialize gets an mpu (a PipelineModule brings one); AutoTP training is launched without
    # one, so DeepSpeed counts every rank: the ranks of a tensor-parallel group read the same samples.
    counted = chain.dp * (chain.tp if chain.pp == 1 else 1)
    config["train_batch_size"] = mbs * t.micro_batches * counted
    config["train_micro_batch_size_per_gpu"] = mbs
    config["gradient_accumulation_steps"] = t.micro_batches
    if counted != chain.dp:
        notes.append(f"train_batch_size {config['train_batch_size']} counts all {counted} ranks, as deepspeed.initialize "
                     f"without an mpu does (AutoTP): the plan's global batch is {t.global_batch} distinct samples, "
                     f"train_batch_size / autotp_size {chain.tp}")
    if t.dtype in ("bf16", "fp16"):
        config[t.dtype] = {"enabled": True}
    if chain.pp > 1:
        drops.cannot(f"pipeline cut points (pp={chain.pp}, cuts before {', '.join(s.blocks[0] for s in chain.stages[1:])}; "
                     "ds_config.json carries no cut points: DeepSpeed's PipelineModule partitions uniform, by parameters "
                     "or by layer type)", f"{chain.pp} stages balanced by parameters")
        notes.append(f"pipeline: DeepSpeed reads no stage count or partition from ds_config.json: build "
                     f"deepspeed.pipe.PipelineModule(layers, num_stages={chain.pp}, partition_method='parameters') "
                     "and pass it to deepspeed.initialize")
    if chain.tp > 1:
        config["tensor_parallel"] = {"autotp_size": chain.tp}
    zero = dict(stage=chain.zero)
    params = uniform_tier(chain.stages, "params", drops)
    grads = uniform_tier(chain.stages, "grads", drops)
    optimizer = uniform_tier(chain.stages, "optimizer", drops)
    if grads != "gpu" and optimizer == "gpu":
        drops.cannot(f"gradients in {grads} memory with the optimizer state on the GPU (ZeRO-Offload moves both)",
                     f"both in {grads} memory")
        optimizer = grads
    elif optimizer != "gpu" and grads != optimizer:
        drops.cannot(f"optimizer state in {optimizer} memory with gradients in {grads} memory (ZeRO-Offload keeps "
                     "gradients with the optimizer)", f"gradients in {'cpu' if optimizer == 'nvme' else optimizer} memory too")
    needs = max(3 if params != "gpu" or optimizer == "nvme" else 0, 1 if optimizer != "gpu" else 0)
    if needs > zero["stage"]:
        why = "offload_param" if params != "gpu" else "offload_optimizer to nvme" if optimizer == "nvme" else "offload_optimizer"
        drops.cannot(f"{why} with ZeRO-{zero['stage']} (DeepSpeed offloads from ZeRO-{needs} on)", f"ZeRO-{needs}")
        zero["stage"] = needs
    if params != "gpu":
        zero["offload_param"] = _device(params)
    if optimizer != "gpu":
        zero["offload_optimizer"] = _device(optimizer)
    if chain.pp > 1 and zero["stage"] > 1:  # PipelineEngine asserts zero_optimization_stage < 2
        drops.cannot(f"ZeRO-{zero['stage']} with a pipeline (DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1 only)",
                     "ZeRO-1" + (", parameters on the GPU" if "offload_param" in zero else ""))
        zero["stage"] = 1
        zero.pop("offload_param", None)
    config["zero_optimization"] = zero
    checkpointing = _activations(chain, roles, drops, notes)
    if checkpointing:
        config["activation_checkpointing"] = checkpointing
    if "nvme" in (params, optimizer):
        notes.append(f'set "nvme_path" to a directory on your NVMe drive (written as {NVME_PATH})')
    if t.optimizer != "adam":
        notes.append(f"optimizer: {t.optimizer} (give it in your code or an \"optimizer\" section)")
    model = model_of(plan, profile)
    notes += [f"model (build it in your script): {describe(s)}" for s in (*model.encoders, model.llm) if s is not None]
    if model.llm is None:
        notes.append(f"model shape not known ({model.why})")
    comment = header(plan, source, "deepspeed", drops.dropped, notes)
    comment.append("use: deepspeed.initialize(model=..., config=THIS_FILE)" + (" with model a PipelineModule" if chain.pp > 1 else "")
                   + "; DeepSpeed ignores the \"comment\" key")
    comment.append(f"launch on every node: {torchrun(plan, chain.world, 'YOUR_TRAINING_SCRIPT.py')} (data, tokenizer and "
                   "training length are your script's)")
    return json.dumps({"comment": comment, **config}, indent=2) + "\n"


def _device(tier: str) -> dict:
    return {"device": tier, "nvme_path": NVME_PATH, "pin_memory": True} if tier == "nvme" else {"device": tier, "pin_memory": True}


def _activations(chain, roles: Roles, drops: Drops, notes: list[str]) -> dict:
    """deepspeed.checkpointing's settings: recomputation (the model's code wraps its layers in
    deepspeed.checkpointing.checkpoint) and cpu_checkpointing for activations the plan offloads."""
    tiers = {t for s in chain.stages for t in s.memory.activations.values()}
    offloaded = sorted(tiers - {"keep", "recompute", "selective"})
    if not tiers - {"keep"}:
        return {}
    if "selective" in tiers:
        drops.cannot("selective recomputation of the attention core (DeepSpeed checkpoints whole layers)",
                     "activation checkpointing of those layers")
    if offloaded:
        drops.cannot(f"activation offload ({', '.join(offloaded)}; DeepSpeed keeps the checkpointed layer inputs in CPU "
                     "memory and recomputes the rest)", "activation checkpointing with cpu_checkpointing")
    chunks = [(s.blocks, s.memory) for s in chain.stages]
    recompute = recompute_of(chunks, roles, Drops(drops.target, True))
    layers = sum(1 for b in chain.blocks if roles.is_layer(b))
    recomputed = sum(1 for s in chain.stages for b, t in s.memory.activations.items() if t != "keep" and roles.is_layer(b))
    notes.append(f"activation checkpointing: wrap the {recomputed} of {layers} transformer layers the plan recomputes "
                 f"({recompute.kind}) in deepspeed.checkpointing.checkpoint")
    return {"partition_activations": False, "cpu_checkpointing": bool(offloaded), "contiguous_memory_optimization": False,
            "number_checkpoints": recomputed or None, "synchronize_checkpoint_boundary": False, "profile": False}
