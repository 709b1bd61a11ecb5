"""The other way: a user's Megatron-LM arguments or DeepSpeed ds_config.json -> a Plan (`mmplan solve --from`), built with
planner/solver/baselines.py and planner/solver/construct.py, so `mmplan compare` can put the hand-written layout beside the solved one."""
from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import replace
from pathlib import Path

from cost_models.memory import DTYPE_BYTES
from planner.solver.baselines import homogeneous_plan
from planner.solver.construct import GroupLayout, build_plan, with_predictions
from planner.solver.layout_spec import LayoutSpec, check_layout
from planner.solver.megatron_split import recomputed_tiers
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Profile
from plans.plan import Group, Memory, Plan, ProfileRef, SolverInfo, Stage, Training, check_plan
from plans.serial import read_text

SOURCES = ("megatron", "deepspeed")


def plan_from(source: str, value: str, profile: Profile, cluster: Cluster, global_batch: int) -> Plan:
    """`--from megatron "ARGS"` (or `@FILE`, e.g. a file `mmplan export --to megatron` wrote) or
    `--from deepspeed ds_config.json`: the plan that configuration runs, with predictions."""
    if source == "megatron":
        text = read_text(value[1:], "Megatron argument file") if value.startswith("@") else value
        return plan_from_megatron(text, profile, cluster, global_batch)
    if source == "deepspeed":
        return plan_from_deepspeed(Path(value), profile, cluster, global_batch)
    raise MmplanError(f"--from {source!r}: choose one of {', '.join(SOURCES)}")


def solve_from(source: tuple[str, str], *, profile_path, cluster: str, global_batch: int, output, gpus_per_node: int | None = None,
               **_search_options):
    """`mmplan solve --baseline homogeneous --from KIND VALUE`: run_solve's keywords (the search options do not
    apply), the user's configuration as the plan, written to `output`; returns (Solution, Profile) as run_solve does."""
    import time

    from cost_models.cluster_spec import parse_cluster
    from planner.solver.solve import Solution
    from plans.graph import load_profile
    from plans.plan import save_plan

    started = time.perf_counter()
    profile = load_profile(profile_path)
    plan = plan_from(*source, profile, parse_cluster(cluster, gpus_per_node), global_batch)
    elapsed = time.perf_counter() - started
    plan = replace(plan, solver=replace(plan.solver, time_s=elapsed))
    save_plan(plan, output)
    return Solution(plan, plan, elapsed, "baseline", 1, 0, False, False, 0.0), profile


# --- Megatron-LM arguments -------------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit; one line instead
        raise MmplanError(f"--from megatron: {message}")


def _megatron_parser() -> argparse.ArgumentParser:
    """The subset of Megatron-LM's flags (megatron/training/arguments.py, examples/mimo/training/args.py) that sets
    the layout; every other flag (model shape, data, optimizer hyper-parameters) is ignored."""
    p = _Parser(prog="megatron", add_help=False, allow_abbrev=False)
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--micro-batch-size", "--global-batch-size", "--num-layers-per-virtual-pipeline-stage",
                 "--num-virtual-stages-per-pipeline-rank", "--recompute-num-layers", "--encoder-tp", "--encoder-dp",
                 "--llm-offset", "--llm-tp", "--llm-cp", "--llm-pp", "--llm-dp", "--num-layers"):
        p.add_argument(flag, type=int)
    p.add_argument("--pipeline-model-parallel-layout")
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--data-parallel-sharding-strategy", choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    for flag in ("--use-distributed-optimizer", "--use-megatron-fsdp", "--recompute-activations", "--optimizer-cpu-offload",
                 "--sequence-parallel", "--bf16", "--fp16"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--optimizer")
    return p


def _megatron_training(a, profile: Profile, unread: list[str]) -> tuple[str, str]:
    """(dtype, optimizer) of the plan's Training from --bf16 / --fp16 / --optimizer; what they cannot say goes to `unread`."""
    dtype = "bf16" if a.bf16 else "fp16" if a.fp16 else _dtype(profile)
    if not (a.bf16 or a.fp16):
        unread.append(f"(no --bf16/--fp16: Megatron-LM trains in fp32; the plan keeps the profile's {dtype})")
    optimizer = a.optimizer or "adam"
    if optimizer not in ("adam", "sgd"):
        unread.append(f"--optimizer {optimizer} (the plan prices adam)")
        optimizer = "adam"
    return dtype, optimizer


def _unread_line(argv: list[str], unknown: list[str], notes: list[str]) -> str:
    """The plan's notes: the flags it was read from, and in one item every flag it does not carry (model shape, sequence
    length, learning rate, iterations, data, ...: the profile and the cost model fix them, the plan has no field)."""
    line = f"from megatron: {' '.join(argv)}"
    dropped = " ".join(unknown + notes)
    return line + (f"; not carried (no plan field): {dropped}" if dropped else "")


def plan_from_megatron(text: str, profile: Profile, cluster: Cluster, global_batch: int) -> Plan:
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    try:
        argv = shlex.split("\n".join(lines))
    except ValueError as e:
        raise MmplanError(f"--from megatron: cannot split the arguments: {e}") from None
    a, unknown = _megatron_parser().parse_known_args(argv)
    for flag, value in (("--context-parallel-size", a.context_parallel_size), ("--llm-cp", a.llm_cp)):
        if value not in (None, 1):
            raise MmplanError(f"--from megatron: {flag} {value}: mmplan plans have no context parallelism; drop it or use 1")
    if a.global_batch_size is not None and a.global_batch_size != global_batch:
        raise MmplanError(f"--from megatron: --global-batch-size {a.global_batch_size} differs from --global-batch {global_batch}")
    zero = _megatron_zero(a)
    recompute = "selective" if a.recompute_activations else (a.recompute_granularity or "none")
    block = a.recompute_method == "block" and recompute == "full"
    llm_layers = sum(1 for b in profile.blocks if b.supports_tp and b.group == _llm_group(profile))
    if a.num_layers is not None and a.num_layers != llm_layers:
        raise MmplanError(f"--from megatron: --num-layers {a.num_layers} but the LLM of profile {profile.model!r} has {llm_layers} layers")
    hetero = any(v is not None for v in (a.encoder_tp, a.encoder_dp, a.llm_offset, a.llm_tp, a.llm_pp, a.llm_dp))
    mbs = a.micro_batch_size or 1
    unread: list[str] = []
    dtype, optimizer = _megatron_training(a, profile, unread)
    solver = SolverInfo("baseline:megatron", notes=_unread_line(argv, unknown, unread))
    if hetero:
        return _megatron_mimo(a, profile, cluster, global_batch, mbs, zero, recompute, solver, (dtype, optimizer))
    tp, pp = a.tensor_model_parallel_size or 1, a.pipeline_model_parallel_size or 1
    world = cluster.world_size
    if world % (tp * pp):
        raise MmplanError(f"--from megatron: tp*pp = {tp}*{pp} does not divide the {world} GPUs of cluster {cluster.name}")
    dp = world // (tp * pp)
    layers = [b for b in profile.blocks if b.supports_tp and b.group == _llm_group(profile)]
    v = _virtual_stages(a, len(layers), pp)
    schedule = "interleaved" if v > 1 else "1f1b"
    # Megatron builds a VLM's encoders on the first pipeline stage and splits the LLM's layers (evenly, or as the
    # layout says); planner/solver/baselines.py's homogeneous split would spread the encoder's layers over the stages too.
    sp = a.sequence_parallel and tp > 1  # Megatron-LM turns it off at tp = 1
    check_layout(profile, cluster, global_batch, LayoutSpec(tp, pp, dp, mbs, schedule, v, "none", zero, sequence_parallel=sp))
    counts = _layer_counts(a.pipeline_model_parallel_layout, len(layers), pp * v)
    chunks = _chunks(profile.blocks, _llm_group(profile), counts)
    training = Training(global_batch, global_batch // (dp * mbs), schedule, v, dtype, optimizer)
    first = a.recompute_num_layers if block else None
    memory = [Memory(optimizer="cpu" if a.optimizer_cpu_offload else "gpu", activations=_recomputed(profile, c, recompute, first))
              for c in chunks]
    if v == 1:
        cuts = tuple(sum(len(c) for c in chunks[:i]) for i in range(1, pp))
        layout = GroupLayout("model", tuple(b for c in chunks for b in c), cuts, dp, tp, tuple(range(dp * tp * pp)),
                             zero=zero, memory=tuple(memory), sequence_parallel=sp)
        return build_plan(profile, cluster, training, [layout], solver)
    # interleaved: stage i holds chunks i, i+pp, ... (GroupLayout describes contiguous stages only; as baselines.py does)
    per = dp * tp
    stages = tuple(Stage(tuple(b for k in range(i, pp * v, pp) for b in chunks[k]), tuple(range(i * per, (i + 1) * per)),
                         replace(memory[i], activations={b: t for k in range(i, pp * v, pp) for b, t in memory[k].activations.items()}))
                   for i in range(pp))
    group = Group("model", dp, tp, pp, stages, zero=zero, sequence_parallel=sp)
    plan = check_plan(Plan(ProfileRef(profile.model, profile.fingerprint), cluster, training, (group,), solver=solver), profile)
    return with_predictions(plan, profile)[0]


def _megatron_zero(a) -> int:
    if a.use_megatron_fsdp:
        return {"optim_grads": 2, "optim_grads_params": 3}.get(a.data_parallel_sharding_strategy or "no_shard", 1)
    return 1 if a.use_distributed_optimizer else 0


def _virtual_stages(a, layers: int, pp: int) -> int:
    if a.pipeline_model_parallel_layout is not None:
        stages = len(parse_layout_string(a.pipeline_model_parallel_layout))
        if stages % pp:
            raise MmplanError(f"--from megatron: the layout has {stages} stages, not a multiple of pp={pp}")
        return stages // pp
    if a.num_virtual_stages_per_pipeline_rank:
        return a.num_virtual_stages_per_pipeline_rank
    if a.num_layers_per_virtual_pipeline_stage:
        per_rank = layers // pp
        if per_rank % a.num_layers_per_virtual_pipeline_stage:
            raise MmplanError(f"--from megatron: --num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage} "
                              f"does not divide the {per_rank} layers per pipeline rank")
        return per_rank // a.num_layers_per_virtual_pipeline_stage
    return 1


def parse_layout_string(text: str) -> list[str]:
    """Megatron's --pipeline-model-parallel-layout (e.g. "Et*3|(tt|)*29,m|L") -> one string per stage, unrolled
    (the grammar of megatron/core/transformer/pipeline_parallel_layer_layout.py: E, t, m, L, "|", x*n, (..)*n)."""
    s = text.replace(",", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    bad = set(s) - set("EtmL|")
    if bad:
        raise MmplanError(f"--from megatron: --pipeline-model-parallel-layout {text!r} has unknown characters "
                          f"{''.join(sorted(bad))!r}; use E, t, L, |, x*n and (..)*n")
    return s.split("|")


def _layer_counts(layout: str | None, layers: int, parts: int) -> list[int]:
    """Decoder layers per pipeline chunk: from the layout, or Megatron's even split."""
    if layout is None:
        if layers % parts:
            raise MmplanError(f"--from megatron: {layers} LLM layers do not split evenly into {parts} pipeline chunks; "
                              "give --pipeline-model-parallel-layout")
        return [layers // parts] * parts
    counts = [stage.count("t") for stage in parse_layout_string(layout)]
    if sum(counts) != layers:
        raise MmplanError(f"--from megatron: the layout places {sum(counts)} decoder layers but the LLM of the profile has {layers}")
    return counts


def _llm_group(profile: Profile) -> str:
    return profile.blocks[-1].group  # the profile lists blocks in execution order: the LLM's head comes last


def _chunks(blocks, llm: str, counts: list[int]) -> list[tuple[str, ...]]:
    """Blocks of each chunk: chunk k holds counts[k] LLM layers; everything before the LLM's first layer (encoders,
    projectors, embedding: Megatron builds them on the first stage) goes to chunk 0, everything after the last to
    the last chunk, and every other block with the layer before it."""
    names = [b.name for b in blocks]
    layer_at = [i for i, b in enumerate(blocks) if b.supports_tp and b.group == llm]
    bounds, k = [0], 0
    for c in counts[:-1]:
        k += c
        bounds.append(layer_at[k] if k < len(layer_at) else layer_at[-1] + 1)
    bounds.append(len(names))
    return [tuple(names[a:b]) for a, b in zip(bounds, bounds[1:])]


def _recomputed(profile: Profile, blocks, recompute: str, first: int | None) -> dict[str, str]:
    """Activation tiers for Megatron's recomputation, as the Megatron-style baseline writes them
    (megatron_split.recomputed_tiers: full = every block; selective = the attention core of every block that has
    one, the runtime's "selective" tier); with --recompute-method block, the chunk's first N LLM layers."""
    if first is not None:
        by_name = {b.name: b for b in profile.blocks}
        llm = _llm_group(profile)
        layers = [b for b in blocks if by_name[b].supports_tp and by_name[b].group == llm]
        return {b: "recompute" for b in layers[:first]}
    return recomputed_tiers(profile, blocks, recompute)


def _dtype(profile: Profile) -> str:
    return profile.dtype if profile.dtype in DTYPE_BYTES else "bf16"


def _megatron_mimo(a, profile: Profile, cluster: Cluster, global_batch: int, mbs: int, zero: int, recompute: str,
                   solver: SolverInfo, dtype_optimizer: tuple[str, str]) -> Plan:
    """examples/mimo's grids: the encoder (every block outside the LLM) on ranks 0..encoder_tp*encoder_dp-1, the LLM
    at --llm-offset with its own tp, pp (cut by the layout or evenly) and dp."""
    enc_tp, enc_dp = a.encoder_tp or 1, a.encoder_dp or 1
    llm_tp, llm_pp, llm_dp = a.llm_tp or 1, a.llm_pp or 1, a.llm_dp or 1
    enc_n, llm_n = enc_tp * enc_dp, llm_tp * llm_pp * llm_dp
    offset = enc_n if a.llm_offset is None else a.llm_offset
    if offset != enc_n or enc_n + llm_n != cluster.world_size:
        raise MmplanError(f"--from megatron: the encoder grid (ranks 0-{enc_n - 1}) and the LLM grid (ranks {offset}-"
                          f"{offset + llm_n - 1}) must tile the {cluster.world_size} GPUs of cluster {cluster.name}")
    llm = _llm_group(profile)
    enc_blocks = tuple(b.name for b in profile.blocks if b.group != llm)
    llm_profile_blocks = [b for b in profile.blocks if b.group == llm]
    if not enc_blocks:
        raise MmplanError(f"--from megatron: the encoder flags need a model with an encoder; {profile.model!r} has only {llm!r}")
    layers = [b for b in llm_profile_blocks if b.supports_tp]
    counts = _layer_counts(a.pipeline_model_parallel_layout, len(layers), llm_pp)
    llm_chunks = _chunks(llm_profile_blocks, llm, counts)
    llm_blocks = tuple(b for c in llm_chunks for b in c)
    cuts = tuple(sum(len(c) for c in llm_chunks[:i]) for i in range(1, llm_pp))
    memory = tuple(Memory(optimizer="cpu" if a.optimizer_cpu_offload else "gpu",
                          activations=_recomputed(profile, c, recompute, a.recompute_num_layers if a.recompute_method == "block" else None))
                   for c in llm_chunks)
    enc_group = profile.blocks[0].group
    sp = a.sequence_parallel  # one flag for the run: every tensor-parallel grid
    layouts = [GroupLayout(enc_group, enc_blocks, (), enc_dp, enc_tp, tuple(range(enc_n)), zero=zero,
                           sequence_parallel=sp and enc_tp > 1),
               GroupLayout(llm, llm_blocks, cuts, llm_dp, llm_tp, tuple(range(offset, offset + llm_n)), zero=zero, memory=memory,
                           sequence_parallel=sp and llm_tp > 1)]
    micro = mbs * llm_dp
    if global_batch % micro:
        raise MmplanError(f"--from megatron: global batch {global_batch} is not divisible by --micro-batch-size * --llm-dp = {micro}")
    training = Training(global_batch, global_batch // micro, "1f1b", 1, *dtype_optimizer)
    return build_plan(profile, cluster, training, layouts, solver)


# --- DeepSpeed ds_config.json ----------------------------------------------------------------------------------------


def plan_from_deepspeed(path: Path, profile: Profile, cluster: Cluster, global_batch: int) -> Plan:
    what = f"--from deepspeed {path}"
    try:
        config = json.loads(read_text(path, "DeepSpeed config"))
    except json.JSONDecodeError as e:
        raise MmplanError(f"{what}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(config, dict):
        raise MmplanError(f"{what}: expected a JSON object of DeepSpeed settings")
    tp = _int(config, ("tensor_parallel", "autotp_size"), 1, what) or 1
    stages = config.get("pipeline", {}).get("stages", 1) if isinstance(config.get("pipeline"), dict) else 1
    pp = stages if isinstance(stages, int) and stages >= 1 else 1
    world = cluster.world_size
    if world % (tp * pp):
        raise MmplanError(f"{what}: tp*pp = {tp}*{pp} does not divide the {world} GPUs of cluster {cluster.name}")
    dp = world // (tp * pp)
    train = _int(config, ("train_batch_size",), None, what)
    mbs = _int(config, ("train_micro_batch_size_per_gpu",), None, what)
    gas = _int(config, ("gradient_accumulation_steps",), None, what)
    train = train or global_batch
    if tp > 1 and pp == 1 and train == global_batch * tp:
        train = global_batch  # AutoTP without an mpu: DeepSpeed counts every rank (mmplan export writes it so)
    inferred = ""
    if "pipeline" not in config and mbs and gas and train % (mbs * gas) == 0 and world % (tp * (train // (mbs * gas))) == 0:
        # the file carries no stage count (PipelineModule takes it); DeepSpeed's data-parallel size is
        # train / (micro x accumulation), so the stages are what the cluster's other GPUs leave
        implied = world // (tp * (train // (mbs * gas)))
        if implied > 1:
            pp, dp = implied, train // (mbs * gas)
            inferred = f"; {pp} pipeline stages inferred from the batch sizes (the file carries none)"
    if train != global_batch:
        raise MmplanError(f"{what}: train_batch_size {train} differs from --global-batch {global_batch}")
    if mbs is None:
        mbs = train // (dp * (gas or 1))
    if mbs < 1 or train % (mbs * dp) or (gas is not None and mbs * gas * dp != train):
        raise MmplanError(f"{what}: train_batch_size {train} != train_micro_batch_size_per_gpu {mbs} x "
                          f"gradient_accumulation_steps {gas or train // max(mbs * dp, 1)} x data-parallel size {dp} "
                          f"(the {world} GPUs of cluster {cluster.name} / (tp={tp} x pp={pp})); fix the batch sizes or --cluster")
    zero_cfg = config.get("zero_optimization", {})
    zero_cfg = zero_cfg if isinstance(zero_cfg, dict) else {}
    zero = _int(config, ("zero_optimization", "stage"), 0, what)
    if zero not in (0, 1, 2, 3):
        raise MmplanError(f"{what}: zero_optimization.stage must be 0, 1, 2 or 3, got {zero}")
    params = _device(zero_cfg, "offload_param", what)
    optimizer = _device(zero_cfg, "offload_optimizer", what)
    checkpointing = "activation_checkpointing" in config
    spec = LayoutSpec(tp, pp, dp, mbs, "1f1b", 1, "layers" if checkpointing else "none", zero)
    notes = (f"from deepspeed: {path}; layout {spec}; activation checkpointing read as every transformer layer "
             "recomputed" if checkpointing else f"from deepspeed: {path}; layout {spec}") + inferred
    unread = _deepspeed_unread(config)
    if unread:
        notes += f"; not carried (no plan field): {unread}"
    plan = homogeneous_plan(profile, cluster, global_batch, spec, solver=SolverInfo("baseline:deepspeed", notes=notes), predict=False)
    if params != "gpu" or optimizer != "gpu":  # ZeRO-Offload keeps gradients with the optimizer state
        groups = tuple(replace(g, stages=tuple(replace(s, memory=replace(s.memory, params=params, grads=optimizer, optimizer=optimizer))
                                                for s in g.stages)) for g in plan.groups)
        plan = check_plan(replace(plan, groups=groups), profile)
    return with_predictions(plan, profile)[0]


# What plan_from_deepspeed reads; every other setting is named in the plan's notes (the plan has no field for it).
DS_READ = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16", "fp16",
           "zero_optimization", "tensor_parallel", "pipeline", "activation_checkpointing", "comment"}
ZERO_READ = {"stage", "offload_param", "offload_optimizer"}


def _deepspeed_unread(config: dict) -> str:
    """The settings of a ds_config.json the plan does not carry, as `key=value` items (e.g. gradient_clipping=1.0)."""
    items = [f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in config.items() if k not in DS_READ]
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        items += [f"zero_optimization.{k}={json.dumps(v, separators=(',', ':'))}" for k, v in zero.items() if k not in ZERO_READ]
    return ", ".join(items)


def _int(config: dict, keys: tuple[str, ...], default, what: str):
    value = config
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            return default
        value = value[k]
    if value == "auto":
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MmplanError(f"{what}: {'.'.join(keys)} must be a non-negative integer, got {value!r}")
    return value


def _device(zero_cfg: dict, key: str, what: str) -> str:
    section = zero_cfg.get(key)
    if section is None:
        return "gpu"
    device = section.get("device", "none") if isinstance(section, dict) else None
    if device in ("none", None):
        return "gpu"
    if device not in ("cpu", "nvme"):
        raise MmplanError(f"{what}: zero_optimization.{key}.device must be cpu, nvme or none, got {device!r}")
    return device
