"""Flamingo-style decoder: LLaMA layers, every k-th preceded by a tanh-gated cross-attention to encoder tokens."""

from __future__ import annotations

import torch
from torch import nn

from .configs import DecoderConfig
from .layers import CrossAttention, RMSNorm, SwiGLU
from .llama import embeddings_or_tokens, llama_layer

# Flamingo (Alayrac et al. 2022, eq. 1) initialises the gates at 0 so that tanh(gate) = 0 and the
# pretrained LM is unchanged at init. But then every gradient reaching the cross-attention weights,
# the projector and the vision tower is exactly zero at the first step, so the vision side would not
# train (nor would a profiler see its real backward). A small nonzero gate keeps the LM nearly intact
# while letting gradients flow everywhere from step one.
GATE_INIT = 0.1


class GatedCrossAttention(nn.Module):
    """x + tanh(a) * xattn(norm(x), context), then x + tanh(b) * mlp(norm(x)): Flamingo's GATED XATTN-DENSE."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = CrossAttention(cfg.hidden, cfg.hidden, cfg.heads, cfg.kv_heads)
        self.attn_gate = nn.Parameter(torch.full((1,), GATE_INIT))
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = SwiGLU(cfg.hidden, cfg.mlp)
        self.mlp_gate = nn.Parameter(torch.full((1,), GATE_INIT))

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_gate.tanh() * self.attn(self.attn_norm(x), context)
        return x + self.mlp_gate.tanh() * self.mlp(self.mlp_norm(x))


class FlamingoLayer(nn.Module):
    """A LLaMA self-attention layer, preceded by a gated cross-attention when `cross` is present."""

    supports_tensor_parallel = True

    def __init__(self, cfg: DecoderConfig, cross_attention: bool) -> None:
        super().__init__()
        self.cross = GatedCrossAttention(cfg) if cross_attention else None
        self.self_layer = llama_layer(cfg)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        if self.cross is not None:
            x = self.cross(x, context)
        return self.self_layer(x)


class FlamingoDecoder(nn.Module):
    """LLaMA decoder whose layers listed in cfg.cross_attention_layers attend to a context (B, T, D)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        cross = set(cfg.cross_attention_layers)
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(FlamingoLayer(cfg, i in cross) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        context: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """Logits (B, S_keep, V) for the last logits_to_keep positions (all when None)."""
        x = embeddings_or_tokens(self.embed, tokens, inputs_embeds)  # (B, S, D)
        for layer in self.layers:
            # only cross-attention layers receive the context: that is the data flow a planner must see
            x = layer(x, context) if layer.cross is not None else layer(x)
        if logits_to_keep is not None:
            x = x[:, -logits_to_keep:]  # (B, S_keep, D)
        return self.head(self.norm(x))
