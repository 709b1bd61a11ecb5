"""Tiny stock transformers configs built in code (random weights, nothing downloaded), written as config.json."""
from __future__ import annotations

from pathlib import Path


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, **kw)


def llava(directory: Path) -> Path:
    """LLaVA: a 2-layer CLIP vision tower (16 patches), the MLP projector, a 2-layer Llama."""
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=_llama(), image_token_index=63, image_seq_length=16,
                         architectures=["LlavaForConditionalGeneration"])
    config.mmplan_inputs = {"text_tokens": 8}
    config.save_pretrained(directory)
    return directory


def qwen2_audio(directory: Path) -> Path:
    """Qwen2-Audio: a 2-layer Whisper-style encoder (8 mel bins, 40 frames -> 10 audio tokens), projector, Qwen2."""
    from transformers import Qwen2AudioConfig, Qwen2AudioEncoderConfig, Qwen2Config

    audio = Qwen2AudioEncoderConfig(d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, encoder_layers=2,
                                    num_mel_bins=8, max_source_positions=20)
    text = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=63,
                              architectures=["Qwen2AudioForConditionalGeneration"])
    config.mmplan_inputs = {"text_tokens": 8}
    config.save_pretrained(directory)
    return directory


def qwen2_vl(directory: Path) -> Path:
    """Qwen2-VL: a 2-block vision transformer with its 2x2 patch merger, a 2-layer Qwen2 LLM (M-RoPE)."""
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
        architectures=["Qwen2VLForConditionalGeneration"])
    config.mmplan_inputs = {"text_tokens": 8, "image_size": 16}
    config.save_pretrained(directory)
    return directory


_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
# CLIP's and SigLIP's towers: 2 layers of width 32 each
TWO_TOWERS = {"text": {**_TOWER, "vocab_size": 64, "max_position_embeddings": 16},
              "vision": {**_TOWER, "image_size": 16, "patch_size": 4}}


def clip(directory: Path) -> Path:
    """CLIP: a 2-layer vision tower and a 2-layer text tower, projections and a contrastive loss."""
    from transformers import CLIPConfig

    config = CLIPConfig(
        text_config=TWO_TOWERS["text"], vision_config=TWO_TOWERS["vision"],
        projection_dim=16, architectures=["CLIPModel"])
    config.mmplan_inputs = {"text_tokens": 8}
    config.save_pretrained(directory)
    return directory


def siglip(directory: Path) -> Path:
    """SigLIP: a 2-layer vision tower and a 2-layer text tower, a sigmoid loss with logit_scale and logit_bias."""
    from transformers import SiglipConfig

    config = SiglipConfig(
        text_config=TWO_TOWERS["text"], vision_config=TWO_TOWERS["vision"],
        architectures=["SiglipModel"])
    config.mmplan_inputs = {"text_tokens": 8}
    config.save_pretrained(directory)
    return directory


def _llama_lm(directory: Path, tie: bool) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, tie_word_embeddings=tie,
                         architectures=["LlamaForCausalLM"])
    config.mmplan_inputs = {"text_tokens": 8}
    config.save_pretrained(directory)
    return directory


def llama_tied(directory: Path) -> Path:
    """A 2-layer Llama decoder whose lm_head is its embed_tokens (tie_word_embeddings, as Gemma 3 and PaliGemma)."""
    return _llama_lm(directory, True)


def llama_untied(directory: Path) -> Path:
    """The same decoder with its own lm_head."""
    return _llama_lm(directory, False)
