"""Hugging Face transformers models as they are: `hf:CONFIG` sources, example inputs from a config, training mode.

`hf:PATH` names a local `config.json` (or a directory holding one). The model class is the config's
`architectures[0]` from transformers, built with `from_config` (random weights; nothing is downloaded),
with the training-mode settings applied (`use_cache=False`, train()). Its example batch is derived from
the config: token ids with the right number of image / audio placeholder tokens, pixel values or mel
features of the configured sizes, and labels (the text positions). An optional `"mmplan_inputs"` object
in the config sets the sizes: `{"text_tokens": 32, "image_size": 448}`.
transformers is an optional dependency (`pip install -e ".[hf]"`); it is imported only here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plans.errors import MmplanError
from runtime.blocks import block_modules, is_hf_model  # noqa: F401  (is_hf_model: where callers look for it)
from runtime.model_source import ModelSource
from runtime.tensor_parallel import PLAN_ATTR

PREFIX = "hf:"
TEXT_TOKENS = 32  # text tokens per sample after the modality tokens
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def is_hf_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MmplanError("hf: models need the transformers package: pip install -e \".[hf]\"") from None
    transformers.logging.set_verbosity_error()  # its deprecation notes about published configs are not the user's
    return transformers


def config_path(spec: str) -> Path:
    """The config.json an `hf:` spec names (a file, or a directory holding config.json)."""
    path = Path(spec[len(PREFIX):])
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise MmplanError(f"{spec}: no such config.json (give hf:PATH/config.json or hf:DIRECTORY)")
    return path


def load_config(spec: str):
    """The transformers config of an `hf:` spec; its `architectures` names the model class."""
    transformers = _transformers()
    path = config_path(spec)
    try:
        raw = json.loads(path.read_text())
        if isinstance(raw, dict) and "torch_dtype" in raw:  # the published configs' older spelling
            raw.setdefault("dtype", raw.pop("torch_dtype"))
    except (OSError, ValueError) as e:
        raise MmplanError(f"{path}: not a readable JSON config: {' '.join(str(e).split())[:200]}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise MmplanError(f"{path}: a transformers config needs a \"model_type\"")
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except Exception as e:  # an unknown model_type, a bad field
        raise MmplanError(f"{path}: transformers cannot read this config: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    return config


def model_class(config) -> type:
    transformers = _transformers()
    names = getattr(config, "architectures", None) or []
    if not names:
        raise MmplanError(f"the config of model_type {config.model_type!r} names no \"architectures\" (the model class to build)")
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise MmplanError(f"transformers {transformers.__version__} has no model class {names[0]!r} (from \"architectures\")")
    return cls


def for_training(model: nn.Module) -> nn.Module:
    """HF's inference defaults off: no KV cache (it keeps the graph alive across calls), train mode; and each
    block's tensor-parallel plan from the model's own (see tp_plans)."""
    for config in _configs(getattr(model, "config", None)):
        if hasattr(config, "use_cache"):
            config.use_cache = False
    blocks = block_modules(model)
    for name, plan in tp_plans(model, blocks).items():
        setattr(blocks[name], PLAN_ATTR, plan)
    return model.train()


def tp_plans(model: nn.Module, blocks: dict[str, nn.Module]) -> dict[str, dict[str, dict[str, str]]]:
    """Per block: {region path: {linear attribute: "colwise" | "rowwise"}} from the `base_model_tp_plan` of every
    HF sub-model (patterns like "layers.*.self_attn.q_proj" relative to it; transformers' own TP plan). A region
    (the linears' parent module) with any other style (e.g. "colwise_gather_output", "rowwise_rep") is left whole."""
    linears: dict[str, str] = {}
    for path, module in model.named_modules():
        plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None) or {}
        if not isinstance(plan, dict) or getattr(module, "base_model_prefix", None) is None:
            continue
        prefix = f"{path}." if path else ""
        for pattern, style in plan.items():
            regex = re.compile(re.escape(prefix + pattern).replace(r"\*", r"\d+") + "$")
            for name, m in module.named_modules(prefix=path):
                if isinstance(m, nn.Linear) and regex.match(name):
                    linears[name] = style
    out: dict[str, dict[str, dict[str, str]]] = {}
    bad: set[tuple[str, str]] = set()
    for name, style in linears.items():
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        if block is None:
            continue
        region, _, attr = name[len(block) + 1:].rpartition(".")
        if not region:
            continue
        if style not in ("colwise", "rowwise"):
            bad.add((block, region))
        out.setdefault(block, {}).setdefault(region, {})[attr] = style
    for block, region in bad:
        out[block].pop(region, None)
    return {b: regions for b, regions in out.items() if regions}


def _configs(config) -> list:
    if config is None:
        return []
    out = [config]
    for key in ("text_config", "vision_config", "audio_config"):
        sub = getattr(config, key, None)
        if sub is not None:
            out.append(sub)
    return out


def build(config) -> nn.Module:
    """The model of `config` with random weights, on the current default device (meta under torch.device("meta"))."""
    cls = model_class(config)
    try:
        model = cls._from_config(config)
    except Exception as e:
        raise MmplanError(f"building {cls.__name__} from its config failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    return for_training(model)


def default_dtype(config) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return _DTYPES.get(str(dtype).removeprefix("torch."), "fp32")


def hf_source(spec: str):
    """The ModelSource of an `hf:` spec: the factory builds the model and its example batch from the config."""
    config = load_config(spec)
    model_class(config)  # a missing class is a one-line error now, not in the factory

    def factory(micro_batch: int):
        return build(config), example_inputs(config, micro_batch)

    return ModelSource(spec, factory, default_dtype(config))


# --- example inputs ----------------------------------------------------------------------------------


def _sizes(config) -> dict[str, int]:
    sizes = dict(getattr(config, "mmplan_inputs", None) or {})
    sizes.setdefault("text_tokens", TEXT_TOKENS)
    return sizes


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


def example_inputs(config, micro_batch: int) -> dict[str, Any]:
    """A batch of `micro_batch` samples for the model of `config` (see the module docstring). Always real CPU
    tensors, even under torch.device("meta"): token ids and grids decide shapes (runtime/fake_exec.py)."""
    with torch.device("cpu"):
        return _example_inputs(config, micro_batch)


def _example_inputs(config, micro_batch: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    sizes = _sizes(config)
    t = sizes["text_tokens"]
    kind = config.model_type
    if kind in ("llava", "llava_next", "vipllava"):
        v = config.vision_config
        side = sizes.get("image_size", v.image_size)
        patches = (side // v.patch_size) ** 2 + (1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0)
        token = config.image_token_index
        prefix = torch.full((micro_batch, patches), token)
        batch = _lm_batch(prefix, _text(config, micro_batch, t, {token}, gen))
        batch["pixel_values"] = torch.randn(micro_batch, v.num_channels, side, side, generator=gen)
        return batch
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        v = config.vision_config
        side = sizes.get("image_size", 448)
        merge, patch, temporal = v.spatial_merge_size, v.patch_size, v.temporal_patch_size
        grid = side // patch // merge * merge
        tokens = grid * grid // (merge * merge)
        prefix = torch.cat([torch.full((micro_batch, 1), config.vision_start_token_id),
                            torch.full((micro_batch, tokens), config.image_token_id),
                            torch.full((micro_batch, 1), config.vision_end_token_id)], dim=1)
        avoid = {config.vision_start_token_id, config.image_token_id, config.vision_end_token_id, config.video_token_id}
        batch = _lm_batch(prefix, _text(config, micro_batch, t, avoid, gen))
        in_chans = getattr(v, "in_channels", getattr(v, "in_chans", 3))
        batch["pixel_values"] = torch.randn(micro_batch * grid * grid, in_chans * temporal * patch * patch, generator=gen)
        batch["image_grid_thw"] = torch.tensor([[1, grid, grid]] * micro_batch)
        batch["mm_token_type_ids"] = (batch["input_ids"] == config.image_token_id).int()  # 1: image (for M-RoPE)
        return batch
    if kind == "qwen2_audio":
        a = config.audio_config
        frames = 2 * a.max_source_positions  # the Whisper encoder takes exactly this many mel frames
        tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1  # conv stride 2, then the encoder's 2x average pool
        prefix = torch.full((micro_batch, tokens), config.audio_token_index)
        batch = _lm_batch(prefix, _text(config, micro_batch, t, {config.audio_token_index}, gen))
        batch["input_features"] = torch.randn(micro_batch, a.num_mel_bins, frames, generator=gen)
        batch["feature_attention_mask"] = torch.ones(micro_batch, frames, dtype=torch.long)
        return batch
    if kind in ("clip", "siglip"):  # two towers and a contrastive loss over the batch
        v, text = config.vision_config, config.text_config
        side = sizes.get("image_size", v.image_size)
        ids = torch.randint(text.vocab_size, (micro_batch, min(t, text.max_position_embeddings)), generator=gen)
        pixels = torch.randn(micro_batch, v.num_channels, side, side, generator=gen)
        return {"input_ids": ids, "pixel_values": pixels, "return_loss": True}
    if hasattr(config, "vocab_size") and not hasattr(config, "vision_config"):  # a text-only causal LM
        text = _text(config, micro_batch, t + 1, set(), gen)
        return {"input_ids": text, "labels": text.clone()}
    raise MmplanError(f"mmplan builds example inputs for HF LLaVA, Qwen2-VL, Qwen2-Audio, CLIP/SigLIP and text-only LMs, not model_type "
                      f"{kind!r}: write a factory `package.module:factory` returning (model, batch)")

