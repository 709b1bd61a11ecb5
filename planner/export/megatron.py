"""Plan -> Megatron-LM core_v0.16.1 command-line arguments: the stock parallelism flags, with
--pipeline-model-parallel-layout for uneven cut points (one layout for the whole model; an encoder on its own ranks is
`--to megatron-mimo`, planner/export/megatron_mimo.py), and the flags and launch lines both targets share."""
from __future__ import annotations

import shlex
from dataclasses import replace

from planner.export.common import (
    Chain,
    Drops,
    Recompute,
    Roles,
    activation_tiers,
    chain_sequence_parallel,
    collapsed,
    header,
    nearest_chain,
    offloaded_as_recomputed,
    recompute_of,
    uniform_tier,
)
from planner.export.model import megatron_data_flags, megatron_model_flags, model_of, torchrun
from plans.graph import Profile
from plans.plan import Plan, Stage

# Megatron's names: "E" the LLM's embedding, "t" a decoder (transformer) layer, "L" the loss (final norm + head),
# "|" between pipeline stages; with v model chunks per rank the layout lists pp*v stages, chunk-major
# (megatron/core/transformer/pipeline_parallel_layer_layout.py).
ZERO_FLAGS = {
    0: [],
    1: ["--use-distributed-optimizer"],
    2: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--ckpt-format", "fsdp_dtensor"],
    3: ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format", "fsdp_dtensor"],
}
DTYPE_FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}


def export(plan: Plan, drops: Drops, source: str, profile: Profile | None = None) -> str:
    """The argument list as a file: comment lines, then one flag (with its value) per line: the layout, the model's
    shape from the profile, and placeholders Megatron-LM refuses for what mmplan cannot know (data, tokenizer)."""
    roles = Roles.of(plan)
    notes: list[str] = []
    args, world = _stock(plan, roles, drops, notes)
    return args_file(plan, roles, args, world, drops, notes, profile, source, "megatron")


def args_file(plan: Plan, roles: Roles, args: list[list[str]], world: int, drops: Drops, notes: list[str],
              profile: Profile | None, source: str, target: str) -> str:
    """The file both Megatron-LM targets write: the header, the `# use:` launch lines, the layout flags, the model's
    shape and the data placeholders."""
    text_only = all(roles.is_llm(b) for g in plan.groups for b in g.blocks)
    tp = max(int(flag[1]) for flag in args if flag[0] in ("--tensor-model-parallel-size", "--llm-tp"))
    args = args + megatron_model_flags(model_of(plan, profile), tp, not text_only, notes) + megatron_data_flags()
    lines = [f"# {line}" for line in header(plan, source, target, drops.dropped, notes)]
    lines += [f"# use: {line}" for line in usage(plan, args, target == "megatron-mimo", text_only, world)]
    lines += [flag[0] if flag[0].startswith("#") else " ".join(shlex.quote(a) for a in flag) for flag in args]
    return "\n".join(lines) + "\n"


def usage(plan: Plan, args: list[list[str]], mimo: bool, text_only: bool, world: int) -> list[str]:
    """How to launch the file with bash on each node: the environment validate_args asks for, the arguments read into an
    array (eval keeps the quoting of values such as 'Et*16|t*16L'; word-splitting $(...) would keep the quotes), the
    torchrun line for the plan's nodes and GPUs per node."""
    flags = {flag[0]: flag[1:] for flag in args}
    tp = max(int(flag[1]) for flag in args if flag[0] in ("--tensor-model-parallel-size", "--llm-tp", "--encoder-tp"))
    lines = []
    if "--use-megatron-fsdp" in flags:  # validate_args: "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one"
        lines.append("unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron FSDP refuses 1 (with tensor parallelism it only warns)")
    elif tp > 1:  # validate_args refuses tensor parallelism on Hopper and older without it
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1  # tensor parallelism on Hopper and older")
    lines.append("eval \"MEGATRON_ARGS=($(grep -v '^#' THIS_FILE))\"")
    script = "-m examples.mimo.pretrain_mimo" if mimo else "pretrain_gpt.py" if text_only else "pretrain_vlm.py"
    lines.append(torchrun(plan, world, script) + " \"${MEGATRON_ARGS[@]}\"  # in Megatron-LM's directory, on every node")
    return lines


def _one_layout_why(plan: Plan) -> str:
    """Why a plan that is not one pipeline needs the nearest one layout in Megatron-LM core_v0.16.1 (which runs one
    layout), naming `--to megatron-mimo` where Megatron-LM main's heterogeneous MIMO flags express the plan."""
    groups = collapsed(plan)
    if groups is None:
        return "colocated groups with their own layouts (Megatron-LM core_v0.16.1 runs one layout for the whole model)"
    if len(groups) == 2:
        return ("an encoder group on its own ranks with its own layout (Megatron-LM core_v0.16.1 runs one layout; "
                "`--to megatron-mimo` writes Megatron-LM main's heterogeneous MIMO flags for it)")
    return f"{len(groups) - 1} encoder groups on their own ranks (Megatron-LM core_v0.16.1 runs one layout for the whole model)"


def pipeline_flags(plan: Plan, pp: int, dp: int, blocks, chunks, roles: Roles, drops: Drops) -> list[list[str]]:
    """The LLM pipeline's layout string (uneven cut points), its layer count and the batch flags."""
    args = []
    if pp > 1:
        args.append(["--pipeline-model-parallel-layout", layout_string(chunks, roles, drops)])
        if plan.training.schedule == "gpipe":
            drops.cannot("the GPipe schedule", "1F1B, Megatron's pipeline schedule (it holds fewer micro-batches in flight)")
    args.append(["--num-layers", str(len(roles.llm_layers(blocks)))])
    return args + batch_flags(plan, dp)


# --- one layout: stock Megatron-LM flags ----------------------------------------------------------------------------


def _stock(plan: Plan, roles: Roles, drops: Drops, notes: list[str]) -> tuple[list[list[str]], int]:
    chain = nearest_chain(plan, drops, why=_one_layout_why(plan))
    notes += [chain.note] if chain.note else []
    chain = encoders_first(chain, roles, drops)
    stages = no_activation_offload(chain.stages, drops)
    chunks = model_chunks(stages, plan.training.virtual_stages, roles, drops)
    args = [["--tensor-model-parallel-size", str(chain.tp)], ["--pipeline-model-parallel-size", str(chain.pp)]]
    args += pipeline_flags(plan, chain.pp, chain.dp, chain.blocks, chunks, roles, drops)
    if chain_sequence_parallel(chain, plan, drops):
        args.append(["--sequence-parallel"])
    args += zero_flags(chain.zero)
    args += recompute_flags(recompute_of([(blocks, mem) for blocks, mem in chunks], roles, drops))
    args += tier_flags(stages, drops)
    args += dtype_flags(plan)
    return args, chain.world


def encoders_first(chain: Chain, roles: Roles, drops: Drops) -> Chain:
    """Megatron builds a VLM's encoders on the first pipeline stage: move encoder blocks of later stages there."""
    later = [b for s in chain.stages[1:] for b in s.blocks if not roles.is_llm(b)]
    if not later:
        return chain
    drops.cannot(f"encoder blocks after the first pipeline stage ({later[0]} .. {later[-1]}, {len(later)} blocks)",
                 "every encoder block in the first stage, as Megatron builds a VLM's encoders")
    first = chain.stages[0]
    moved = replace(first, blocks=first.blocks + tuple(later))
    rest = tuple(replace(s, blocks=tuple(b for b in s.blocks if roles.is_llm(b))) for s in chain.stages[1:])
    return replace(chain, stages=(moved, *rest))


def no_activation_offload(stages, drops: Drops) -> tuple[Stage, ...]:
    offloaded = sorted(activation_tiers(stages) - {"keep", "recompute", "selective"})  # selective: --recompute-granularity
    if offloaded:
        drops.cannot(f"activation offload ({', '.join(offloaded)})", "those activations recomputed")
    return tuple(offloaded_as_recomputed(s) for s in stages)


def model_chunks(stages, v: int, roles: Roles, drops: Drops):
    """(blocks, memory) per model chunk in Megatron's layout order: chunk c of stage i is entry c*pp + i. With v > 1
    each stage's blocks fall into v runs of consecutive layers (planner/solver/megatron_split.py's interleaved split)."""
    if v == 1:
        return [(s.blocks, s.memory) for s in stages]
    per_stage = [_runs(s, roles) for s in stages]
    if any(len(runs) != v for runs in per_stage):
        drops.cannot(f"interleaved model chunks that are not {v} runs of consecutive layers per stage",
                     "one chunk per stage (1F1B)")
        return [(s.blocks, s.memory) for s in stages]
    return [(per_stage[i][c], stages[i].memory) for c in range(v) for i in range(len(stages))]


def _runs(stage: Stage, roles: Roles) -> list[tuple[str, ...]]:
    """Split a stage's blocks where the LLM layer index jumps (the start of the next model chunk)."""
    runs: list[list[str]] = [[]]
    last = None
    for b in stage.blocks:
        if roles.is_llm(b) and roles.is_layer(b):
            index = int(b.rsplit(".", 1)[1])
            if last is not None and index != last + 1:
                runs.append([])
            last = index
        runs[-1].append(b)
    return [tuple(r) for r in runs]


def layout_string(chunks, roles: Roles, drops: Drops) -> str:
    """Megatron's --pipeline-model-parallel-layout: per chunk "E" (first only), "t" per LLM layer, "L" (last only)."""
    flat = [b for blocks, _ in chunks for b in blocks]
    llm = [b for b in flat if roles.is_llm(b)]
    layers = [i for i, b in enumerate(llm) if roles.is_layer(b)]
    embed = set(llm[:layers[0]]) if layers else set()
    loss = set(llm[layers[-1] + 1:]) if layers else set()
    where_embed = [i for i, (blocks, _) in enumerate(chunks) if embed & set(blocks)]
    where_loss = [i for i, (blocks, _) in enumerate(chunks) if loss & set(blocks)]
    if where_embed and where_embed != [0]:
        drops.cannot(f"the LLM's embedding in pipeline stage {where_embed[0]}", "in the first stage (Megatron's layout starts with E)")
    if where_loss and where_loss != [len(chunks) - 1]:
        drops.cannot(f"the LLM's final norm and head in pipeline stage {where_loss[0]}", "in the last stage (Megatron's layout ends with L)")
    parts = []
    for i, (blocks, _) in enumerate(chunks):
        n = sum(1 for b in blocks if roles.is_llm(b) and roles.is_layer(b))
        text = ("E" if i == 0 else "") + ("t" * n if n < 3 else f"t*{n}") + ("L" if i == len(chunks) - 1 else "")
        parts.append(text)
    return "|".join(parts)


def batch_flags(plan: Plan, dp: int) -> list[list[str]]:
    # Megatron's micro-batch is one data-parallel replica's; ours spans a group's replicas (plans/plan.py Training).
    return [["--micro-batch-size", str(plan.training.micro_batch // dp)], ["--global-batch-size", str(plan.training.global_batch)]]


def zero_flags(zero: int) -> list[list[str]]:
    flags = ZERO_FLAGS[zero]
    out, i = [], 0
    while i < len(flags):  # group each flag with its value
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out.append(flags[i:i + 2])
            i += 2
        else:
            out.append(flags[i:i + 1])
            i += 1
    return out


def recompute_fields(r: Recompute) -> dict:
    """TransformerConfig's recompute_granularity / recompute_method / recompute_num_layers for `r`."""
    if r.kind == "none":
        return {}
    if r.kind == "selective":
        return {"recompute_granularity": "selective"}
    method, n = ("uniform", 1) if r.kind == "full" else ("block", r.layers)
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": n}


def recompute_flags(r: Recompute) -> list[list[str]]:
    return [[f"--{k.replace('_', '-')}", str(v)] for k, v in recompute_fields(r).items()]


def optimizer_offload(stages, drops: Drops) -> bool:
    """Whether the optimizer runs on the CPU (Megatron's HybridDeviceOptimizer: fp32 master weights and Adam state
    in host memory, gradients copied there each step); Megatron keeps parameters on the GPU and has no NVMe tier."""
    params = uniform_tier(stages, "params", drops)
    grads = uniform_tier(stages, "grads", drops)
    optimizer = uniform_tier(stages, "optimizer", drops)
    if params != "gpu":
        drops.cannot(f"parameters in {params} memory (Megatron keeps parameters on the GPU)", "parameters on the GPU")
    if optimizer == "nvme" or grads == "nvme":
        drops.cannot("optimizer state or gradients on NVMe (Megatron offloads the optimizer to CPU only)", "in CPU memory")
        optimizer = "cpu"
    if grads == "cpu" and optimizer == "gpu":
        drops.cannot("gradients in CPU memory without the optimizer state", "gradients and optimizer state in CPU memory")
        optimizer = "cpu"
    return optimizer != "gpu"


def tier_flags(stages, drops: Drops) -> list[list[str]]:
    if not optimizer_offload(stages, drops):
        return []
    return [["--optimizer-cpu-offload"], ["--use-precision-aware-optimizer"], ["--optimizer-offload-fraction", "1.0"]]


def dtype_flags(plan: Plan) -> list[list[str]]:
    flags = [[f] for f in DTYPE_FLAGS[plan.training.dtype]]
    if plan.training.optimizer == "sgd":
        flags.append(["--optimizer", "sgd"])
    return flags
