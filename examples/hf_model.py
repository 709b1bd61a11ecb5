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


def llava_with_batch(micro_batch: int = 1):
    """The same LLaVA returned with its own example batch, `(model, batch)`, as for any model: 16 image
    placeholders (id 63) then 8 caption tokens, the labels (-100 on the placeholders) and the pixels."""
    model = factory()
    ids = torch.cat([torch.full((micro_batch, 16), 63), torch.randint(0, 63, (micro_batch, 8))], dim=1)
    labels = torch.cat([torch.full((micro_batch, 16), -100), ids[:, 16:]], dim=1)
    return model, {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(micro_batch, 3, 16, 16)}


def qwen2_vl_with_batch(micro_batch: int = 1):
    """A tiny Qwen2-VL with its own batch: per sample one 16x16 image (a 4x4 grid of 4x4 patches, merged 2x2 into
    4 image tokens between vision start/end), 8 caption tokens; the patches of all images packed in dim 0."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    model = Qwen2VLForConditionalGeneration(config)
    image = torch.tensor([122, 120, 120, 120, 120, 123])
    ids = torch.cat([image.expand(micro_batch, -1), torch.randint(0, 120, (micro_batch, 8))], dim=1)
    labels = torch.cat([torch.full((micro_batch, 6), -100), ids[:, 6:]], dim=1)
    return model, {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(micro_batch * 16, 3 * 2 * 4 * 4),
                   "image_grid_thw": torch.tensor([[1, 4, 4]] * micro_batch), "mm_token_type_ids": (ids == 120).int()}
