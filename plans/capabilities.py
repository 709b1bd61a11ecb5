"""What the runtime can run, as data the solver, the profiler and the runtime all read (tests check the runtime against it).

- ZeRO (FSDP2, runtime/zero.py): the (parameters, gradients, optimizer state) tiers a ZeRO stage can hold.
- Tensor parallelism (runtime/tensor_parallel.py): the block kinds it shards, the regions inside them (an attention or
  an MLP) with each linear's style, the sizes tp must divide in each region kind, the modules allowed to hold
  replicated parameters; sequence parallelism's block kinds. A block kind is its class name (`Block.kind`).
- Tied parameters (runtime/ties.py, runtime/stage.py, runtime/rank_tiers.py, runtime/tp_stage.py): where a parameter shared by blocks
  may sit.
"""
from __future__ import annotations

from typing import Literal

# ----------------------------------------------------------------------------------------------- ZeRO
# (params, grads, optimizer): FSDP2 keeps parameters and gradients on the device, or both on the host with its
# CPUOffloadPolicy (then the optimizer state, updated on the host, is not on the device).
ZERO_TIER_COMBINATIONS: frozenset[tuple[str, str, str]] = frozenset({
    ("gpu", "gpu", "gpu"), ("gpu", "gpu", "cpu"), ("gpu", "gpu", "nvme"),
    ("cpu", "cpu", "cpu"), ("cpu", "cpu", "nvme"),
})
ZERO_TIERS = ("under ZeRO the runtime (FSDP2) keeps parameters and gradients on the GPU (optimizer state on the GPU, "
              "CPU or NVMe), or both on the CPU with FSDP2's CPU offload (optimizer state on the CPU or NVMe)")


def zero_runs_with(params: str, grads: str, optimizer: str) -> bool:
    """The memory tiers a ZeRO stage can have (ZERO_TIER_COMBINATIONS, in words ZERO_TIERS)."""
    return (params, grads, optimizer) in ZERO_TIER_COMBINATIONS


# ----------------------------------------------------------------------------------------------- tensor parallelism
Style = Literal["colwise", "rowwise"]  # column-parallel: output features split; row-parallel: input features split

# Block kinds the runtime shards (classes saying supports_tensor_parallel = True); besides them, any block that
# carries its own plan (Hugging Face blocks, from the model's base_model_tp_plan: runtime/hf.py).
TP_BLOCK_KINDS: tuple[str, ...] = ("TransformerLayer", "FlamingoLayer", "Projector")

# Region kind (the attention / MLP module's class) -> {linear attribute: style}. Everything else is replicated.
TP_REGIONS: dict[str, dict[str, Style]] = {
    "Attention": {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"},
    "CrossAttention": {"wq": "colwise", "wk": "colwise", "wv": "colwise", "wo": "rowwise"},
    "SwiGLU": {"w1": "colwise", "w3": "colwise", "w2": "rowwise"},
    "GeluMLP": {"fc1": "colwise", "fc2": "rowwise"},
    # the encoder-to-LLM projector (Linear-GELU-Linear) is itself one region, sharded like a transformer's MLP
    "Projector": {"fc1": "colwise", "fc2": "rowwise"},
}

# Region kind -> the sizes tp must divide (tp shards exactly: every shard one equal contiguous chunk). A region of a
# block's own plan (not listed) must have each sharded linear's width (in heads when it has a head_dim) divisible.
TP_DIVIDES: dict[str, tuple[str, ...]] = {
    "Attention": ("heads", "kv_heads"),  # kv heads are never replicated across tp ranks (kv_heads % tp == 0)
    "CrossAttention": ("heads", "kv_heads"),
    "SwiGLU": ("mlp width",),
    "GeluMLP": ("mlp width",),
    "Projector": ("mlp width",),
}

# Block kinds that are one region (the block is its own MLP): one all-reduce forward, one backward, where a
# transformer layer has two of each (cost_models/compute.py tp_collectives). Other TP kinds have two.
TP_SINGLE_REGION_KINDS: tuple[str, ...] = ("Projector",)

# Modules that may hold replicated parameters outside the regions of a tensor-parallel block (besides any module
# whose class name contains "norm"): they see identical activations on every tp rank.
TP_REPLICATED_KINDS: tuple[str, ...] = ("LayerNorm", "GatedCrossAttention")

# Block kinds whose regions all read the block's own sequence: sequence parallelism applies to them.
SEQUENCE_PARALLEL_KINDS: tuple[str, ...] = ("TransformerLayer",)
# Any sequence length: where tp does not divide it the runtime pads it with zeros to the next multiple of tp at the
# run's entry and drops the padding before every attention / MLP and at the run's exit (Megatron-LM pads likewise);
# the cost models price the padded length (sequence_parallel_padding).
SEQUENCE_PARALLEL_PADS = True


def sequence_parallel_padding(sequence: int, tp: int) -> float:
    """S' / S: the padded sequence length a sequence-parallel run carries (S rounded up to a multiple of tp) over the
    true one; 1.0 where tp divides S or the sequence is not known (0)."""
    if sequence <= 0 or tp <= 1:
        return 1.0
    return (-(-sequence // tp) * tp) / sequence


def sequence_parallel_applies(kind: str) -> bool:
    """Whether a sequence-parallel group runs a block of this kind sequence-parallel: the SEQUENCE_PARALLEL_KINDS;
    the other zoo TP kinds (TP_BLOCK_KINDS: cross-attention layers, projectors) stay plainly tensor-parallel.
    Blocks carrying their own plan (Hugging Face) are not zoo kinds: True, as the cost models have priced them."""
    return kind in SEQUENCE_PARALLEL_KINDS or kind not in TP_BLOCK_KINDS

# ----------------------------------------------------------------------------------------------- tied parameters
# A parameter shared by several blocks (tied embeddings) belongs to the first block that holds it. Supported: all its
# blocks on the same stage, whose memory tiers agree; under tensor parallelism, tied to a vocabulary-parallel weight
# only when it shards with it. Across the stages of one group (any dp, tp, ZeRO stage and tiers): a copy on each stage
# holding a tied block, the copies' gradients all-reduced between those stages after the data-parallel sync
# (runtime/ties.py, Megatron-LM's embedding group; priced by cost_models/ties.py). Refused: tied across groups (the
# copies of a tie meet position by position, so their stages must share dp and tp -- and colocated groups would put
# two of them on one rank); the solver never cuts a tie between groups (planner/solver/structure.profile_units).
TIED_ACROSS_STAGES = True
TIED_ACROSS_GROUPS = False


def tied_across_stages_refusal(blocks: tuple[str, ...] | list[str], holders: list[tuple[str, int, int]]) -> str:
    """Why the runtime cannot hold a parameter tied between `blocks` whose stages are `holders` ((group, dp, tp) of
    each stage holding some of them), or "" when it can."""
    groups = list(dict.fromkeys(g for g, _, _ in holders))
    if len(holders) > 1 and not TIED_ACROSS_STAGES:
        return f"blocks {', '.join(blocks)} share a parameter but are on different stages; tied weights across stages are not supported"
    if len(groups) > 1 and not TIED_ACROSS_GROUPS:
        return (f"blocks {', '.join(blocks)} share a parameter but are in groups {', '.join(groups)}; the runtime keeps the "
                "copies of a tied parameter on the stages of one group: put those blocks in one group")
    return ""
