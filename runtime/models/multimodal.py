"""LLaVA-style multimodal LM: optional vision/audio towers and projectors feeding a decoder; forward is the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .audio import AudioEncoder
from .flamingo import FlamingoDecoder
from .projector import Projector
from .vit import VisionEncoder


class MultimodalLM(nn.Module):
    """Encoders -> projectors -> LLM, with cross-entropy on the text positions only.

    Concat-style decoders (LLaMA, GPT) read [image tokens, audio tokens, text embeddings] as one sequence;
    a FlamingoDecoder reads the text only and gets the encoder tokens as cross-attention context.
    The glue between blocks lives in small methods so a pipeline runtime can run the blocks stage by stage.
    """

    def __init__(
        self,
        llm: nn.Module,
        *,
        vision: VisionEncoder | None = None,
        vision_proj: Projector | None = None,
        audio: AudioEncoder | None = None,
        audio_proj: Projector | None = None,
    ) -> None:
        super().__init__()
        if (vision is None) != (vision_proj is None) or (audio is None) != (audio_proj is None):
            raise ValueError("each encoder needs its projector and each projector its encoder")
        self.vision = vision
        self.vision_proj = vision_proj
        self.audio = audio
        self.audio_proj = audio_proj
        self.llm = llm

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) to LLM-width tokens (B, N / merge, D), class token dropped as in LLaVA."""
        patches = self.vision(images)[:, self.vision.num_class_tokens :]  # (B, N, D_vision)
        return self.vision_proj(patches)

    def encode_audio(self, mels: torch.Tensor) -> torch.Tensor:
        """Mels (B, n_mels, T) to LLM-width tokens (B, T / 2 / merge, D)."""
        return self.audio_proj(self.audio(mels))

    def encode(self, images: torch.Tensor | None, mels: torch.Tensor | None) -> list[torch.Tensor]:
        """Projected tokens of each present encoder, vision first."""
        encoded = []
        if self.vision is not None:
            encoded.append(self.encode_images(images))
        if self.audio is not None:
            encoded.append(self.encode_audio(mels))
        return encoded

    def fuse(self, encoded: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """The LLM input (B, P + S, D): encoder tokens, then the text embeddings."""
        return torch.cat([*encoded, self.llm.embed(tokens)], dim=1)

    def lm_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of text logits (B, S, V) against targets (B, S)."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor,
        images: torch.Tensor | None = None,
        mels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        encoded = self.encode(images, mels)
        if isinstance(self.llm, FlamingoDecoder):
            logits = self.llm(tokens, context=torch.cat(encoded, dim=1))
        else:
            logits = self.llm(inputs_embeds=self.fuse(encoded, tokens), logits_to_keep=tokens.shape[1])
        return self.lm_loss(logits, targets)
