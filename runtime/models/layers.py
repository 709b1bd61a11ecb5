"""Transformer building blocks shared by every tower: norms, rotary, attention, MLPs, the pre-norm layer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(
    seq_len: int, head_dim: int, like: torch.Tensor, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles (Su et al. 2021) for positions 0..seq_len-1, each (S, head_dim/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=like.device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=like.device, dtype=torch.float32), inv_freq)  # (S, hd/2)
    return angles.cos().to(like.dtype), angles.sin().to(like.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, S, hd) by position, pairing the two halves of the head dim (the HF LLaMA layout)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, H, S, hd/2) each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v for q (B, H, S, hd) and k, v (B, Hkv, T, hd): the attention core (B, H, S, hd).

    Grouped-query attention: each of the Hkv key/value heads serves H / Hkv query heads. The ratio is read
    from the shapes, so it stays right when tensor parallelism shards the heads.
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)  # (B, H, T, hd)
        v = v.repeat_interleave(n_rep, dim=1)  # (B, H, T, hd)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, H, S, hd)


class _RecomputedCore(torch.autograd.Function):
    """The attention core saving only its inputs q, k, v; the backward recomputes it (selective recompute,
    Korthikanti et al. 2022, section 5: QK^T, softmax, dropout and AV are cheap to recompute, big to keep)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        ctx.causal = causal
        ctx.save_for_backward(q, k, v)
        return attention_core(q, k, v, causal)  # grad mode is off inside forward: nothing else is saved

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = attention_core(*inputs, ctx.causal)
        return (*torch.autograd.grad(out, inputs, grad), None)


_SELECTIVE = threading.local()  # .on: attend() recomputes its core in the backward (this thread's forward only)


@contextlib.contextmanager
def recompute_attention_core() -> Iterator[None]:
    """Inside, every attend() saves only q, k, v and recomputes the core in the backward (the 'selective' tier)."""
    before = getattr(_SELECTIVE, "on", False)
    _SELECTIVE.on = True
    try:
        yield
    finally:
        _SELECTIVE.on = before


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Queries (B, H, S, hd) against keys/values (B, Hkv, T, hd); returns (B, S, H * hd)."""
    if getattr(_SELECTIVE, "on", False) and torch.is_grad_enabled():
        out = _RecomputedCore.apply(q, k, v, causal)
    else:
        out = attention_core(q, k, v, causal)  # (B, H, S, hd)
    return out.transpose(1, 2).flatten(2)  # (B, S, H * hd)


class Attention(nn.Module):
    """Multi-head self-attention with grouped-query heads and optional rotary positions."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        *,
        causal: bool = False,
        rotary: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        self.head_dim = dim // n_heads
        self.causal = causal
        self.rotary = rotary
        self.rope_theta = 10000.0  # RoPE's base (Su et al. 2021, RoFormer; LLaMA's): read by the profiler's model shape
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, hd)
        k = self.wk(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
        v = self.wv(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, S, hd)
        if self.rotary:
            cos, sin = rotary_tables(S, self.head_dim, q, self.rope_theta)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.wo(attend(q, k, v, self.causal))


class CrossAttention(nn.Module):
    """Attention of x's tokens (queries) over a context sequence (keys and values), without positions."""

    def __init__(
        self, dim: int, context_dim: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = False
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(context_dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(context_dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        (B, S, _), T = x.shape, context.shape[1]
        q = self.wq(x).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, H, S, hd)
        k = self.wk(context).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.wv(context).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        return self.wo(attend(q, k, v, causal=False))


class SwiGLU(nn.Module):
    """Gated MLP of LLaMA (Shazeer 2020): w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """Two-layer GELU MLP of ViT, Whisper and GPT: fc2(gelu(fc1 x))."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def make_norm(kind: Literal["layernorm", "rmsnorm"], dim: int) -> nn.Module:
    """A LayerNorm (with bias) or an RMSNorm of width dim."""
    return nn.LayerNorm(dim) if kind == "layernorm" else RMSNorm(dim)


def make_mlp(kind: Literal["swiglu", "gelu"], dim: int, hidden: int, *, bias: bool) -> nn.Module:
    """A SwiGLU (always bias-free) or a GELU MLP."""
    return SwiGLU(dim, hidden) if kind == "swiglu" else GeluMLP(dim, hidden, bias=bias)


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    supports_tensor_parallel = True

    def __init__(
        self,
        dim: int,
        n_heads: int,
        mlp_hidden: int,
        *,
        n_kv_heads: int | None = None,
        norm: Literal["layernorm", "rmsnorm"] = "layernorm",
        mlp: Literal["swiglu", "gelu"] = "gelu",
        causal: bool = False,
        rotary: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.attn_norm = make_norm(norm, dim)
        self.attn = Attention(dim, n_heads, n_kv_heads, causal=causal, rotary=rotary, bias=bias)
        self.mlp_norm = make_norm(norm, dim)
        self.mlp = make_mlp(mlp, dim, mlp_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))
