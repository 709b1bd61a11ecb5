"""ViT image encoder: patch embedding, a stack of bidirectional layers, a final LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from .configs import VisionConfig
from .layers import TransformerLayer


class PatchEmbed(nn.Module):
    """Conv2d patchify, optional class token, learned position embedding: images to (B, N(+1), D)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.channels, cfg.hidden, kernel_size=cfg.patch, stride=cfg.patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden)) if cfg.class_token else None
        self.positions = nn.Parameter(0.02 * torch.randn(1, cfg.patches + int(cfg.class_token), cfg.hidden))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)  # (B, N, D)
        if self.class_token is not None:
            x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, D)
        return x + self.positions


class VisionEncoder(nn.Module):
    """ViT (Dosovitskiy et al. 2021): images (B, C, H, W) to tokens (B, N, D), class token first if any."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_class_tokens = int(cfg.class_token)
        self.patch_embed = PatchEmbed(cfg)
        self.layers = nn.ModuleList(
            TransformerLayer(cfg.hidden, cfg.heads, cfg.mlp, norm="layernorm", mlp="gelu") for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)
