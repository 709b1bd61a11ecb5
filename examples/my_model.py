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


class RegressionData:
    """A learnable dataset for `mmplan run ... --data examples.my_model:dataset`: the target is a fixed linear
    function of the inputs' means, so the loss can fall. Deterministic in the global sample index."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.w_images = torch.randn(48, generator=gen)
        self.w_audio = torch.randn(16, generator=gen)
        self.seed = seed

    def sample_batch(self, indices) -> dict[str, torch.Tensor]:
        images, audio = [], []
        for i in indices:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
            images.append(torch.randn(16, 48, generator=gen))
            audio.append(torch.randn(8, 16, generator=gen))
        images, audio = torch.stack(images), torch.stack(audio)
        targets = images.mean(1) @ self.w_images + audio.mean(1) @ self.w_audio
        return {"images": images, "audio": audio, "targets": targets}


def dataset(seed: int = 0) -> RegressionData:
    return RegressionData(seed)
