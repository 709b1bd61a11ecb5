"""Example batches for stock transformers models, derived from the config alone (runtime/hf.py's `hf:` specs and
factories returning a bare transformers model).

Per family, the inputs its forward takes in training, with the modality placeholders its processor would write:
token ids (placeholders, then `text_tokens` text tokens), labels (the text; -100 on placeholders), and the
modality tensors of the configured sizes. An optional `"mmplan_inputs"` object in the config sets the sizes:
`{"text_tokens": 32, "image_size": 448}` (Qwen2-VL and LLaVA-NeXT also take a list of sizes -- sides or
[height, width] pairs -- that the images take in turn: images of different sizes; Qwen2-VL also
`"images_per_sample"`, a count or a list of counts the samples take in turn, 0 for a sample without an image;
LLaVA-NeXT one count for every sample). A family not listed here is refused in one line naming what to write.
Always real CPU tensors, even under torch.device("meta"): token ids and grids decide shapes (runtime/fake_exec.py).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from plans.errors import MmplanError

TEXT_TOKENS = 32  # text tokens per sample after the modality tokens
Builder = Callable[[Any, int, dict, torch.Generator], dict]


def _sizes(config, as_listed: bool = True) -> dict[str, int]:
    """The config's `mmplan_inputs`; unless `as_listed`, a list of images per sample starts at its first sample with
    an image (see example_inputs)."""
    sizes = dict(getattr(config, "mmplan_inputs", None) or {})
    sizes.setdefault("text_tokens", TEXT_TOKENS)
    counts = _listed(sizes.get("images_per_sample", 1))
    if not any(int(c) for c in counts):
        raise MmplanError(f"\"images_per_sample\" {sizes['images_per_sample']!r}: no sample has an image, so the vision "
                          "tower never runs; give at least one sample an image (or train the text model alone)")
    if not as_listed and isinstance(sizes.get("images_per_sample"), (list, tuple)):
        first = next(i for i, c in enumerate(counts) if int(c))
        sizes["images_per_sample"] = counts[first:] + counts[:first]
    return sizes


def cycle(config) -> int:
    """Samples after which the config's listed sizes and counts recur (the product of the lists' lengths)."""
    out = 1
    for v in _sizes(config).values():
        out *= len(v) if isinstance(v, (list, tuple)) else 1
    return out


def _text(config, micro_batch: int, length: int, avoid: set[int], gen: torch.Generator) -> torch.Tensor:
    vocab = (getattr(config, "text_config", None) or config).vocab_size
    ids = torch.randint(vocab, (micro_batch, length), generator=gen)
    for a in avoid:
        ids[ids == a] = (a + 1) % vocab if (a + 1) % vocab not in avoid else (a + 2) % vocab
    return ids


def _lm_batch(prefix: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
    """input_ids = modality placeholders then text; labels = the text (HF shifts them), -100 on placeholders."""
    ids = torch.cat([prefix, text], dim=1)
    labels = torch.cat([torch.full_like(prefix, -100), text], dim=1)
    return {"input_ids": ids, "labels": labels}


def _image_lm(config, mb: int, sizes: dict, gen: torch.Generator, token: int, count: int,
              extra: set[int] = frozenset()) -> dict:
    """`count` image placeholders (id `token`) then the text."""
    prefix = torch.full((mb, count), token)
    return _lm_batch(prefix, _text(config, mb, sizes["text_tokens"], {token, *extra}, gen))


def _side(config, sizes: dict) -> int:
    """The side of a family's square images: `image_size` (its first entry when a list)."""
    height, width = _hw(_listed(sizes.get("image_size", config.vision_config.image_size))[0])
    if height != width:
        raise MmplanError(f"\"image_size\" [{height}, {width}]: HF model_type {config.model_type!r} takes square "
                          "images here (one side); [height, width] pairs are for Qwen2-VL and LLaVA-NeXT")
    return height


def _pixels(config, mb: int, side: int, gen: torch.Generator, *lead: int) -> torch.Tensor:
    channels = getattr(config.vision_config, "num_channels", 3)
    return torch.randn(mb, *lead, channels, side, side, generator=gen)


def _llava(config, mb, sizes, gen):
    v, side = config.vision_config, _side(config, sizes)
    patches = (side // v.patch_size) ** 2 + (1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0)
    batch = _image_lm(config, mb, sizes, gen, config.image_token_index, patches)
    batch["pixel_values"] = _pixels(config, mb, side, gen)
    return batch


def _llava_next(config, mb, sizes, gen):
    """LLaVA-NeXT's anyres: `images_per_sample` images per sample (the same count k in every sample, 1 by default),
    image j's (height, width) `image_size`'s entry j (cycling; an int is a square; by default the smallest grid
    pinpoint), sample i's images k·i .. k·i + k - 1 (pixel_values and image_sizes have one row per image). Each image is its base tile plus the tiles of its best-fit pinpoint's
    grid (transformers' image_size_to_num_patches), pixel_values padded to the batch's most tiles (the model
    selects each image's by image_sizes); its tokens are the base tile's patches and, per row of the grid's patch
    features unpadded to the image's aspect ratio, its patches and a newline (transformers' pack_image_features)."""
    from transformers.models.llava_next.modeling_llava_next import (get_anyres_image_grid_shape,
                                                                    image_size_to_num_patches, unpad_image)

    v, side = config.vision_config, config.vision_config.image_size
    default = [list(min(config.image_grid_pinpoints, key=lambda hw: (hw[0] * hw[1], hw)))]
    sizes_in_turn = [_hw(s) for s in _listed(sizes.get("image_size", default))]
    per_side = side // v.patch_size
    base = per_side ** 2 + (1 if config.vision_feature_select_strategy == "full" else 0)
    tiles, counts = {}, {}
    for hw in sizes_in_turn:
        tiles[hw] = image_size_to_num_patches(hw, config.image_grid_pinpoints, side)
        rows, cols = get_anyres_image_grid_shape(hw, config.image_grid_pinpoints, side)
        unpadded = unpad_image(torch.empty(0, rows * per_side, cols * per_side), list(hw)).shape[1:]
        counts[hw] = base + unpadded[0] * (unpadded[1] + 1)
    per = _same_count(sizes.get("images_per_sample", 1), config.model_type)
    images = [sizes_in_turn[i % len(sizes_in_turn)] for i in range(mb * per)]  # sample i: images i·per .. i·per+per-1
    text = _text(config, mb, sizes["text_tokens"], {config.image_token_index}, gen)
    filler = _filler(config, config.image_token_index)
    longest = per * max(counts.values())  # every batch as long, and as many tiles, whatever its samples' sizes
    tokens = [sum(counts[hw] for hw in images[i * per:(i + 1) * per]) for i in range(mb)]
    prefix = torch.tensor([[config.image_token_index] * n + [filler] * (longest - n) for n in tokens])
    batch = _lm_batch(prefix, text)
    pixels = _pixels(config, mb * per, side, gen, max(tiles.values()))
    for i, hw in enumerate(images):
        pixels[i, tiles[hw]:] = 0  # padding tiles, as the processor pads them (the model never reads them)
    batch["pixel_values"] = pixels
    batch["image_sizes"] = torch.tensor(images)
    return batch


def _same_count(value, model_type: str) -> int:
    """One number of images for every sample (a family whose images no per-sample metadata assigns to samples:
    that many rows of pixel_values and image_sizes each, runtime/samples.py)."""
    counts = {int(c) for c in _listed(value)}
    if len(counts) != 1 or min(counts) < 1:
        raise MmplanError(f"\"images_per_sample\" {value!r}: HF model_type {model_type!r} takes the same number of "
                          f"images (at least 1) in every sample here (any number, none included, for "
                          f"{', '.join(SEVERAL_IMAGES)}); write a factory returning (model, batch) for other counts")
    return counts.pop()


def _listed(value) -> list:
    """An `mmplan_inputs` size as a list: one value, or a list of them (taken in turn)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _hw(size) -> tuple[int, int]:
    """(height, width) of an image size: a side (a square) or an [h, w] pair."""
    if isinstance(size, (list, tuple)):
        if len(size) != 2:
            raise MmplanError(f"\"image_size\" entry {size!r} must be a side or a [height, width] pair")
        return int(size[0]), int(size[1])
    return int(size), int(size)


def _filler(config, image_token: int) -> int:
    """The token padding a sample with fewer image tokens to the batch's longest (labels -100 there): the text
    config's pad token, else a token next to the image token."""
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    return pad if pad is not None and pad != image_token else (image_token + 1) % config.get_text_config().vocab_size


def _paligemma(config, mb, sizes, gen):
    side = _side(config, sizes)
    batch = _image_lm(config, mb, sizes, gen, config.image_token_index, (side // config.vision_config.patch_size) ** 2)
    batch["pixel_values"] = _pixels(config, mb, side, gen)
    return batch


def _gemma3(config, mb, sizes, gen):
    """Gemma 3: begin-of-image, `mm_tokens_per_image` image tokens, end-of-image; token_type_ids 1 on the image."""
    image, boi, eoi = config.image_token_index, config.boi_token_index, config.eoi_token_index
    prefix = torch.cat([torch.full((mb, 1), boi), torch.full((mb, config.mm_tokens_per_image), image),
                        torch.full((mb, 1), eoi)], dim=1)
    batch = _lm_batch(prefix, _text(config, mb, sizes["text_tokens"], {image, boi, eoi}, gen))
    batch["pixel_values"] = _pixels(config, mb, config.vision_config.image_size, gen)
    batch["token_type_ids"] = (batch["input_ids"] == image).long()
    return batch


def _idefics3(config, mb, sizes, gen):
    """Idefics3 / SmolVLM: one image per sample; (side / patch)^2 / scale_factor^2 tokens after the pixel shuffle."""
    side = _side(config, sizes)
    count = (side // config.vision_config.patch_size) ** 2 // config.scale_factor ** 2
    batch = _image_lm(config, mb, sizes, gen, config.image_token_id, count)
    batch["pixel_values"] = _pixels(config, mb, side, gen, 1)
    return batch


def _internvl(config, mb, sizes, gen):
    v = config.vision_config
    side = _side(config, sizes)
    patch = v.patch_size[0] if isinstance(v.patch_size, (list, tuple)) else v.patch_size
    count = int((side // patch) ** 2 * config.downsample_ratio ** 2)
    batch = _image_lm(config, mb, sizes, gen, config.image_token_id, count)
    batch["pixel_values"] = _pixels(config, mb, side, gen)
    return batch


def _blip2(config, mb, sizes, gen):
    if config.image_token_index is None:
        raise MmplanError("this BLIP-2 config has no \"image_token_index\" (the placeholder its Q-Former outputs replace): "
                          "set it, or write a factory `package.module:factory` returning (model, batch)")
    batch = _image_lm(config, mb, sizes, gen, config.image_token_index, config.num_query_tokens)
    batch["pixel_values"] = _pixels(config, mb, _side(config, sizes), gen)
    return batch


def _mllama(config, mb, sizes, gen):
    """Mllama: one image of every tile (the aspect ratio using all `max_num_tiles`), one <|image|> token; the text
    cross-attends to all tiles."""
    v = config.vision_config
    tiles = v.max_num_tiles
    ratio = next(i for i, (h, w) in enumerate(v.supported_aspect_ratios, start=1) if h * w == tiles)
    batch = _image_lm(config, mb, sizes, gen, config.image_token_index, 1)
    batch["pixel_values"] = _pixels(config, mb, v.image_size, gen, 1, tiles)
    batch["aspect_ratio_ids"] = torch.full((mb, 1), ratio)
    batch["aspect_ratio_mask"] = torch.ones(mb, 1, tiles, dtype=torch.long)
    batch["cross_attention_mask"] = torch.ones(mb, batch["input_ids"].shape[1], 1, tiles, dtype=torch.long)
    return batch


def _qwen2_vl(config, mb, sizes, gen):
    """Qwen2-VL / Qwen2.5-VL: `images_per_sample` images per sample (1 by default; a list [1, 2, ...]: sample i
    has entry i, cycling), packed (all images' patches x patch dim, one grid row each). `"image_size": [a, b, ...]`
    gives the images' sizes a, b, ... in turn (a side or an [h, w] pair; images of different sizes); every sample
    is then as long (fewer image tokens: that many more filler tokens, labels -100) with `text_tokens` labelled
    tokens, so each sample weighs the same in the loss. mm_token_type_ids marks each image's tokens (a run of 1s
    per image: which grid rows are whose, runtime/samples.py)."""
    v = config.vision_config
    merge, patch, temporal = v.spatial_merge_size, v.patch_size, v.temporal_patch_size
    sides = [_hw(s) for s in _listed(sizes.get("image_size", 448))]
    counts = [int(c) for c in _listed(sizes.get("images_per_sample", 1))]
    cycle = max(mb, len(counts) * len(sides))  # samples in which every sample's images recur (for the longest)
    per_sample = [counts[i % len(counts)] for i in range(cycle)]
    starts = [sum(per_sample[:i]) for i in range(cycle)]
    grids = [[tuple(x // patch // merge * merge for x in sides[(starts[i] + j) % len(sides)]) for j in range(c)]
             for i, c in enumerate(per_sample)]
    pad = getattr(config.get_text_config(), "pad_token_id", None)
    filler = pad if pad is not None else config.vision_end_token_id
    rows = [[t for h, w in sample for t in (config.vision_start_token_id, *[config.image_token_id] * (h * w // merge ** 2),
                                            config.vision_end_token_id)] for sample in grids]
    longest = max(map(len, rows))  # every batch as long, whatever its samples' images
    grids, rows = grids[:mb], rows[:mb]
    prefix = torch.tensor([r + [filler] * (longest - len(r)) for r in rows])
    avoid = {config.vision_start_token_id, config.image_token_id, config.vision_end_token_id, config.video_token_id, filler}
    batch = _lm_batch(prefix, _text(config, mb, sizes["text_tokens"], avoid, gen))
    in_chans = getattr(v, "in_channels", getattr(v, "in_chans", 3))
    batch["pixel_values"] = torch.randn(sum(h * w for s in grids for h, w in s), in_chans * temporal * patch * patch,
                                        generator=gen)
    batch["image_grid_thw"] = torch.tensor([[1, h, w] for s in grids for h, w in s]).reshape(-1, 3)
    batch["mm_token_type_ids"] = (batch["input_ids"] == config.image_token_id).int()  # 1: image (for M-RoPE)
    return batch


def _qwen2_audio(config, mb, sizes, gen):
    a = config.audio_config
    frames = 2 * a.max_source_positions  # the Whisper encoder takes exactly this many mel frames
    tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1  # conv stride 2, then the encoder's 2x average pool
    batch = _image_lm(config, mb, sizes, gen, config.audio_token_index, tokens)
    batch["input_features"] = torch.randn(mb, a.num_mel_bins, frames, generator=gen)
    batch["feature_attention_mask"] = torch.ones(mb, frames, dtype=torch.long)
    return batch


def _whisper(config, mb, sizes, gen):
    """Whisper (encoder-decoder): mel features of the encoder's 2 x max_source_positions frames; the transcript as
    labels (the model shifts them into the decoder's input ids)."""
    frames = 2 * config.max_source_positions
    length = min(sizes["text_tokens"], config.max_target_positions)
    labels = _text(config, mb, length, {config.decoder_start_token_id}, gen)
    return {"input_features": torch.randn(mb, config.num_mel_bins, frames, generator=gen), "labels": labels}


def _two_towers(config, mb, sizes, gen):  # CLIP / SigLIP: two towers and a contrastive loss over the batch
    v, text = config.vision_config, config.text_config
    ids = torch.randint(text.vocab_size, (mb, min(sizes["text_tokens"], text.max_position_embeddings)), generator=gen)
    return {"input_ids": ids, "pixel_values": _pixels(config, mb, _side(config, sizes), gen), "return_loss": True}


FAMILIES: dict[str, Builder] = {
    "llava": _llava, "vipllava": _llava, "llava_next": _llava_next, "paligemma": _paligemma, "gemma3": _gemma3,
    "idefics3": _idefics3, "smolvlm": _idefics3, "internvl": _internvl, "blip-2": _blip2, "mllama": _mllama,
    "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_vl, "qwen2_audio": _qwen2_audio, "whisper": _whisper,
    "clip": _two_towers, "siglip": _two_towers,
}


SEVERAL_IMAGES = ("qwen2_vl", "qwen2_5_vl")  # the families whose builder takes any images_per_sample
SAME_COUNT = ("llava_next",)  # the families whose builder takes one images_per_sample for every sample


def example_inputs(config, micro_batch: int, *, as_listed: bool = False) -> dict[str, Any]:
    """A batch of `micro_batch` samples for the model of `config` (see the module docstring). By default the example
    a model is traced and profiled by: a list of images per sample then starts at its first sample with an image, as
    a trace sees only the blocks its samples run (Qwen2-VL's vision tower runs on no image-less sample);
    `as_listed`: the samples in the config's order (runtime/hf.data_example: the data)."""
    with torch.device("cpu"):
        gen = torch.Generator().manual_seed(0)
        builder = FAMILIES.get(config.model_type)
        counts = _listed(_sizes(config).get("images_per_sample", 1))
        if config.model_type not in (*SEVERAL_IMAGES, *SAME_COUNT) and any(int(c) != 1 for c in counts):
            raise MmplanError(f"\"images_per_sample\" {counts!r}: mmplan builds one image per sample for HF model_type "
                              f"{config.model_type!r} (any number for {', '.join(SEVERAL_IMAGES)}; the same number in "
                              f"every sample for {', '.join(SAME_COUNT)}); write a factory `package.module:factory` "
                              "returning (model, batch) for other counts")
        if builder is not None:
            return builder(config, micro_batch, _sizes(config, as_listed), gen)
        if _text_only(config):
            text = _text(config, micro_batch, _sizes(config)["text_tokens"] + 1, set(), gen)
            return {"input_ids": text, "labels": text.clone()}
    raise MmplanError(f"mmplan builds no example inputs for HF model_type {config.model_type!r} (it does for "
                      f"{', '.join(sorted(FAMILIES))} and decoder-only LMs): write a factory `package.module:factory` "
                      "returning (model, batch) with the inputs its forward takes (examples/my_model.py)")


def _text_only(config) -> bool:
    """A decoder-only LM: a vocabulary, no sub-config of another modality, not an encoder-decoder."""
    subs = [k for k, v in vars(config).items() if k.endswith("_config") and k != "text_config" and v is not None]
    return hasattr(config, "vocab_size") and not subs and not getattr(config, "is_encoder_decoder", False)
