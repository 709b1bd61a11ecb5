"""Turn an ArchConfig into torch modules and an example batch of matching shapes."""

from __future__ import annotations

import torch
from torch import nn

from .audio import AudioEncoder
from .clip import ClipModel, ContrastiveHead, TextEncoder
from .configs import ArchConfig, DecoderConfig
from .flamingo import FlamingoDecoder
from .gpt import GPTDecoder
from .llama import LlamaDecoder
from .multimodal import MultimodalLM
from .projector import Projector
from .vit import VisionEncoder


def build_decoder(cfg: DecoderConfig) -> nn.Module:
    """A FlamingoDecoder when cross_attention_every > 0, else a LlamaDecoder or GPTDecoder by type."""
    if cfg.cross_attention_every:
        return FlamingoDecoder(cfg)
    return LlamaDecoder(cfg) if cfg.type == "llama" else GPTDecoder(cfg)


def build_model(arch: ArchConfig) -> nn.Module:
    """The model of arch, with default initialisation; model(**example_batch(arch, B)) is a scalar loss."""
    if arch.kind == "clip":
        return ClipModel(
            image_tower=VisionEncoder(arch.vision),
            image_proj=nn.Linear(arch.vision.hidden, arch.clip.embed_dim, bias=False),
            text_tower=TextEncoder(arch.clip),
            text_proj=nn.Linear(arch.clip.text_hidden, arch.clip.embed_dim, bias=False),
            head=ContrastiveHead(),
        )
    width = arch.decoder.hidden
    towers = {}
    if arch.vision is not None:
        towers["vision"] = VisionEncoder(arch.vision)
        towers["vision_proj"] = Projector(
            arch.vision.hidden, width, hidden=arch.projector.hidden, merge=arch.projector.merge
        )
    if arch.audio is not None:
        towers["audio"] = AudioEncoder(arch.audio)
        towers["audio_proj"] = Projector(
            arch.audio.hidden, width, hidden=arch.audio_projector.hidden, merge=arch.audio_projector.merge
        )
    return MultimodalLM(build_decoder(arch.decoder), **towers)


def example_batch(arch: ArchConfig, micro_batch: int) -> dict[str, torch.Tensor]:
    """Random inputs of the right shapes: images (B, C, H, W), mels (B, M, T), tokens and targets (B, S) int64."""
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    B = micro_batch
    batch = {}
    if arch.vision is not None:
        v = arch.vision
        batch["images"] = torch.randn(B, v.channels, v.image_size, v.image_size)
    if arch.audio is not None:
        batch["mels"] = torch.randn(B, arch.audio.n_mels, arch.audio.frames)
    if arch.kind == "clip":
        batch["tokens"] = torch.randint(arch.clip.vocab, (B, arch.clip.text_seq))
    else:
        batch["tokens"] = torch.randint(arch.decoder.vocab, (B, arch.decoder.text_seq))
        batch["targets"] = torch.randint(arch.decoder.vocab, (B, arch.decoder.text_seq))
    return batch
