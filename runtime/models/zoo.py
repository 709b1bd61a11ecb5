"""Named architectures and the uniform entry point: build(name) -> (model, example batch)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .arch_toml import load_arch_toml
from .build import build_model, example_batch
from .configs import ArchConfig, AudioConfig, ClipConfig, DecoderConfig, ProjectorConfig, VisionConfig

# Tiny models: CPU-trainable in fp32, a forward+backward well under 100 ms at micro-batch 2 on one thread.
_TINY_VISION = VisionConfig(image_size=32, patch=8, hidden=64, layers=2, heads=4, mlp=128, class_token=True)
_TINY_LLAMA = DecoderConfig(type="llama", hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, vocab=256, text_seq=16)
_TINY = (
    ArchConfig(name="tiny-vlm", vision=_TINY_VISION, decoder=_TINY_LLAMA),
    ArchConfig(
        name="tiny-avlm",
        vision=_TINY_VISION,
        audio=AudioConfig(n_mels=16, frames=32, hidden=64, layers=2, heads=4, mlp=128),
        decoder=_TINY_LLAMA,
    ),
    ArchConfig(
        name="tiny-flamingo",
        vision=_TINY_VISION,
        decoder=DecoderConfig(
            type="llama",
            hidden=64,
            layers=4,
            heads=4,
            kv_heads=2,
            mlp=128,
            vocab=256,
            text_seq=16,
            cross_attention_every=2,
        ),
    ),
    ArchConfig(
        name="tiny-clip",
        vision=_TINY_VISION,
        clip=ClipConfig(
            embed_dim=32, text_hidden=64, text_layers=2, text_heads=4, text_mlp=128, vocab=256, text_seq=16
        ),
    ),
    # tiny-vlm with the LM head tied to the token embedding (as Gemma 3, PaliGemma, GPT-2): `llm.embed` and `llm.head`
    # are two blocks holding one Parameter (the tests of tied weights under ZeRO and pipelines).
    ArchConfig(name="tiny-vlm-tied", vision=_TINY_VISION,
               decoder=DecoderConfig(type="llama", hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, vocab=256,
                                     text_seq=16, tie_embeddings=True)),
    # The vision tower costs far more than the LLM (about 28x its forward FLOPs): a case for uneven pipeline stages.
    ArchConfig(
        name="tiny-vlm-heavy",
        vision=VisionConfig(image_size=32, patch=8, hidden=128, layers=6, heads=4, mlp=512, class_token=True),
        decoder=DecoderConfig(type="llama", hidden=32, layers=2, heads=2, mlp=64, vocab=128, text_seq=16),
    ),
)

# Real sizes, for planning only (built under FakeTensorMode or the meta device); bf16 by default.
_CLIP_VIT_L_336 = VisionConfig(image_size=336, patch=14, hidden=1024, layers=24, heads=16, mlp=4096, class_token=True)
_LLAMA2_7B = dict(type="llama", hidden=4096, layers=32, heads=32, mlp=11008, vocab=32000)
_LLAMA2_13B = dict(type="llama", hidden=5120, layers=40, heads=40, mlp=13824, vocab=32000)
_LLAMA2_70B = dict(type="llama", hidden=8192, layers=80, heads=64, kv_heads=8, mlp=28672, vocab=32000)
_REAL = (
    # LLaVA-1.5 (Liu et al. 2023): CLIP ViT-L/14-336 (576 patch tokens) + MLP projector + Vicuna; 2048 LLM tokens.
    ArchConfig(
        name="llava-1.5-7b",
        dtype="bf16",
        vision=_CLIP_VIT_L_336,
        decoder=DecoderConfig(**_LLAMA2_7B, text_seq=2048 - 576),
    ),
    ArchConfig(
        name="llava-1.5-13b",
        dtype="bf16",
        vision=_CLIP_VIT_L_336,
        decoder=DecoderConfig(**_LLAMA2_13B, text_seq=2048 - 576),
    ),
    # Qwen2-VL-72B (Wang et al. 2024): 675M ViT, 448^2 images = 1024 patches merged 2x2 -> 256 tokens.
    ArchConfig(
        name="qwen2-vl-72b",
        dtype="bf16",
        vision=VisionConfig(image_size=448, patch=14, hidden=1280, layers=32, heads=16, mlp=5120),
        projector=ProjectorConfig(hidden=4 * 1280, merge=4),
        decoder=DecoderConfig(
            type="llama", hidden=8192, layers=80, heads=64, kv_heads=8, mlp=29568, vocab=152064, text_seq=2048 - 256
        ),
    ),
    # ViT-22B (Dehghani et al. 2023), 224^2 images = 256 patches, feeding LLaMA-2-70B.
    ArchConfig(
        name="vit22b-llama70b",
        dtype="bf16",
        vision=VisionConfig(image_size=224, patch=14, hidden=6144, layers=48, heads=48, mlp=24576),
        decoder=DecoderConfig(**_LLAMA2_70B, text_seq=2048 - 256),
    ),
    # Whisper large-v3 encoder (3000 mel frames -> 1500 tokens) feeding LLaMA-2-7B; 1500 + 548 = 2048.
    ArchConfig(
        name="whisper-llama-7b",
        dtype="bf16",
        audio=AudioConfig(n_mels=128, frames=3000, hidden=1280, layers=32, heads=20, mlp=5120),
        decoder=DecoderConfig(**_LLAMA2_7B, text_seq=548),
    ),
)

ZOO: dict[str, ArchConfig] = {arch.name: arch for arch in (*_TINY, *_REAL)}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def names() -> list[str]:
    """The zoo's model names, tiny ones first."""
    return list(ZOO)


def resolve(spec: str | os.PathLike | ArchConfig) -> ArchConfig:
    """The ArchConfig for a zoo name or a path to an architecture .toml (an ArchConfig passes through)."""
    if isinstance(spec, ArchConfig):
        return spec
    if str(spec) in ZOO:
        return ZOO[str(spec)]
    if str(spec).endswith(".toml") or Path(spec).is_file():
        return load_arch_toml(spec)
    raise ValueError(f"unknown model {str(spec)!r}: not a .toml file nor one of {', '.join(names())}")


def default_dtype(spec: str | os.PathLike | ArchConfig) -> torch.dtype:
    """The dtype the architecture trains in (torch.float32 or torch.bfloat16)."""
    return _DTYPES[resolve(spec).dtype]


def build(
    spec: str | os.PathLike | ArchConfig, micro_batch: int = 1, *, dtype: torch.dtype | None = None
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model and an example batch; model(**batch) is a scalar loss.

    Only default factory functions and default init are used and no device is passed, so the caller
    chooses where tensors live: under FakeTensorMode() or `with torch.device("meta")` a 70B model costs
    no memory. With dtype, parameters and float inputs are created in it (tokens stay int64): it is the
    default dtype during construction, since model.to(dtype) fails on fake parameters.
    """
    arch = resolve(spec)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or previous)
    try:
        return build_model(arch), example_batch(arch, micro_batch)
    finally:
        torch.set_default_dtype(previous)
