"""The `fused` kernel flavour: what a transformer layer saves for backward under TransformerEngine-style fused kernels
and flash attention, per op from its shape, in place of the eager PyTorch saved tensors the profiler measures."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from plans.errors import MmplanError
from plans.graph import Block, ModelShape, Profile

Kernels = Literal["eager", "fused"]
KERNELS: tuple[str, ...] = ("eager", "fused")

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of a saved activation in the profile's dtype
MASK_BYTES = 1  # a dropout mask: 1 byte per element (Korthikanti et al. 2022, section 4.1: "sbh" per dropout)
STAT_BYTES = 4  # fp32 per token: a norm's saved statistics, flash attention's logsumexp per head
# (FlashAttention, Dao et al. 2022, algorithm 2: the backward reads Q, K, V, O and the softmax statistics (logsumexp, one
# fp32 per row and head); TransformerEngine's LayerNorm / RMSNorm save the input and fp32 mean / rstd per token
# (transformer_engine/pytorch/module/layernorm_linear.py: ctx.save_for_backward(inputmat, ln_weight, mu, rsigma, ...))
NORM_STATS = {"rmsnorm": 1, "layernorm": 2}  # fp32 statistics per token: rstd; mean and rstd
PARAM_TOLERANCE = 0.02  # a block is a plain layer of its group's shape when its parameters are within 2 % of the
# shape's layer (biases, norm weights and rounding aside); any other block keeps its measured (eager) bytes


@dataclass(frozen=True, slots=True)
class LayerSaved:
    """Bytes one token of one layer saves for backward, split as cost_models/memory.kept_activation_bytes reads them."""

    total: float
    replicated: float  # outside the tensor-parallel regions: every tp rank holds it unless sequence parallelism
    core: float  # the attention core's own saved state that selective recompute drops (flash: the logsumexp)


def fused_layer_bytes(shape: ModelShape, dtype: str, *, dropout: bool = False) -> LayerSaved:
    """Saved bytes per token of one pre-norm transformer layer of `shape` under fused kernels with flash attention.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), section 4.1, counts per
    token of a GPT layer (2-byte activations): attention 11h + 5as (QKV input 2h, Q and K 4h, softmax 2as, its dropout
    mask as, V 2h, softmax output 2as, projection input 2h, dropout mask h), MLP 19h (fc1 input 2h, GeLU input 8h,
    fc2 input 8h, dropout mask h), two layer norms 4h: 34h + 5as. Flash attention (Dao et al. 2022) saves Q, K, V, the
    output O (the projection's input, one tensor) and the logsumexp instead of the s x s softmax terms, so the 5as
    term becomes 4 bytes per head. Here with e bytes per element, h = hidden, kv = the key / value width (grouped-query
    attention: kv heads x head dim), f = the MLP width:
        replicated (outside TP regions): 2 norm inputs 2eh + their fp32 statistics, the QKV and fc1 inputs (the norm
                                         outputs, saved by the fused norm + linear) 2eh, dropout masks 2h (if dropout)
        tensor-parallel:                 Q, K, V e(h + 2kv), O eh, logsumexp 4a; MLP: GeLU 2ef (fc1 output, fc2 input),
                                         SwiGLU 3ef (gate and up outputs, fc2 input)
    For the GPT layer with dropout that is (10 + 24/t) sbh + 4as/t per layer: Table 2's "TP + selective" figure, the
    softmax terms gone (TransformerEngine saves no more: its fused RoPE and bias-GeLU save no extra activation)."""
    h, a, f = shape.hidden, shape.heads, shape.ffn
    if not (h and a and f and shape.norm in NORM_STATS and shape.mlp in ("swiglu", "gelu")):
        raise MmplanError(f"group {shape.group!r}: the fused kernel flavour needs the layer's hidden size, heads, MLP width, "
                          f"norm and MLP kind, and its profile does not record them all")
    e = ACTIVATION_BYTES[dtype]
    kv = (shape.kv_heads or a) * (h // a)
    norms = 2 * (e * h + STAT_BYTES * NORM_STATS[shape.norm])
    replicated = norms + 2 * e * h + (2 * MASK_BYTES * h if dropout else 0)
    core = STAT_BYTES * a
    attention = e * (h + 2 * kv) + e * h + core
    mlp = (3 if shape.mlp == "swiglu" else 2) * e * f
    return LayerSaved(total=replicated + attention + mlp, replicated=replicated, core=core)


def shape_layer_params(shape: ModelShape) -> float:
    """Parameters of one layer of `shape` (weights only): Q and O h^2 each, K and V h kv each, MLP 2 or 3 h f."""
    kv = (shape.kv_heads or shape.heads) * (shape.hidden // shape.heads)
    return 2 * shape.hidden ** 2 + 2 * shape.hidden * kv + (3 if shape.mlp == "swiglu" else 2) * shape.hidden * shape.ffn


def is_layer_of(block: Block, shape: ModelShape) -> bool:
    """Whether `block` is a plain transformer layer of `shape` (its group's): same group, a known sequence, and its
    parameters those of the shape's layer (within PARAM_TOLERANCE)."""
    if block.group != shape.group or not (shape.hidden and shape.heads and shape.ffn and shape.mlp and shape.norm):
        return False
    expected = shape_layer_params(shape)
    return abs(block.params - expected) <= PARAM_TOLERANCE * expected and (block.sequence or shape.sequence) > 0


def with_kernels(profile: Profile, kernels: Kernels, *, dropout: bool | None = None,
                 shapes: tuple[ModelShape, ...] | None = None) -> Profile:
    """`profile` with its transformer layers' saved activations as `kernels` store them: "eager" is the profile as
    measured (returned unchanged when it already is); "fused" replaces each plain layer's activation_bytes, its
    replicated share and its attention core by fused_layer_bytes x the block's sequence (other blocks -- embeddings,
    projectors, heads, cross-attention layers, frozen layers -- keep their measured bytes). `shapes` default to the profile's own;
    `dropout`: the layers apply dropout (Megatron's GPT: 0.1; LLaMA-style models: none); None: as each shape says
    (ModelShape.dropout, read from the model by the profiler)."""
    if kernels not in KERNELS:
        raise MmplanError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if kernels == profile.kernels:
        return profile
    if kernels == "eager":
        raise MmplanError("a fused profile cannot be turned back into eager measurements: profile the model again")
    by_group = {s.group: s for s in (shapes if shapes is not None else profile.shapes)}
    blocks = []
    for b in profile.blocks:
        shape = by_group.get(b.group)
        if shape is None or b.frozen or not is_layer_of(b, shape):  # a frozen layer saves only what the gradients
            blocks.append(b)  # of the blocks before it need (profiled so): its measured bytes stay
            continue
        drops = shape.dropout if dropout is None else dropout
        saved, s = fused_layer_bytes(shape, profile.dtype, dropout=drops), b.sequence or shape.sequence
        blocks.append(replace(b, activation_bytes=saved.total * s, activation_replicated_bytes=saved.replicated * s,
                              attention_core_bytes=saved.core * s))
    return replace(profile, blocks=tuple(blocks), kernels="fused")


__all__ = ["KERNELS", "Kernels", "LayerSaved", "fused_layer_bytes", "is_layer_of", "shape_layer_params", "with_kernels"]
