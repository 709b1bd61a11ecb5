"""Plan -> Megatron-LM command-line arguments: the stock parallelism flags with --pipeline-model-parallel-layout for
uneven cut points, or the heterogeneous MIMO flags (--encoder-tp --encoder-dp --llm-offset --llm-tp --llm-pp --llm-dp)
of Megatron-LM's examples/mimo for an encoder on its own ranks."""
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
    is_megatron_order,
    nearest_chain,
    offloaded_as_recomputed,
    recompute_of,
    sequence_parallel,
    span,
    uniform_tier,
)
from planner.export.model import megatron_data_flags, megatron_model_flags, model_of, torchrun
from plans.graph import Profile
from plans.plan import Group, Plan, Stage

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
# The code the files are checked with (tests/fixtures/README.md): the stock flags are Megatron-LM core_v0.16.1's; the
# heterogeneous MIMO flags and examples.mimo.pretrain_mimo exist only on Megatron-LM main (this commit).
MEGATRON_LM = "Megatron-LM core_v0.16.1 (megatron-core 0.16.1)"
MIMO_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
MEGATRON_LM_MIMO = (f"Megatron-LM main at commit {MIMO_COMMIT} (2026-08-22): the MIMO flags, examples.mimo.pretrain_mimo and "
                    "ModuleGridSpec are not in core_v0.16.1 / megatron-core 0.16.1")


def export(plan: Plan, drops: Drops, source: str, profile: Profile | None = None) -> str:
    """The argument list as a file: comment lines, then one flag (with its value) per line: the layout, the model's
    shape from the profile, and placeholders Megatron-LM refuses for what mmplan cannot know (data, tokenizer)."""
    roles = Roles.of(plan)
    notes: list[str] = []
    hetero = _hetero_groups(plan, drops)
    if hetero is None:
        args, world = _stock(plan, roles, drops, notes)
    else:
        args, world = _mimo(plan, roles, drops, notes, *hetero)
    text_only = all(roles.is_llm(b) for g in plan.groups for b in g.blocks)
    tp = max(int(flag[1]) for flag in args if flag[0] in ("--tensor-model-parallel-size", "--llm-tp"))
    args += megatron_model_flags(model_of(plan, profile), tp, not text_only, notes) + megatron_data_flags()
    version = MEGATRON_LM if hetero is None else MEGATRON_LM_MIMO
    lines = [f"# {line}" for line in header(plan, source, "megatron", drops.dropped, notes, version)]
    lines += [f"# use: {line}" for line in usage(plan, args, hetero is not None, text_only, world)]
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


def _hetero_groups(plan: Plan, drops: Drops) -> tuple[Group, Group] | None:
    """(encoder group, LLM group) when the plan has per-group layouts Megatron's MIMO flags can hold; None for one
    layout. The flags hold one encoder grid on its own ranks: other multi-group plans become the nearest chain."""
    groups = collapsed(plan)
    if groups is not None and len(groups) == 1:
        return None  # one layout (colocated groups sharing one layout are one)
    if groups is not None and len(groups) == 2:
        return groups[0], groups[1]
    why = ("colocated groups with their own layouts (Megatron-LM's heterogeneous MIMO flags place module grids on "
           "disjoint ranks)" if groups is None else
           f"{len(groups) - 1} encoder groups on their own ranks (Megatron-LM's heterogeneous MIMO flags hold one encoder grid)")
    drops.cannot(why, "one layout for the whole model")
    return None


def _pipeline_flags(plan: Plan, pp: int, dp: int, blocks, chunks, roles: Roles, drops: Drops) -> list[list[str]]:
    """The LLM pipeline's layout string (uneven cut points), its layer count and the batch flags."""
    args = []
    if pp > 1:
        args.append(["--pipeline-model-parallel-layout", layout_string(chunks, roles, drops)])
        if plan.training.schedule == "gpipe":
            drops.cannot("the GPipe schedule", "1F1B, Megatron's pipeline schedule (it holds fewer micro-batches in flight)")
    args.append(["--num-layers", str(len(roles.llm_layers(blocks)))])
    return args + _batch_flags(plan, dp)


# --- one layout: stock Megatron-LM flags ----------------------------------------------------------------------------


def _stock(plan: Plan, roles: Roles, drops: Drops, notes: list[str]) -> tuple[list[list[str]], int]:
    already = bool(drops.dropped)  # _hetero_groups said why the plan becomes one layout: do not say it twice
    chain = nearest_chain(plan, drops, headline=not already)
    notes += [chain.note] if chain.note else []
    chain = encoders_first(chain, roles, drops)
    stages = no_activation_offload(chain.stages, drops)
    chunks = model_chunks(stages, plan.training.virtual_stages, roles, drops)
    args = [["--tensor-model-parallel-size", str(chain.tp)], ["--pipeline-model-parallel-size", str(chain.pp)]]
    args += _pipeline_flags(plan, chain.pp, chain.dp, chain.blocks, chunks, roles, drops)
    if chain_sequence_parallel(chain, plan, drops):
        args.append(["--sequence-parallel"])
    args += _zero_flags(chain.zero)
    args += _recompute_flags(recompute_of([(blocks, mem) for blocks, mem in chunks], roles, drops))
    args += _tier_flags(stages, drops)
    args += _dtype_flags(plan)
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


def _batch_flags(plan: Plan, dp: int) -> list[list[str]]:
    # Megatron's micro-batch is one data-parallel replica's; ours spans a group's replicas (plans/plan.py Training).
    return [["--micro-batch-size", str(plan.training.micro_batch // dp)], ["--global-batch-size", str(plan.training.global_batch)]]


def _zero_flags(zero: int) -> list[list[str]]:
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


def _recompute_flags(r: Recompute) -> list[list[str]]:
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


def _tier_flags(stages, drops: Drops) -> list[list[str]]:
    if not optimizer_offload(stages, drops):
        return []
    return [["--optimizer-cpu-offload"], ["--use-precision-aware-optimizer"], ["--optimizer-offload-fraction", "1.0"]]


def _dtype_flags(plan: Plan) -> list[list[str]]:
    flags = [[f] for f in DTYPE_FLAGS[plan.training.dtype]]
    if plan.training.optimizer == "sgd":
        flags.append(["--optimizer", "sgd"])
    return flags


# --- per-group layouts: Megatron-LM's heterogeneous MIMO flags ---------------------------------------------------------


def _mimo(plan: Plan, roles: Roles, drops: Drops, notes: list[str], enc: Group, llm: Group) -> tuple[list[list[str]], int]:
    """examples/mimo/training/args.py: the encoder grid (tp, dp; cp = pp = 1) on ranks 0.., the language grid at
    --llm-offset; module grids must cover the world; hetero MIMO needs the distributed optimizer."""
    enc_dp = enc.dp
    if enc.pp > 1:
        enc_dp = enc.dp * enc.pp
        drops.cannot(f"pipeline parallelism in encoder group {enc.name!r} (pp={enc.pp}; Megatron's encoder grid has pp=1)",
                     f"encoder dp={enc_dp} on the same {len(enc.ranks)} ranks")
    misplaced = [b for b in llm.blocks if not roles.is_llm(b)] + [b for b in enc.blocks if roles.is_llm(b)]
    if misplaced:
        drops.cannot(f"blocks {', '.join(misplaced[:3])}{' ..' if len(misplaced) > 3 else ''} in the other module's group "
                     "(MIMO runs encoders and projectors on the encoder grid, the LLM on the language grid)",
                     "each block on its module's grid")
    enc_n, llm_n = len(enc.ranks), len(llm.ranks)
    offsets = {enc.name: min(enc.ranks), llm.name: min(llm.ranks)}
    for g in (enc, llm):
        if not is_megatron_order(g, offsets[g.name]):
            drops.cannot(f"the rank order of group {g.name!r} (ranks {span(g.ranks)})", "consecutive ranks, tp fastest, then dp, then pp")
    if offsets[enc.name] != 0 or offsets[llm.name] != enc_n:
        gpn = plan.cluster.gpus_per_node
        if gpn % enc.tp or gpn % llm.tp or enc_n % llm.tp:  # a tensor-parallel group would straddle two nodes
            drops.cannot("an encoder grid that does not start at rank 0", f"encoder on ranks 0-{enc_n - 1}, LLM from rank {enc_n}")
        else:
            notes.append(f"ranks renumbered: encoder {enc.name!r} {span(enc.ranks)} -> 0-{enc_n - 1}, LLM {llm.name!r} "
                         f"{span(llm.ranks)} -> {enc_n}-{enc_n + llm_n - 1} (Megatron's MIMO grids put the encoder first; "
                         "every tensor-parallel group stays inside a node)")
    used = enc_n + llm_n
    if used != plan.cluster.world_size:
        notes.append(f"the plan uses {used} of the cluster's {plan.cluster.world_size} GPUs: launch {used} ranks")
    zero = max(enc.zero, llm.zero, 1)
    if min(enc.zero, llm.zero) < 1:
        drops.cannot("ZeRO stage 0 (Megatron's heterogeneous MIMO training requires --use-distributed-optimizer)", "ZeRO-1")
    if enc.zero != llm.zero and zero > 1:
        drops.cannot(f"different ZeRO stages per group ({enc.zero}, {llm.zero})", f"ZeRO-{zero} for both")
    if set(activation_tiers(enc.stages)) - {"keep"} or any(
            (s.memory.params, s.memory.grads, s.memory.optimizer) != ("gpu", "gpu", "gpu") for s in enc.stages):
        drops.cannot(f"memory tiers or recomputation in encoder group {enc.name!r} (the MIMO flags configure the LLM's)",
                     "the encoder's state and activations on the GPU")
    stages = no_activation_offload(llm.stages, drops)
    chunks = model_chunks(stages, plan.training.virtual_stages, roles, drops)
    args = [["--encoder-tp", str(enc.tp)], ["--encoder-dp", str(enc_dp)], ["--llm-offset", str(enc_n)],
            ["--llm-tp", str(llm.tp)], ["--llm-pp", str(llm.pp)], ["--llm-dp", str(llm.dp)]]
    args += _pipeline_flags(plan, llm.pp, llm.dp, llm.blocks, chunks, roles, drops)
    if sequence_parallel((enc, llm), drops, " (Megatron's --sequence-parallel sets it for the whole run)"):
        args.append(["--sequence-parallel"])
    args += _zero_flags(zero)
    args += _recompute_flags(recompute_of(list(chunks), roles, drops))
    args += _tier_flags(stages, drops)
    args += _dtype_flags(plan)
    return args, used
