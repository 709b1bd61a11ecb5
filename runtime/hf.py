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
from runtime.hf_inputs import cycle, example_inputs  # noqa: F401  (the example batch of a config; re-exported)
from runtime.tensor_parallel import PLAN_ATTR

PREFIX = "hf:"
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


def data_example(spec: str, micro_batch: int, example: dict[str, Any]) -> dict[str, Any]:
    """The example batch the synthetic data derives its samples from (runtime/synthetic.py): for an `hf:` spec whose
    "mmplan_inputs" list several image sizes or counts, the config's batch of `micro_batch` samples, or of the
    lists' whole cycle when longer (its samples take the sizes and counts in turn, in the config's order; built from
    the config alone, no model), floating tensors in `example`'s dtypes; else `example` (of
    the run's traced batch, one sample: one size)."""
    if not is_hf_spec(spec):
        return example
    config = load_config(spec)
    if not any(isinstance(v, (list, tuple)) for v in _sizes_of(config).values()):
        return example
    batch = example_inputs(config, max(micro_batch, cycle(config)), as_listed=True)  # every size, however small
    return {k: v.to(example[k].dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
            and isinstance(example.get(k), torch.Tensor) else v for k, v in batch.items()}


def _sizes_of(config) -> dict:
    return dict(getattr(config, "mmplan_inputs", None) or {})

