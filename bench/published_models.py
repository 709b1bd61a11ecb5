"""Torch modules shaped like the published runs the fidelity and memory benches compare with, and their profiles.

The published GPT runs (Narayanan et al. 2021; Korthikanti et al. 2022) used Megatron-LM's layer: LayerNorm,
one attention with an explicit softmax (QK^T and AV as batched GEMMs, a fused scale-mask-softmax, dropout on the
probabilities), dropout on both residual branches, a GELU MLP, and no flash attention (it predates them).
`MegatronLayer(attention="math")` is that layer; `attention="flash"` replaces the core by SDPA, as runs since
2023 (Llama 3, NeMo) do. The profiles are made by the real profiler (planner/profiler/profile.py: FLOPs by op class,
saved tensors by hooks) on FakeTensors, for two layers; the layer blocks are then repeated to the published depth
(every layer is the same module, so the same block).
"""
from __future__ import annotations

import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from planner.profiler.profile import profile_model
from plans.graph import Edge, Profile
from runtime.models.layers import RMSNorm
from runtime.source import ModelSource


class MathAttention(nn.Module):
    """Megatron's core attention (no flash): softmax(QK^T / sqrt(d)) with dropout, then AV; or SDPA ("flash")."""

    def __init__(self, dim: int, heads: int, kv_heads: int, dropout: float, flash: bool, *, bias: bool = True,
                 rotary: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.dropout, self.flash, self.rotary = dropout, flash, rotary
        self.wq = nn.Linear(dim, dim, bias=bias)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, hd)
        k = self.wk(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)
        if self.rotary:
            q, k = complex_rotary(q), complex_rotary(k)
        if self.flash:
            rep = self.heads // self.kv_heads
            if rep > 1:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, hd)
        else:
            # 1/sqrt(d) is folded into wq (see __init__): Megatron fuses the scale into its softmax kernel, and an
            # eager multiply would add traffic over the S x S scores that the real kernel does not have
            scores = torch.matmul(q, k.transpose(-1, -2))  # (B, H, S, S)
            probs = dropout(torch.softmax(scores, dim=-1), self.dropout)
            out = torch.matmul(probs, v)  # (B, H, S, hd)
        return self.wo(out.transpose(1, 2).flatten(2))


def complex_rotary(x: torch.Tensor) -> torch.Tensor:
    """RoPE as torchtitan's Llama applies it in eager PyTorch (torchtitan/models/llama/model.py apply_rotary_emb at
    9dec370): the (B, H, S, hd) query or key upcast to fp32, viewed as complex pairs, multiplied by the complex64
    rotation table and cast back: three memory-bound passes over it (the angles here are 0: FLOPs do not matter)."""
    B, H, S, hd = x.shape
    table = torch.polar(torch.ones(S, hd // 2, device=x.device), torch.zeros(S, hd // 2, device=x.device))
    rotated = torch.view_as_complex(x.float().reshape(B, H, S, hd // 2, 2)) * table  # (B, H, S, hd/2) complex64
    return torch.view_as_real(rotated).flatten(3).type_as(x)


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout as the fused CUDA kernel stores it: one pass writing the output and a 1-byte mask (aten.native_dropout;
    F.dropout on CPU keeps a mask in the input's dtype instead, Korthikanti et al. count 1 byte). p = 0: a model
    without dropout (LLaMA), no kernel at all."""
    return torch.ops.aten.native_dropout(x, p, True)[0] if p > 0 else x


class MegatronMLP(nn.Module):
    """fc2(gelu(fc1 x)), or LLaMA's gated w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.fc1 = nn.Linear(dim, hidden, bias=not gated)
        self.fc3 = nn.Linear(dim, hidden, bias=False) if gated else None
        self.fc2 = nn.Linear(hidden, dim, bias=not gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.fc2(F.silu(self.fc1(x)) * self.fc3(x))
        return self.fc2(F.gelu(self.fc1(x)))


class MegatronLayer(nn.Module):
    """x + drop(attn(ln(x))), then + drop(mlp(ln(x))): Megatron-LM's ParallelTransformerLayer (pre-norm)."""

    supports_tensor_parallel = True

    def __init__(self, dim: int, heads: int, mlp: int, *, kv_heads: int | None = None, dropout: float = 0.1,
                 attention: Literal["math", "flash"] = "math", norm: str = "layernorm", gated: bool = False,
                 rotary: bool = False) -> None:
        super().__init__()
        make = (lambda: nn.LayerNorm(dim)) if norm == "layernorm" else (lambda: RMSNorm(dim))
        self.ln1, self.ln2 = make(), make()
        # LLaMA (gated) has no biases (Touvron et al. 2023, section 2.2; torchtitan's Attention: bias=False)
        self.attn = MathAttention(dim, heads, kv_heads or heads, dropout, attention == "flash", bias=not gated,
                                  rotary=rotary)
        self.mlp = MegatronMLP(dim, mlp, gated)
        self.p = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + dropout(self.attn(self.ln1(x)), self.p)
        return x + dropout(self.mlp(self.ln2(x)), self.p)


class Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, positions: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim) if positions else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        return x + self.positions(torch.arange(ids.shape[1], device=ids.device)) if self.positions is not None else x


class Decoder(nn.Module):
    """Embedding, layers, final norm, vocabulary head and the cross-entropy loss."""

    def __init__(self, *, vocab: int, seq: int, dim: int, heads: int, mlp: int, layers: int, **layer) -> None:
        super().__init__()
        llama = layer.get("gated", False)
        self.embed = Embedding(vocab, seq, dim, positions=not llama)
        self.layers = nn.ModuleList(MegatronLayer(dim, heads, mlp, **layer) for _ in range(layers))
        self.norm = RMSNorm(dim) if llama else nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))  # (B, S, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def gpt_profile(name: str, *, layers: int, dim: int, heads: int, seq: int = 2048, vocab: int = 51200,
                mlp: int | None = None, kv_heads: int | None = None, attention: str = "math", dropout: float = 0.1,
                gated: bool = False, dtype: str = "bf16", softmax_grad_in_memory: bool = False, fused: bool = True,
                rotary: bool = False) -> Profile:
    """The profile of a `layers`-deep decoder: two layers profiled, the second repeated (same module, same block).
    `softmax_grad_in_memory`: the attention softmax's backward reads its incoming gradient from memory (Megatron-LM's
    separate attention-dropout kernel; profile_model); `fused=False`: memory-bound traffic as eager PyTorch moves it;
    `rotary`: torchtitan's eager fp32 complex RoPE on queries and keys (complex_rotary)."""
    kw = dict(vocab=vocab, seq=seq, dim=dim, heads=heads, mlp=mlp or 4 * dim, kv_heads=kv_heads, dropout=dropout,
              attention=attention, norm="rmsnorm" if gated else "layernorm", gated=gated, rotary=rotary)

    def factory(micro_batch: int):
        model = Decoder(layers=2, **kw)
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        return model, {"ids": ids, "labels": ids}

    small = profile_model(ModelSource(name, factory, dtype), micro_batch=1, softmax_grad_in_memory=softmax_grad_in_memory,
                          fused=fused)
    return repeat_layers(small, layers)


def repeat_layers(profile: Profile, layers: int) -> Profile:
    """`profile` (embed, layers.0, layers.1, norm, head) with layers.1 repeated to `layers` layers in all."""
    blocks = {b.name: b for b in profile.blocks}
    proto = blocks["layers.1"]
    layer_blocks = [blocks["layers.0"]] + [replace(proto, name=f"layers.{i}") for i in range(1, layers)]
    order = [blocks["embed"], *layer_blocks, blocks["norm"], blocks["head"]]
    hidden = proto.output_bytes
    names = [b.name for b in order]
    edges = tuple(Edge(a, b, hidden if b != "head" else blocks["norm"].output_bytes) for a, b in zip(names, names[1:]))
    return Profile.build(profile.model, profile.dtype, profile.micro_batch, tuple(order), edges,
                         inputs=profile.inputs, loss=("head",), attention=profile.attention)


def zoo_profile(name: str, *, text_seq: int | None = None, freeze: tuple[str, ...] = ()) -> Profile:
    """The profile of a model of mmplan's zoo (runtime/models/zoo.py) at its full depth, on FakeTensors, with the
    decoder's text tokens set to `text_seq` and the blocks matching `freeze` frozen (`mmplan profile --freeze`)."""
    from runtime.models import zoo

    config = zoo.resolve(name)
    if text_seq is not None:
        config = replace(config, decoder=replace(config.decoder, text_seq=text_seq))
    source = ModelSource(name, lambda mb: zoo.build(config, micro_batch=mb), config.dtype)
    return profile_model(source, micro_batch=1, freeze=freeze)


# LLaVA-1.5 as the published runs built it: CLIP ViT-L/14-336 + MLP projector + Vicuna-v1.5 (LLaMA-2), as transformers'
# LlavaForConditionalGeneration. 7B: runtime/models/hf_configs/llava-1.5-7b (llava-hf/llava-1.5-7b-hf's config; its text
# model is transformers' LlamaConfig defaults, the 7B). 13B: the same with the text sizes of lmsys/vicuna-13b-v1.5's
# config.json (LLaMA-2-13B: hidden 5120, MLP 13824, 40 heads, 40 layers).
_HF_CONFIGS = Path(__file__).resolve().parents[1] / "runtime" / "models" / "hf_configs"
LLAVA_13B_TEXT = {"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40,
                  "num_hidden_layers": 40}


def hf_llava_profile(size: str, *, text_tokens: int, freeze: tuple[str, ...] = (), fused: bool = False) -> Profile:
    """The profile of transformers' LLaVA-1.5 `size` ("7b" / "13b") on FakeTensors with `text_tokens` text tokens after
    the 576 image tokens; `fused=False` counts memory-bound traffic as eager PyTorch moves it (planner.profiler.profile)."""
    from runtime.source import resolve

    config = json.loads((_HF_CONFIGS / "llava-1.5-7b" / "config.json").read_text())
    if size == "13b":
        config["text_config"].update(LLAVA_13B_TEXT)
    elif size != "7b":
        raise ValueError(f"LLaVA-1.5 size must be 7b or 13b, got {size!r}")
    config["mmplan_inputs"] = {"text_tokens": text_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return profile_model(resolve(f"hf:{tmp}"), micro_batch=1, freeze=freeze, fused=fused)
