"""Each group's transformer shape, read from the real modules (plans/graph.py ModelShape): what `mmplan export` writes as
the target's model flags. Read from what every supported model has in common -- a numbered container of layers, each
with an attention holding `head_dim` and its query / key projections, an MLP of Linears, norms; a token embedding --
so zoo models, architecture TOMLs, Hugging Face `hf:` configs and factories alike. What cannot be read stays 0 / ""."""
from __future__ import annotations

import re

from torch import nn

from plans.graph import ModelShape

_LAYER = re.compile(r"\.\d+$")
_QUERY = ("wq", "q_proj", "query", "q")
_KEY = ("wk", "k_proj", "key", "k")
_HEADS = ("num_heads", "num_attention_heads", "n_heads", "heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "kv_heads")


def model_shapes(model: nn.Module, records, groups: dict[str, str], vocab: int | None) -> tuple[ModelShape, ...]:
    """One ModelShape per group holding transformer layers (in the order of the groups' first blocks)."""
    by_group: dict[str, list] = {}
    for rec in records:
        by_group.setdefault(groups[rec.name], []).append(rec)
    out = []
    for group, recs in by_group.items():
        layers = [r for r in recs if _LAYER.search(r.name) and _attention(r.module) is not None]
        if not layers:
            continue
        fields = _layer_shape(layers[0].module)
        fields["layers"] = len(layers)
        fields["sequence"] = max(r.sequence for r in layers)
        fields["position"] = _position(model, recs, layers, vocab)
        if fields["position"] == "rope":
            fields["rope_base"] = _rope_base(model, layers)
        embedding = _token_embedding(recs, vocab)
        if embedding is not None:
            fields["vocab"] = vocab
            fields["tied"] = any(m.weight is embedding.weight for r in recs for m in r.module.modules()
                                 if isinstance(m, nn.Linear))
        out.append(ModelShape(group=group, **{k: v for k, v in fields.items() if v}))
    return tuple(out)


def _attention(layer: nn.Module) -> nn.Module | None:
    """The layer's (first) attention: a module with an integer head_dim and a query projection."""
    for m in layer.modules():
        if isinstance(getattr(m, "head_dim", None), int) and _child(m, _QUERY) is not None:
            return m
    return None


def _child(module: nn.Module, names) -> nn.Linear | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Linear):
            return child
    return None


def _count(module: nn.Module, names) -> int:
    for name in names:
        value = getattr(module, name, None)
        if value is None:
            value = getattr(getattr(module, "config", None), name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def _layer_shape(layer: nn.Module) -> dict:
    attn = _attention(layer)
    q, k = _child(attn, _QUERY), _child(attn, _KEY)
    hd = attn.head_dim
    fields = {"hidden": q.in_features, "heads": q.out_features // hd if hd else _count(attn, _HEADS),
              "kv_heads": k.out_features // hd if k is not None and hd else _count(attn, _KV_HEADS)}
    inside = {id(m) for m in attn.modules()}
    mlp = next((m for m in layer.modules() if id(m) not in inside
                and sum(isinstance(c, nn.Linear) for c in m.children()) >= 2), None)
    if mlp is not None:
        linears = [c for c in mlp.children() if isinstance(c, nn.Linear)]
        inputs = [c for c in linears if c.in_features == fields["hidden"]]
        if inputs:
            fields["ffn"] = inputs[0].out_features
        names = " ".join([type(mlp).__name__] + [type(m).__name__ for m in mlp.modules()]).lower()
        if len(inputs) == 2 and ("silu" in names or "swiglu" in names):
            fields["mlp"] = "swiglu"
        elif len(inputs) == 1 and "gelu" in names:
            fields["mlp"] = "gelu"
    norms = " ".join(type(m).__name__.lower() for m in layer.modules() if "norm" in type(m).__name__.lower())
    fields["norm"] = "rmsnorm" if "rms" in norms else "layernorm" if "layernorm" in norms else ""
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    fields["bias"] = "yes" if any(m.bias is not None for m in linears) else "no"
    fields["dropout"] = _has_dropout(layer)
    return fields


def _has_dropout(layer: nn.Module) -> bool:
    """Whether the layer drops out: an nn.Dropout with p > 0, or a dropout rate > 0 kept as a float attribute (Hugging
    Face attentions keep `attention_dropout` / `dropout` and call the functional form)."""
    for m in layer.modules():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return True
        rates = (getattr(m, name, None) for name in ("attention_dropout", "dropout", "hidden_dropout"))
        if any(isinstance(r, float) and r > 0 for r in rates):
            return True
    return False


def _token_embedding(recs, vocab: int | None) -> nn.Embedding | None:
    if not vocab:
        return None
    return next((m for r in recs if not _LAYER.search(r.name) for m in r.module.modules()
                 if isinstance(m, nn.Embedding) and m.num_embeddings == vocab), None)


def _around(model: nn.Module, layers) -> nn.Module:
    """The module holding the group's numbered container of layers (where Hugging Face models keep the rotary module)."""
    parent = layers[0].name.rsplit(".", 2)[0] if layers[0].name.count(".") >= 2 else ""
    try:
        return model.get_submodule(parent) if parent else model
    except AttributeError:
        return model


def _rope_base(model: nn.Module, layers) -> float:
    """RoPE's base: the zoo attention's `rope_theta`, or the `rope_theta` of a Hugging Face rotary module's config
    (`rope_parameters` in transformers 5, the config attribute before). 0 when it is not seen, or when the rotary
    embedding scales its frequencies (a rope_type other than "default"): then the base alone does not say it."""
    theta = getattr(_attention(layers[0].module), "rope_theta", None)
    if isinstance(theta, (int, float)) and not isinstance(theta, bool):
        return float(theta)
    for m in _around(model, layers).modules():
        config = getattr(m, "config", None) if "rotary" in type(m).__name__.lower() else None
        params = getattr(config, "rope_parameters", None) or {}
        if not isinstance(params, dict):
            continue
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        if params.get("rope_type", "default") == "default" and isinstance(theta, (int, float)) and not isinstance(theta, bool):
            return float(theta)
    return 0.0


def _position(model: nn.Module, recs, layers, vocab: int | None) -> str:
    """"rope" when the attention rotates (the zoo's `rotary` flag, or a rotary-embedding module beside the layers, as
    Hugging Face models hold it), "learned" for a position table in the group's embedding; "" when neither is seen."""
    attn = _attention(layers[0].module)
    if getattr(attn, "rotary", None) is True:
        return "rope"
    around = _around(model, layers)
    if any("rotary" in type(m).__name__.lower() for m in around.modules()):
        return "rope"
    tables = [m for r in recs if not _LAYER.search(r.name) for m in r.module.modules()
              if isinstance(m, nn.Embedding) and m.num_embeddings != vocab]
    named = [n for r in recs if not _LAYER.search(r.name) for n, _ in r.module.named_parameters() if "position" in n]
    return "learned" if tables or named else ""
