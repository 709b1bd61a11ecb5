"""Frozen architecture descriptions: one dataclass per component, each validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


def _check_int(cfg: object, name: str, minimum: int = 1) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{type(cfg).__name__}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_bool(cfg: object, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, bool):
        raise ValueError(f"{type(cfg).__name__}.{name} must be true or false, got {value!r}")


def _check_choice(cfg: object, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"{type(cfg).__name__}.{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_divisible(cfg: object, name: str, by: str) -> None:
    value, divisor = getattr(cfg, name), getattr(cfg, by)
    if value % divisor:
        raise ValueError(f"{type(cfg).__name__}.{name}={value} must be divisible by {by}={divisor}")


def _default(cfg: object, name: str, value: object) -> None:
    """Fill an optional field left as None (frozen dataclasses need object.__setattr__)."""
    if getattr(cfg, name) is None:
        object.__setattr__(cfg, name, value)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """ViT image encoder: square images cut into square patches; `mlp` defaults to 4 * hidden."""

    image_size: int
    patch: int
    hidden: int
    layers: int
    heads: int
    mlp: int | None = None
    class_token: bool = False
    channels: int = 3

    def __post_init__(self) -> None:
        for name in ("image_size", "patch", "hidden", "layers", "heads", "channels"):
            _check_int(self, name)
        _default(self, "mlp", 4 * self.hidden)
        _check_int(self, "mlp")
        _check_bool(self, "class_token")
        _check_divisible(self, "image_size", "patch")
        _check_divisible(self, "hidden", "heads")

    @property
    def patches(self) -> int:
        """Patch tokens per image (the class token not included)."""
        return (self.image_size // self.patch) ** 2


@dataclass(frozen=True, slots=True)
class AudioConfig:
    """Whisper-style audio encoder over log-mel frames; the stride-2 frontend halves the frames."""

    n_mels: int
    frames: int
    hidden: int
    layers: int
    heads: int
    mlp: int | None = None

    def __post_init__(self) -> None:
        for name in ("n_mels", "frames", "hidden", "layers", "heads"):
            _check_int(self, name)
        _default(self, "mlp", 4 * self.hidden)
        _check_int(self, "mlp")
        _check_divisible(self, "hidden", "heads")

    @property
    def positions(self) -> int:
        """Encoder tokens per clip: Conv1d(k=3, stride=2, pad=1) maps T frames to ceil(T / 2)."""
        return (self.frames + 1) // 2


@dataclass(frozen=True, slots=True)
class ProjectorConfig:
    """Encoder-to-LLM projector; `hidden` defaults to the LLM width, `merge` concatenates consecutive tokens."""

    hidden: int | None = None
    merge: int = 1

    def __post_init__(self) -> None:
        if self.hidden is not None:
            _check_int(self, "hidden")
        _check_int(self, "merge")


def llama_mlp_hidden(hidden: int) -> int:
    """SwiGLU width of LLaMA: 2/3 of 4 * hidden rounded up to a multiple of 256 (Touvron et al. 2023, model.py)."""
    return 256 * math.ceil(int(8 * hidden / 3) / 256)


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Text decoder: `type` picks the flavour; cross_attention_every > 0 makes it a Flamingo decoder."""

    type: Literal["llama", "gpt"]
    hidden: int
    layers: int
    heads: int
    vocab: int
    text_seq: int
    kv_heads: int | None = None
    mlp: int | None = None
    cross_attention_every: int = 0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        _check_choice(self, "type", ("llama", "gpt"))
        for name in ("hidden", "layers", "heads", "vocab", "text_seq"):
            _check_int(self, name)
        _default(self, "kv_heads", self.heads)
        _default(self, "mlp", llama_mlp_hidden(self.hidden) if self.type == "llama" else 4 * self.hidden)
        _check_int(self, "kv_heads")
        _check_int(self, "mlp")
        _check_int(self, "cross_attention_every", minimum=0)
        _check_bool(self, "tie_embeddings")
        _check_divisible(self, "hidden", "heads")
        _check_divisible(self, "heads", "kv_heads")
        if self.type == "llama" and (self.hidden // self.heads) % 2:
            raise ValueError(
                f"DecoderConfig: rotary needs an even head dim, got hidden/heads={self.hidden // self.heads}"
            )
        if self.cross_attention_every and self.type != "llama":
            raise ValueError(
                f"DecoderConfig.cross_attention_every={self.cross_attention_every} needs type 'llama', not {self.type}"
            )
        if self.cross_attention_every > self.layers:
            raise ValueError(
                f"DecoderConfig.cross_attention_every={self.cross_attention_every} exceeds layers={self.layers}"
            )

    @property
    def cross_attention_layers(self) -> list[int]:
        """Indices of the layers that hold a gated cross-attention (every k-th, from layer 0)."""
        if not self.cross_attention_every:
            return []
        return list(range(0, self.layers, self.cross_attention_every))


@dataclass(frozen=True, slots=True)
class ClipConfig:
    """CLIP text tower and shared embedding; the image tower is the [vision] config."""

    embed_dim: int
    text_hidden: int
    text_layers: int
    text_heads: int
    vocab: int
    text_seq: int
    text_mlp: int | None = None
    causal: bool = True

    def __post_init__(self) -> None:
        for name in ("embed_dim", "text_hidden", "text_layers", "text_heads", "vocab", "text_seq"):
            _check_int(self, name)
        _default(self, "text_mlp", 4 * self.text_hidden)
        _check_int(self, "text_mlp")
        _check_bool(self, "causal")
        _check_divisible(self, "text_hidden", "text_heads")


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """A whole model: a decoder LM with optional encoders (kind "lm"), or a CLIP two-tower model (kind "clip")."""

    name: str
    decoder: DecoderConfig | None = None
    vision: VisionConfig | None = None
    audio: AudioConfig | None = None
    projector: ProjectorConfig | None = None
    audio_projector: ProjectorConfig | None = None
    clip: ClipConfig | None = None
    dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ArchConfig.name must be a non-empty string, got {self.name!r}")
        _check_choice(self, "dtype", ("fp32", "bf16"))
        if self.clip is not None:
            self._check_clip()
        else:
            self._check_lm()

    def _check_clip(self) -> None:
        if self.vision is None:
            raise ValueError(f"ArchConfig {self.name!r}: a [clip] model needs a [vision] image tower")
        extra = [n for n in ("decoder", "audio", "projector", "audio_projector") if getattr(self, n) is not None]
        if extra:
            raise ValueError(f"ArchConfig {self.name!r}: a [clip] model cannot have {', '.join(extra)}")

    def _check_lm(self) -> None:
        """Validate an LM; a present encoder without its projector table gets the default ProjectorConfig()."""
        if self.decoder is None:
            raise ValueError(f"ArchConfig {self.name!r}: needs a [decoder] (or a [clip] table for a CLIP model)")
        for encoder, projector in (("vision", "projector"), ("audio", "audio_projector")):
            if getattr(self, encoder) is None:
                if getattr(self, projector) is not None:
                    raise ValueError(f"ArchConfig {self.name!r}: [{projector}] given without [{encoder}]")
                continue
            _default(self, projector, ProjectorConfig())
            tokens, merge = self._raw_tokens(encoder), getattr(self, projector).merge
            if tokens % merge:
                raise ValueError(
                    f"ArchConfig {self.name!r}: {encoder} tokens={tokens} not divisible by {projector}.merge={merge}"
                )
        if self.decoder.cross_attention_every and self.vision is None and self.audio is None:
            raise ValueError(f"ArchConfig {self.name!r}: cross_attention_every needs a [vision] or [audio] encoder")

    def _raw_tokens(self, encoder: str) -> int:
        return self.vision.patches if encoder == "vision" else self.audio.positions

    @property
    def kind(self) -> Literal["lm", "clip"]:
        return "clip" if self.clip is not None else "lm"

    @property
    def encoder_tokens(self) -> int:
        """Projected encoder tokens per sample that the LLM sees (prefix tokens, or Flamingo context)."""
        if self.kind == "clip":
            return 0
        total = 0
        if self.vision is not None:
            total += self.vision.patches // self.projector.merge
        if self.audio is not None:
            total += self.audio.positions // self.audio_projector.merge
        return total

    @property
    def seq_len(self) -> int:
        """Sequence length through the decoder (or the CLIP text tower)."""
        if self.kind == "clip":
            return self.clip.text_seq
        if self.decoder.cross_attention_every:
            return self.decoder.text_seq
        return self.encoder_tokens + self.decoder.text_seq
