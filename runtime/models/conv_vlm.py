"""A VLM with a convolutional image encoder (pre-activation residual blocks, He et al. 2016, "Identity Mappings in
Deep Residual Networks"; Flamingo's vision encoder is likewise convolutional, an NFNet) feeding a LLaMA decoder: the
default model of `mmplan demo` (`runtime.models.conv_vlm:factory`).

Convolutions have no Megatron-style tensor parallelism (only transformer layers shard), so a tp > 1 layout for
the whole model would repeat the encoder's work on every tp rank; data parallelism suits the encoder: it is
compute-dense (1.3 M parameters, ~1.5 GFLOP per 96 x 96 image in the forward) and ends in a global average pool
to 2 x 2 positions, as a CNN's classification head does, so its projector is small (29 k parameters) and a
data-parallel step all-reduces only ~5.5 MB of gradients. The LLM is the opposite: a 32k vocabulary makes 8.4 M of
its 8.9 M parameters embedding and head, used by 4 image + 4 text tokens per sample, so replicating it costs a
gradient all-reduce and an optimizer step over all of it on every rank, while sharding it (tp, pipeline stages)
does not.

The shape was chosen by measurement (`mmplan demo`, 2 ranks of a 2-vCPU AMD EPYC VM): with the earlier 128-channel
encoder on 64 x 64 images and a projector concatenating 64 positions (2.9 M parameters to all-reduce), slow gloo
all-reduces (~1 GB/s, 1-3 ms per call) ate most of the data-parallel encoder's gain (measured 1.07-1.26x over
the best one-layout plan); 64 channels on 128 x 128 images run at half the roofline on a CPU. Once the ranks kept
their freed memory (runtime/host_memory.py), the LLM's optimizer step, which a one-layout pipeline gives one rank,
got 2x faster, and 6 blocks measured 1.14x: 8 blocks measured 1.28-1.39x; 10 no longer fit the solved layout's
activations under the demo's memory cap."""
from __future__ import annotations

import torch
from torch import nn

from .build import build_decoder
from .configs import DecoderConfig
from .multimodal import MultimodalLM
from .projector import Projector

IMAGE, PATCH, CHANNELS, BLOCKS = 96, 4, 96, 8  # 96 x 96 images -> 24 x 24 feature maps of 96 channels
DECODER = DecoderConfig(type="llama", hidden=128, layers=2, heads=4, vocab=32768, text_seq=4)
POOL = 2  # the feature map is average-pooled to POOL x POOL positions: 4 LLM tokens


class ConvStem(nn.Module):
    """Non-overlapping PATCH x PATCH convolution: (B, 3, H, W) -> (B, C, H / PATCH, W / PATCH)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, CHANNELS, PATCH, stride=PATCH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class ConvBlock(nn.Module):
    """x + conv(gelu(norm(conv(gelu(norm(x)))))): two 3 x 3 convolutions, group norm (Wu & He 2018)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(8, CHANNELS), nn.GroupNorm(8, CHANNELS)
        self.conv1 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
        self.conv2 = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(nn.functional.gelu(self.norm1(x)))
        return x + self.conv2(nn.functional.gelu(self.norm2(h)))


class ConvEncoder(nn.Module):
    """Images (B, 3, H, W) -> tokens (B, POOL^2, C): the feature map average-pooled to POOL x POOL positions."""

    num_class_tokens = 0

    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvStem()
        self.layers = nn.ModuleList(ConvBlock() for _ in range(BLOCKS))
        self.norm = nn.GroupNorm(8, CHANNELS)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.adaptive_avg_pool2d(self.norm(x), POOL).flatten(2).transpose(1, 2)


def factory(micro_batch: int = 1):
    """(model, example batch): model(**batch) is the scalar loss."""
    model = MultimodalLM(build_decoder(DECODER), vision=ConvEncoder(),
                         vision_proj=Projector(CHANNELS, DECODER.hidden))
    batch = {"tokens": torch.randint(DECODER.vocab, (micro_batch, DECODER.text_seq)),
             "targets": torch.randint(DECODER.vocab, (micro_batch, DECODER.text_seq)),
             "images": torch.randn(micro_batch, 3, IMAGE, IMAGE)}
    return model, batch
