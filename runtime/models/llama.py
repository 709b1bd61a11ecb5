"""LLaMA-style decoder: token embedding, causal RMSNorm/SwiGLU/rotary/GQA layers, final norm, LM head."""

from __future__ import annotations

import torch
from torch import nn

from .configs import DecoderConfig
from .layers import RMSNorm, TransformerLayer


def llama_layer(cfg: DecoderConfig) -> TransformerLayer:
    """One LLaMA decoder layer: causal, RMSNorm, SwiGLU, rotary, grouped-query, no biases."""
    return TransformerLayer(
        cfg.hidden,
        cfg.heads,
        cfg.mlp,
        n_kv_heads=cfg.kv_heads,
        norm="rmsnorm",
        mlp="swiglu",
        causal=True,
        rotary=True,
        bias=False,
    )


def embeddings_or_tokens(
    embed: nn.Module, tokens: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> torch.Tensor:
    """The decoder input (B, S, D): embed(tokens), or inputs_embeds as given; exactly one must be passed."""
    if (tokens is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of tokens or inputs_embeds")
    return embed(tokens) if inputs_embeds is None else inputs_embeds


class DecoderStack(nn.Module):
    """A decoder's forward: embed (tokens or given embeddings), the layers, final norm, LM head.
    Subclasses build `embed`, `layers`, `norm` and `head`."""

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """Logits (B, S_keep, V) for the last logits_to_keep positions (all when None)."""
        x = embeddings_or_tokens(self.embed, tokens, inputs_embeds)  # (B, S, D)
        for layer in self.layers:
            x = layer(x)
        if logits_to_keep is not None:
            x = x[:, -logits_to_keep:]  # (B, S_keep, D)
        return self.head(self.norm(x))


class LlamaDecoder(DecoderStack):
    """LLaMA (Touvron et al. 2023) decoder returning logits; the head can be tied to the embedding."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(llama_layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
