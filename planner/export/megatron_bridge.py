"""Plan -> Megatron-Bridge Python config: a MegatronMIMOParallelismConfig of ModuleParallelismConfig(..., rank_offset)
per group on its own ranks, or, for one layout, the model provider's parallelism fields; both with the
TransformerConfig / DDP / optimizer fields for uneven cut points, recomputation, ZeRO and optimizer offload."""
from __future__ import annotations

from planner.export.common import (
    Drops,
    Roles,
    activation_tiers,
    chain_sequence_parallel,
    collapsed,
    header,
    is_megatron_order,
    nearest_chain,
    recompute_of,
    span,
)
from planner.export.model import FILL, Code, bridge_model_fields, model_of, torchrun
from planner.export.megatron import (
    encoders_first,
    layout_string,
    model_chunks,
    no_activation_offload,
    optimizer_offload,
    recompute_fields,
)
from plans.graph import Profile
from plans.plan import Plan

LANGUAGE = "language"  # MIMO_LANGUAGE_MODULE_KEY: Bridge's name of the language module
# Every field the plan decides is written, off included: a recipe's ConfigContainer arrives with its own choices
# (Bridge's recipes turn the distributed optimizer, sequence parallelism and recomputation on), and apply() must
# leave the plan, not the recipe's plan. DistributedDataParallelConfig / OptimizerConfig (megatron-core 0.16.1):
# ZeRO-1 is the distributed optimizer, 2 and 3 Megatron FSDP; OptimizerConfig.use_distributed_optimizer follows DDP's.
ZERO_DDP = {
    0: {"use_distributed_optimizer": False, "use_megatron_fsdp": False, "data_parallel_sharding_strategy": "no_shard"},
    1: {"use_distributed_optimizer": True, "use_megatron_fsdp": False, "data_parallel_sharding_strategy": "no_shard"},
    2: {"use_distributed_optimizer": False, "use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads"},
    3: {"use_distributed_optimizer": False, "use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"},
}
OFFLOAD = {True: {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True, "optimizer_offload_fraction": 1.0},
           False: {"optimizer_cpu_offload": False, "optimizer_offload_fraction": 0.0}}
NO_RECOMPUTE = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


MIXED_PRECISION = {"bf16": "bf16_mixed", "fp16": "fp16_mixed", "fp32": None}  # Bridge's mixed_precision recipes
# The base ConfigContainer of a text-only plan: Bridge's vanilla GPT recipe (a bare GPTModelProvider, Megatron-LM
# pretrain_gpt.py's defaults); every field the plan or the profile decides replaces the recipe's.
GPT_RECIPE = "megatron.bridge.recipes.gpt:vanilla_gpt_pretrain_config"

APPLY = '''

def apply(cfg):
    """Set these fields on a Megatron-Bridge ConfigContainer (e.g. one a recipe returned); returns it."""
    for name, value in model_overrides.items():
        setattr(cfg.model, name, value)
    for name, value in ddp_overrides.items():
        setattr(cfg.ddp, name, value)
    for name, value in optimizer_overrides.items():
        setattr(cfg.optimizer, name, value)
    # ConfigContainer.mixed_precision sets the model's, optimizer's and DDP's dtypes when the config is finalized: a
    # recipe's would override the plan's precision
    cfg.mixed_precision = MIXED_PRECISION
    cfg.train.micro_batch_size = MICRO_BATCH_SIZE
    cfg.train.global_batch_size = GLOBAL_BATCH_SIZE
    return cfg
'''

DATA = '''
# FILL_ME: your data (the path prefix of a Megatron .bin / .idx pair, or several: "0.7 /a 0.3 /b"; Bridge's dataset
# builder finds no FILL_ME.bin) and your tokenizer (e.g. HuggingFaceTokenizer and its directory; no tokenizer is
# called FILL_ME); the sequence length is the language model's
dataset_overrides = {dataset}
tokenizer_overrides = dict(tokenizer_type="FILL_ME", tokenizer_model="FILL_ME")
'''

APPLY_DATA = '''    for name, value in dataset_overrides.items():
        setattr(cfg.dataset, name, value)
    for name, value in tokenizer_overrides.items():
        setattr(cfg.tokenizer, name, value)
'''

MAIN = '''

def main():
    """`torchrun ... THIS_FILE`: RECIPE's ConfigContainer with apply(), trained by Megatron-Bridge's pretrain."""
    import importlib

    module, _, name = RECIPE.partition(":")
    if not name:
        raise SystemExit(f"RECIPE = {{RECIPE!r}}: name a Megatron-Bridge recipe function, 'package.module:function'")
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.{step} import forward_step

    pretrain(apply(getattr(importlib.import_module(module), name)()), forward_step)


if __name__ == "__main__":
    main()
'''


def export(plan: Plan, drops: Drops, source: str, profile: Profile | None = None) -> str:
    roles = Roles.of(plan)
    notes: list[str] = []
    groups = collapsed(plan)
    mimo = groups is not None and len(groups) > 1
    if groups is None:
        drops.cannot("colocated groups with their own layouts (Megatron-Bridge's MegatronMIMOParallelismConfig tiles the "
                     "world with disjoint rank_offset ranges)", "one layout for the whole model")
    body = (_mimo(plan, groups, roles, drops, notes, profile) if mimo
            else _one_layout(plan, roles, drops, notes, profile, quiet=groups is None))
    lines = [f"# {line}" for line in header(plan, source, "megatron-bridge", drops.dropped, notes)]
    lines.append("# every field the plan decides is set, off included: apply() onto a recipe's ConfigContainer replaces the recipe's "
                 "distributed optimizer, sequence parallelism and recomputation")
    return "\n".join(lines) + "\n" + body


def _values(fields: dict, indent: str = "    ") -> str:
    return "".join(f"{indent}{k}={v!r},\n" for k, v in fields.items())


def _dict(fields: dict) -> str:
    return f"dict(\n{_values(fields)})" if fields else "dict()"


def _one_layout(plan: Plan, roles: Roles, drops: Drops, notes: list[str], profile: Profile | None, *, quiet: bool) -> str:
    """One layout: the GPT/VLM model provider's parallelism and shape fields (encoders on the first pipeline stage),
    the data and tokenizer placeholders, and a main() that trains RECIPE's ConfigContainer with them."""
    chain = nearest_chain(plan, drops, headline=not quiet)
    notes += [chain.note] if chain.note else []
    chain = encoders_first(chain, roles, drops)
    stages = no_activation_offload(chain.stages, drops)
    chunks = model_chunks(stages, plan.training.virtual_stages, roles, drops)
    model = {"tensor_model_parallel_size": chain.tp, "pipeline_model_parallel_size": chain.pp, "context_parallel_size": 1}
    model.update(_pipeline(plan, chain.pp, chunks, roles, drops))
    model.update(NO_RECOMPUTE, **recompute_fields(recompute_of(list(chunks), roles, drops)))
    model["sequence_parallel"] = chain_sequence_parallel(chain, plan, drops)
    model.update(_dtype(plan, chain.pp))
    text_only = all(roles.is_llm(b) for b in chain.blocks)
    core, gpt = bridge_model_fields(model_of(plan, profile), len(roles.llm_layers(chain.blocks)), chain.tp, notes)
    model.update(core, **gpt)
    recipe = (f"{GPT_RECIPE!r}  # Bridge's vanilla GPT recipe: a bare GPTModelProvider, every field below replaces its own"
              if text_only else f"{FILL!r}  # {FILL}: a Bridge recipe whose provider builds your VLM, 'package.module:function' "
              "(its language fields are set below; the encoders' shapes are in the notes above)")
    notes.append(f"launch on every node, with Megatron-Bridge installed and every {FILL} filled: {torchrun(plan, chain.world, 'THIS_FILE')}")
    dataset = {"seq_length": gpt["seq_length"], "data_path": FILL}
    return (f"\nimport torch\n\nWORLD_SIZE = {chain.world}  # data_parallel_size = WORLD_SIZE / (tensor * pipeline) = {chain.dp}\n"
            f"MICRO_BATCH_SIZE = {plan.training.micro_batch // chain.dp}  # per data-parallel replica\n"
            f"GLOBAL_BATCH_SIZE = {plan.training.global_batch}\n"
            f"MIXED_PRECISION = {MIXED_PRECISION[plan.training.dtype]!r}  # Bridge's mixed-precision recipe (None: fp32)\n"
            f"RECIPE = {recipe}\n\n"
            f"# fields of the model provider (a megatron.core TransformerConfig, and the GPT model's vocabulary, sequence, "
            f"head and positions)\nmodel_overrides = {_dict(model)}\n"
            + _ddp_optimizer(chain.zero, optimizer_offload(stages, drops)) + DATA.format(dataset=_dict(dataset))
            + APPLY.replace("    return cfg\n", APPLY_DATA + "    return cfg\n")
            + MAIN.format(step="gpt_step" if text_only else "vlm_step"))


def _mimo(plan: Plan, groups, roles: Roles, drops: Drops, notes: list[str], profile: Profile | None) -> str:
    """Groups on their own ranks: one ModuleParallelismConfig each (the LLM's is "language"), any rank_offset; the
    language model's TransformerConfig fields (its tp and pp included: get_num_layers_to_build reads them) and its
    GPTModel arguments (vocabulary, sequence, head, positions) from the profile."""
    llm = groups[-1]
    modules = {}
    for g in groups:
        offset = min(g.ranks)
        if not is_megatron_order(g, offset):
            drops.cannot(f"the rank order of group {g.name!r} (ranks {span(g.ranks)})", "consecutive ranks, tp fastest, then dp, then pp")
        modules[LANGUAGE if g is llm else g.name] = dict(tensor_model_parallel_size=g.tp, pipeline_model_parallel_size=g.pp,
                                                         data_parallel_size=g.dp, rank_offset=offset)
    used = sum(len(g.ranks) for g in groups)
    zero = _mimo_checks(plan, groups, roles, drops, notes, used)
    stages = no_activation_offload(llm.stages, drops)
    chunks = model_chunks(stages, plan.training.virtual_stages, roles, drops)
    language = {"tensor_model_parallel_size": llm.tp, "pipeline_model_parallel_size": llm.pp, "context_parallel_size": 1,
                **_pipeline(plan, llm.pp, chunks, roles, drops)}
    language.update(NO_RECOMPUTE, **recompute_fields(recompute_of(list(chunks), roles, drops)))
    language["sequence_parallel"] = llm.tp > 1 and llm.sequence_parallel
    _encoder_sequence_parallel(groups, drops)
    language.update(_dtype(plan, llm.pp))
    core, gpt = bridge_model_fields(model_of(plan, profile), len(roles.llm_layers(llm.blocks)), llm.tp, notes)
    language.update(core)
    spec = {"vocab_size": gpt["vocab_size"], "max_sequence_length": gpt["seq_length"],
            **{k: gpt[k] for k in ("share_embeddings_and_output_weights", "position_embedding_type", "rotary_base") if k in gpt}}
    notes.append(f"launch on every node: {torchrun(plan, used, 'YOUR_MIMO_SCRIPT')}, a script building your MegatronMIMOProvider "
                 "(encoders, projections, data) as Megatron-Bridge's examples/megatron_mimo/llava/megatron_mimo_training_llava.py "
                 "does, calling apply() on its ConfigContainer")
    entries = "".join(f"        {name!r}: ModuleParallelismConfig(\n{_values(fields, ' ' * 12)}        ),\n"
                      for name, fields in modules.items())
    names = [n for n in modules if n != LANGUAGE]
    return ("\nimport torch\nfrom megatron.bridge.models.megatron_mimo.megatron_mimo_config import (\n"
            "    MegatronMIMOParallelismConfig,\n    ModuleParallelismConfig,\n)\n\n"
            f"WORLD_SIZE = {used}\n"
            f"MICRO_BATCH_SIZE = {plan.training.micro_batch // llm.dp}  # per data-parallel replica of the language module\n"
            f"GLOBAL_BATCH_SIZE = {plan.training.global_batch}\n"
            f"MIXED_PRECISION = {MIXED_PRECISION[plan.training.dtype]!r}  # Bridge's mixed-precision recipe (None: fp32)\n\n"
            f"# keys: the language module and the modality submodules of your MegatronMIMOProvider ({', '.join(map(repr, names))} "
            "here: rename them to your provider's, e.g. 'images' in Bridge's LLaVA example)\n"
            f"megatron_mimo_parallelism_config = MegatronMIMOParallelismConfig(\n    module_parallelisms={{\n{entries}    }},\n)\n\n"
            f"# fields of the language model's TransformerConfig (language_model_spec.params['config'])\nmodel_overrides = {_dict(language)}\n"
            f"# the language model's GPTModel arguments (language_model_spec.params)\nlanguage_spec_overrides = {_dict(spec)}\n"
            + _ddp_optimizer(zero, optimizer_offload(stages, drops))
            + APPLY.replace("    for name, value in model_overrides.items():\n        setattr(cfg.model, name, value)\n",
                            "    cfg.model.megatron_mimo_parallelism_config = megatron_mimo_parallelism_config\n"
                            "    language = cfg.model.language_model_spec.params[\"config\"]  # the language model's TransformerConfig\n"
                            "    for name, value in model_overrides.items():\n"
                            "        setattr(language, name, value)\n"
                            "    cfg.model.language_model_spec.params.update(language_spec_overrides)\n"))


def _mimo_checks(plan: Plan, groups, roles: Roles, drops: Drops, notes: list[str], used: int) -> int:
    """What Bridge's MIMO config cannot hold of the plan (recorded in `drops`); returns the one ZeRO stage it runs."""
    llm = groups[-1]
    if used != plan.cluster.world_size:
        notes.append(f"the plan uses {used} of the cluster's {plan.cluster.world_size} GPUs: launch {used} ranks")
    dps = [g.dp for g in groups]
    if any(a % b and b % a for a in dps for b in dps):
        drops.cannot(f"data-parallel sizes that do not divide each other ({', '.join(map(str, dps))}; Bridge's "
                     "BridgeCommunicator needs one of each pair to divide the other)", "unchanged sizes (finalize() will refuse them)")
    misplaced = [b for b in llm.blocks if not roles.is_llm(b)]
    if misplaced:
        drops.cannot(f"encoder-side blocks in the LLM's group ({', '.join(misplaced[:3])})", "those blocks on their encoder's grid")
    zeros = {g.zero for g in groups}
    if len(zeros) > 1:
        drops.cannot(f"different ZeRO stages per group ({', '.join(map(str, sorted(zeros)))}; Bridge has one DDP config)",
                     f"ZeRO-{max(zeros)} for every module")
    for g in groups[:-1]:
        if activation_tiers(g.stages) - {"keep"} or any(
                (s.memory.params, s.memory.grads, s.memory.optimizer) != ("gpu", "gpu", "gpu") for s in g.stages):
            drops.cannot(f"memory tiers or recomputation in encoder group {g.name!r} (these fields configure the language model)",
                         "the encoder's state and activations on the GPU")
    return max(zeros)


def _pipeline(plan: Plan, pp: int, chunks, roles: Roles, drops: Drops) -> dict:
    """The cut points (the layout string, None for one stage) and the chunks per rank (None for one)."""
    if pp == 1:
        return {"pipeline_model_parallel_layout": None, "virtual_pipeline_model_parallel_size": None}
    if plan.training.schedule == "gpipe":
        drops.cannot("the GPipe schedule", "1F1B, Megatron's pipeline schedule (it holds fewer micro-batches in flight)")
    v = len(chunks) // pp
    return {"pipeline_model_parallel_layout": layout_string(chunks, roles, drops),
            "virtual_pipeline_model_parallel_size": v if v > 1 else None}


def _encoder_sequence_parallel(groups, drops: Drops) -> None:
    """Bridge's ModuleParallelismConfig has no sequence_parallel: this file sets the language model's only; an
    encoder's tensor-parallel setting that differs from it is the user's provider's to match, so it is recorded."""
    llm = groups[-1]
    language = llm.tp > 1 and llm.sequence_parallel
    for g in groups[:-1]:
        mine = g.tp > 1 and g.sequence_parallel
        if g.tp > 1 and mine != language:
            drops.cannot(f"sequence parallelism {'on' if mine else 'off'} in encoder group {g.name!r} (tp={g.tp}) while the "
                         f"language model has it {'on' if language else 'off'} (Megatron-Bridge's ModuleParallelismConfig "
                         "has no sequence_parallel; this file sets the language model's TransformerConfig only)",
                         f"sequence_parallel={language} for the language model; the encoder's TransformerConfig in your "
                         f"provider left as it is (set sequence_parallel={mine} there)")


def _ddp_optimizer(zero: int, offload: bool) -> str:
    ddp = ZERO_DDP[zero]
    optimizer = {"use_distributed_optimizer": ddp["use_distributed_optimizer"], **OFFLOAD[offload]}
    return (f"# fields of megatron.core's DistributedDataParallelConfig and OptimizerConfig\n"
            f"ddp_overrides = {_dict(ddp)}\noptimizer_overrides = {_dict(optimizer)}\n")


def _dtype(plan: Plan, pp: int) -> dict:
    """Mixed precision, and the dtype of tensors sent between pipeline stages (TransformerConfig requires it with pp > 1)."""
    dtype = plan.training.dtype
    return {"bf16": dtype == "bf16", "fp16": dtype == "fp16", "pipeline_dtype": Code(TORCH_DTYPE[dtype]) if pp > 1 else None}
