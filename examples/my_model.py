"""An example of bringing your own model to mmplan: `mmplan profile examples.my_model:factory`."""
import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block; a real model would use attention layers here."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Encoder(nn.Module):
    def __init__(self, in_dim: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


class TwoTowerRegressor(nn.Module):
    """Two modality towers (top-level children = module groups) fused by a head."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = Encoder(48, 64, 4)
        self.audio = Encoder(16, 32, 2)
        self.head = nn.Linear(64 + 32, 1)

    def forward(self, images: torch.Tensor, audio: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        fused = torch.cat([self.vision(images).mean(1), self.audio(audio).mean(1)], dim=-1)  # (B, 96)
        return nn.functional.mse_loss(self.head(fused).squeeze(-1), targets)


def factory(micro_batch: int = 1):
    """Returns (model, example batch); model(**batch) is the scalar loss. No device=: mmplan picks it."""
    batch = {
        "images": torch.randn(micro_batch, 16, 48),
        "audio": torch.randn(micro_batch, 8, 16),
        "targets": torch.randn(micro_batch),
    }
    return TwoTowerRegressor(), batch
