"""Model zoo: composable torch modules for multimodal LMs and a uniform build(name) entry point."""

from .arch_toml import load_arch_toml, parse_arch
from .audio import AudioEncoder, AudioFrontend
from .build import build_decoder, build_model, example_batch
from .clip import ClipModel, ContrastiveHead, TextEncoder
from .configs import ArchConfig, AudioConfig, ClipConfig, DecoderConfig, ProjectorConfig, VisionConfig
from .flamingo import FlamingoDecoder, FlamingoLayer, GatedCrossAttention
from .gpt import GPTDecoder, TokenPositionEmbedding
from .layers import Attention, CrossAttention, GeluMLP, RMSNorm, SwiGLU, TransformerLayer
from .llama import LlamaDecoder
from .multimodal import MultimodalLM
from .projector import Projector
from .vit import PatchEmbed, VisionEncoder
from .zoo import ZOO, build, default_dtype, names, resolve

__all__ = [
    "ZOO",
    "ArchConfig",
    "Attention",
    "AudioConfig",
    "AudioEncoder",
    "AudioFrontend",
    "ClipConfig",
    "ClipModel",
    "ContrastiveHead",
    "CrossAttention",
    "DecoderConfig",
    "FlamingoDecoder",
    "FlamingoLayer",
    "GPTDecoder",
    "GatedCrossAttention",
    "GeluMLP",
    "LlamaDecoder",
    "MultimodalLM",
    "PatchEmbed",
    "Projector",
    "ProjectorConfig",
    "RMSNorm",
    "SwiGLU",
    "TextEncoder",
    "TokenPositionEmbedding",
    "TransformerLayer",
    "VisionConfig",
    "VisionEncoder",
    "build",
    "build_decoder",
    "build_model",
    "default_dtype",
    "example_batch",
    "load_arch_toml",
    "names",
    "parse_arch",
    "resolve",
]
