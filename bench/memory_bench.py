"""Per-layer activation bytes: the cost model vs Korthikanti et al. 2022, Table 2 (target within 5 %).

Run: python bench/memory_bench.py

The layer is Megatron's GPT layer (bench/published_models.MegatronLayer: dropout, softmax attention without
flash), profiled by the real profiler (saved-tensor hooks on FakeTensors; planner/profiler/profile.py), then stored as the
cost model says one tp rank stores it (cost_models.memory.kept_activation_bytes; full recompute:
activation_residency's checkpoint). Table 2 of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"), bytes per layer with s = sequence, b = micro-batch, h = hidden, a = heads, t = tp:
    no parallelism        sbh(34 + 5as/h)
    TP                    sbh(10 + 24/t + 5as/(ht))
    TP + SP               sbh(34/t + 5as/(ht))
    TP + selective        sbh(10 + 24/t)
    TP + SP + selective   sbh(34/t)
    full recompute        2sbh
A "runtime measured" column is added by `add_column(name, fn)`: fn(option, layer_shape) -> bytes or None
(the runtime's own measurement, e.g. saved-tensor bytes of one tp rank of the real sharded layer).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_models import gpt_profile  # noqa: E402
import torch  # noqa: E402

from cost_models.memory import activation_residency, block_input_bytes, kept_activation_bytes  # noqa: E402

TOLERANCE = 0.05
SHAPES = ({"name": "GPT-3 175B", "s": 2048, "h": 12288, "a": 96, "t": 8},
          {"name": "GPT 22B", "s": 2048, "h": 6144, "a": 64, "t": 8},
          {"name": "GPT 1T", "s": 2048, "h": 25600, "a": 160, "t": 8})
OPTIONS = ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full recompute")
_COLUMNS: list[tuple[str, Callable[[str, dict], float | None]]] = []


def add_column(name: str, fn: Callable[[str, dict], float | None]) -> None:
    """Another column beside the cost model's: fn(option, shape) -> bytes per layer and micro-batch of 1, or None."""
    _COLUMNS.append((name, fn))


def korthikanti(option: str, s: int, h: int, a: int, t: int, b: int = 1) -> float:
    """Table 2 of Korthikanti et al. 2022, bytes per layer."""
    sbh = s * b * h
    return sbh * {"none": 34 + 5 * a * s / h, "tp": 10 + 24 / t + 5 * a * s / (h * t),
                  "tp+sp": 34 / t + 5 * a * s / (h * t), "tp+selective": 10 + 24 / t, "tp+sp+selective": 34 / t,
                  "full recompute": 2}[option]


def cost_model(option: str, shape: dict) -> float:
    """The cost model's bytes per layer (one tp rank, micro-batch 1) for `option`."""
    profile = gpt_profile(shape["name"], layers=2, dim=shape["h"], heads=shape["a"], seq=shape["s"])
    layer = profile.block("layers.1")
    if option == "full recompute":
        checkpoint = block_input_bytes(profile)[layer.name]
        return activation_residency("recompute", kept_activation_bytes(layer, shape["t"]), checkpoint).gpu
    tp = 1 if option == "none" else shape["t"]
    tier = "selective" if "selective" in option else "keep"
    return kept_activation_bytes(layer, tp, sequence_parallel="sp" in option, tier=tier)


class _RuntimeDecoder(torch.nn.Module):
    """Embedding, two of the runtime's own TransformerLayers (runtime/activation_bytes.LayerShape.build), head, loss."""

    def __init__(self, shape, vocab: int = 512) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, shape.hidden)
        self.layers = torch.nn.ModuleList(shape.build() for _ in range(2))
        self.head = torch.nn.Linear(shape.hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1).float(), labels.flatten())


def runtime_layer_rows(shape, tp: int) -> list[tuple[str, float, float]]:
    """The runtime's own layer (flash attention, no dropout): the cost model's bytes, from the profiler's record
    of that layer, against the runtime's measured saved bytes (runtime/activation_bytes.py), per option:
    (option, cost model bytes, runtime bytes)."""
    from planner.profiler.profile import profile_model
    from runtime.activation_bytes import measure_option
    from runtime.source import ModelSource

    def factory(micro_batch: int):
        ids = torch.zeros(micro_batch, shape.seq, dtype=torch.long)
        return _RuntimeDecoder(shape), {"ids": ids, "labels": ids}

    profile = profile_model(ModelSource("runtime-layer", factory, "bf16"), micro_batch=1)
    layer = profile.block("layers.1")
    checkpoint = block_input_bytes(profile)[layer.name]
    rows = []
    for option, runtime_option in zip(OPTIONS, ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full")):
        if option == "full recompute":
            predicted = activation_residency("recompute", kept_activation_bytes(layer, tp), checkpoint).gpu
        else:
            t = 1 if option == "none" else tp
            predicted = kept_activation_bytes(layer, t, sequence_parallel="sp" in option,
                                              tier="selective" if "selective" in option else "keep")
        rows.append((option, predicted, float(measure_option(shape, runtime_option, tp).bytes)))
    return rows


def main() -> int:
    columns = [("cost model", cost_model), *_COLUMNS]
    print(f"{'layer':12} {'option':18} {'Table 2':>12} " + " ".join(f"{n:>12} {'err':>8}" for n, _ in columns))
    misses = 0
    for shape in SHAPES:
        for option in OPTIONS:
            target = korthikanti(option, shape["s"], shape["h"], shape["a"], shape["t"])
            cells = []
            for i, (_, fn) in enumerate(columns):
                got = fn(option, shape)
                if got is None:
                    cells.append(f"{'-':>12} {'':>8}")
                    continue
                err = got / target - 1
                misses += i == 0 and abs(err) > TOLERANCE
                cells.append(f"{got / 2**20:10.1f}Mi {err:+8.3%}")
            print(f"{shape['name']:12} {option:18} {target / 2**20:10.1f}Mi " + " ".join(cells))
    print(f"{misses} cost-model rows outside +-{TOLERANCE:.0%}")
    # the runtime's own layer: what the cost model predicts it stores, and what the runtime measures it saves
    from runtime.activation_bytes import LayerShape

    shape = LayerShape(hidden=12288, heads=96, seq=2048)
    print("\nthe runtime's GPT-3 175B layer (flash attention, no dropout), t = 8: cost model vs runtime measured "
          "(target: equal)")
    print(f"{'option':18} {'cost model':>12} {'runtime':>12} {'diff':>8}")
    unequal = 0
    for option, predicted, measured in runtime_layer_rows(shape, 8):
        diff = predicted / measured - 1
        unequal += abs(diff) > 0.01
        print(f"{option:18} {predicted / 2**20:10.1f}Mi {measured / 2**20:10.1f}Mi {diff:+8.3%}")
    print(f"{unequal} runtime rows differ from the cost model by more than 1 %")
    return 1 if misses or unequal else 0


if __name__ == "__main__":
    sys.exit(main())
