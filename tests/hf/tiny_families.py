"""Tiny configs of the families issue 31 names beyond tiny_configs.py (random weights, nothing downloaded), each
written as a config.json: PaliGemma, Gemma 3, Idefics3, LLaVA-NeXT, Mllama, BLIP-2, InternVL, Whisper, Qwen2.5-VL."""
from __future__ import annotations

from pathlib import Path

_TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "pad_token_id": 0}
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "image_size": 16, "patch_size": 4}


def _save(config, directory: Path, architecture: str, text_tokens: int = 8, **sizes) -> Path:
    config.architectures = [architecture]
    config.mmplan_inputs = {"text_tokens": text_tokens, **sizes}
    config.save_pretrained(directory)
    return directory


def paligemma(directory: Path) -> Path:
    from transformers import PaliGemmaConfig

    text = {**_TEXT, "model_type": "gemma", "vocab_size": 64, "head_dim": 16}
    config = PaliGemmaConfig(vision_config={**_VISION, "model_type": "siglip_vision_model", "projection_dim": 32},
                             text_config=text, image_token_index=63, projection_dim=32, hidden_size=32)
    return _save(config, directory, "PaliGemmaForConditionalGeneration")


def gemma3(directory: Path) -> Path:
    from transformers import Gemma3Config

    text = {**_TEXT, "vocab_size": 72, "head_dim": 16, "sliding_window": 8}
    config = Gemma3Config(vision_config={**_VISION, "model_type": "siglip_vision_model"}, text_config=text,
                          mm_tokens_per_image=4, image_token_index=71, boi_token_index=69, eoi_token_index=70)
    return _save(config, directory, "Gemma3ForConditionalGeneration")


def idefics3(directory: Path) -> Path:
    from transformers import Idefics3Config

    config = Idefics3Config(vision_config={**_VISION}, text_config={**_TEXT, "model_type": "llama", "vocab_size": 64},
                            image_token_id=63, scale_factor=2, pad_token_id=0)
    return _save(config, directory, "Idefics3ForConditionalGeneration")


def llava_next(directory: Path) -> Path:
    from transformers import LlavaNextConfig

    config = LlavaNextConfig(vision_config={**_VISION, "model_type": "clip_vision_model", "projection_dim": 32},
                             text_config={**_TEXT, "model_type": "llama", "vocab_size": 64}, image_token_index=63,
                             image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    return _save(config, directory, "LlavaNextForConditionalGeneration")


def mllama(directory: Path) -> Path:
    """Mllama (Llama 3.2 Vision): a 2+1-layer tiled vision encoder, cross-attention into text layer 1 of 3."""
    from transformers import MllamaConfig

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
              "attention_heads": 2, "image_size": 16, "patch_size": 4, "max_num_tiles": 4,
              "intermediate_layers_indices": [0, 1], "vision_output_dim": 96}
    text = {**_TEXT, "num_hidden_layers": 3, "cross_attention_layers": [1], "vocab_size": 64}
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=63)
    return _save(config, directory, "MllamaForConditionalGeneration")


def blip2(directory: Path) -> Path:
    from transformers import Blip2Config

    # dropout off (BLIP-2's Q-Former and OPT default to 0.1): parity with the reference needs the same masks
    qformer = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
               "encoder_hidden_size": 32, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    text = {"model_type": "opt", "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "vocab_size": 64, "word_embed_proj_dim": 32, "max_position_embeddings": 256, "dropout": 0.0,
            "attention_dropout": 0.0}
    config = Blip2Config(vision_config={**_VISION}, qformer_config=qformer, text_config=text, num_query_tokens=4,
                         image_token_index=63)
    return _save(config, directory, "Blip2ForConditionalGeneration")


def internvl(directory: Path) -> Path:
    from transformers import InternVLConfig

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": [16, 16], "patch_size": [4, 4]}
    config = InternVLConfig(vision_config=vision, text_config={**_TEXT, "model_type": "qwen2", "vocab_size": 64},
                            image_token_id=63, image_seq_length=4, downsample_ratio=0.5)
    return _save(config, directory, "InternVLForConditionalGeneration")


def whisper(directory: Path) -> Path:
    """Whisper: a 2-layer encoder over 8 mel bins x 40 frames, a 2-layer decoder cross-attending to it."""
    from transformers import WhisperConfig

    config = WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           max_source_positions=20, max_target_positions=64, vocab_size=64, pad_token_id=0,
                           decoder_start_token_id=1, bos_token_id=1, eos_token_id=2)
    return _save(config, directory, "WhisperForConditionalGeneration")


def qwen2_5_vl(directory: Path) -> Path:
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        text_config={**_TEXT, "vocab_size": 128, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32,
                       "fullatt_block_indexes": [1], "window_size": 16},
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    return _save(config, directory, "Qwen2_5_VLForConditionalGeneration", image_size=16)


FAMILIES = ("paligemma", "gemma3", "idefics3", "llava_next", "mllama", "blip2", "internvl", "whisper", "qwen2_5_vl")
