"""GPT-2/3-style decoder: token + learned position embedding, causal LayerNorm/GELU layers, norm, LM head."""

from __future__ import annotations

import torch
from torch import nn

from .configs import DecoderConfig
from .layers import TransformerLayer
from .llama import DecoderStack


class TokenPositionEmbedding(nn.Module):
    """Token embedding plus a learned embedding of positions 0..S-1: tokens (B, S) to (B, S, D)."""

    def __init__(self, vocab: int, max_seq: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_seq, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (S,)
        return self.tokens(tokens) + self.positions(positions)


class GPTDecoder(DecoderStack):
    """GPT decoder (Radford et al. 2019, Brown et al. 2020) returning logits.

    Learned positions cover the text tokens only (text_seq of them); encoder tokens placed before the
    text carry their encoder's own positions. The head can be tied to the token embedding, as in GPT-2/3.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed = TokenPositionEmbedding(cfg.vocab, cfg.text_seq, cfg.hidden)
        self.layers = nn.ModuleList(
            TransformerLayer(
                cfg.hidden, cfg.heads, cfg.mlp, n_kv_heads=cfg.kv_heads, norm="layernorm", mlp="gelu", causal=True
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.tokens.weight
