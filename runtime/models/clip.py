"""CLIP-style two-tower contrastive model: image and text towers that meet only at the loss head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .configs import ClipConfig
from .gpt import TokenPositionEmbedding
from .layers import TransformerLayer
from .vit import VisionEncoder


class TextEncoder(nn.Module):
    """CLIP text transformer: tokens (B, S) to one embedding per sequence (B, D), pooled at the last token."""

    def __init__(self, cfg: ClipConfig) -> None:
        super().__init__()
        self.embed = TokenPositionEmbedding(cfg.vocab, cfg.text_seq, cfg.text_hidden)
        self.layers = nn.ModuleList(
            TransformerLayer(
                cfg.text_hidden, cfg.text_heads, cfg.text_mlp, norm="layernorm", mlp="gelu", causal=cfg.causal
            )
            for _ in range(cfg.text_layers)
        )
        self.norm = nn.LayerNorm(cfg.text_hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, S, D)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x[:, -1])  # (B, D)


class ContrastiveHead(nn.Module):
    """Symmetric InfoNCE loss over a batch of paired embeddings (Radford et al. 2021, Fig. 3)."""

    def __init__(self) -> None:
        super().__init__()
        # CLIP initialises the temperature at 0.07 and learns log(1 / temperature).
        self.logit_scale = nn.Parameter(torch.full((), math.log(1 / 0.07)))

    def forward(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        image_emb = F.normalize(image_emb, dim=-1)  # (B, E)
        text_emb = F.normalize(text_emb, dim=-1)  # (B, E)
        logits = self.logit_scale.exp().clamp(max=100) * image_emb @ text_emb.T  # (B_image, B_text)
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class ClipModel(nn.Module):
    """image_tower -> image_proj and text_tower -> text_proj, joined only by `head`; forward returns the loss."""

    def __init__(
        self,
        image_tower: VisionEncoder,
        image_proj: nn.Module,
        text_tower: TextEncoder,
        text_proj: nn.Module,
        head: ContrastiveHead,
    ) -> None:
        super().__init__()
        self.image_tower = image_tower
        self.image_proj = image_proj
        self.text_tower = text_tower
        self.text_proj = text_proj
        self.head = head

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """(B, E) image embeddings, pooled at the class token (or by mean without one)."""
        x = self.image_tower(images)  # (B, N, D)
        pooled = x[:, 0] if self.image_tower.num_class_tokens else x.mean(dim=1)  # (B, D)
        return self.image_proj(pooled)

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, E) text embeddings."""
        return self.text_proj(self.text_tower(tokens))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode_images(images), self.encode_text(tokens))
