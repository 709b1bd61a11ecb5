"""Bring your own Hugging Face model: a factory returning a stock transformers model, and a dataset of your own.

    mmplan profile examples.hf_model:factory            # the model; its example inputs come from its config
    mmplan run PLAN --model examples.hf_model:factory --data examples.hf_model:dataset

A factory may return just the model when it is a transformers model (mmplan builds example inputs from its
config); any other nn.Module is returned with a dict of example inputs, as in examples/my_model.py. Either way
model(**batch) returns a scalar loss or an object with `.loss`. Needs transformers (pip install -e ".[hf]").
"""
import torch


def factory():
    """A tiny LLaVA (CLIP vision tower, MLP projector, Llama), random weights; nothing is downloaded."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4, projection_dim=32)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=256)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=63, image_seq_length=16)
    config.mmplan_inputs = {"text_tokens": 8}  # 16 image tokens + 8 text tokens per sample
    return LlavaForConditionalGeneration(config)


class Captions(torch.utils.data.Dataset):
    """A torch Dataset of dicts, one sample each, with the keys and per-sample shapes of the model's inputs:
    an image whose brightness pattern names a class, and a caption of that class's tokens."""

    def __init__(self, seed: int = 0, size: int = 256) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(4, 3, 16, 16, generator=gen)  # one image pattern per class
        self.captions = torch.randint(0, 63, (4, 8), generator=gen)  # one caption per class (63: the image token)
        self.seed, self.size = seed, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + i)
        c = i % 4
        ids = torch.cat([torch.full((16,), 63), self.captions[c]])  # image placeholders, then the caption
        labels = torch.cat([torch.full((16,), -100), self.captions[c]])  # HF shifts labels itself
        pixels = self.patterns[c] + 0.3 * torch.randn(3, 16, 16, generator=gen)
        return {"input_ids": ids, "labels": labels, "pixel_values": pixels}


def dataset(seed: int = 0) -> Captions:
    return Captions(seed)
