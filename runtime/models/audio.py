"""Whisper-style audio encoder: conv frontend, a stack of bidirectional layers, a final LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configs import AudioConfig
from .layers import TransformerLayer


class AudioFrontend(nn.Module):
    """Two Conv1d + GELU (the second with stride 2) and learned positions: mels (B, M, T) to (B, T/2, D)."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.hidden, cfg.hidden, kernel_size=3, stride=2, padding=1)
        self.positions = nn.Parameter(0.02 * torch.randn(1, cfg.positions, cfg.hidden))

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(mels))))  # (B, D, T/2)
        return x.transpose(1, 2) + self.positions  # (B, T/2, D)


class AudioEncoder(nn.Module):
    """Whisper encoder (Radford et al. 2022): log-mel spectrograms (B, n_mels, T) to tokens (B, T/2, D)."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.frontend = AudioFrontend(cfg)
        self.layers = nn.ModuleList(
            TransformerLayer(cfg.hidden, cfg.heads, cfg.mlp, norm="layernorm", mlp="gelu") for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:
        x = self.frontend(mels)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)
