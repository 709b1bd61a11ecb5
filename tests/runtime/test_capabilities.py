"""The runtime against plans/capabilities.py: it runs exactly what the data says (ZeRO tiers, TP kinds and divisors,
sequence parallelism, tied parameters)."""
from __future__ import annotations

import inspect
import itertools
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import runtime.models.flamingo
import runtime.models.projector
import runtime.models.layers
from plans import capabilities
from plans.errors import MmplanError
from plans.plan import load_plan
from runtime.models.layers import TransformerLayer
from runtime.preflight import check_zero
from runtime.stage import build_rank_model
from runtime.tensor_parallel import REGION_PLANS, check_tp, supports_sequence_parallel, supports_tp, tp_divisor

EXAMPLES = Path(__file__).resolve().parents[2] / "plans" / "examples"
TIERS = ("gpu", "cpu", "nvme")


def test_zero_accepts_exactly_the_listed_tier_combinations():
    plan = load_plan(EXAMPLES / "tiny-vlm-dp2.json")
    accepted = set()
    for tiers in itertools.product(TIERS, repeat=3):
        memory = dict(zip(("params", "grads", "optimizer"), tiers))
        groups = tuple(replace(g, zero=2, stages=tuple(replace(s, memory=replace(s.memory, **memory)) for s in g.stages))
                       for g in plan.groups)
        try:
            check_zero(replace(plan, groups=groups), Path("plan.json"))
            accepted.add(tiers)
        except MmplanError as e:
            assert capabilities.ZERO_TIERS in str(e)
    assert accepted == capabilities.ZERO_TIER_COMBINATIONS


def _zoo_classes() -> list[type[nn.Module]]:
    return [c for m in (runtime.models.layers, runtime.models.flamingo, runtime.models.projector) for _, c in inspect.getmembers(m, inspect.isclass)
            if issubclass(c, nn.Module) and c.__module__ == m.__name__]


def test_tp_block_kinds_and_regions_are_the_listed_ones():
    assert {c.__name__ for c in _zoo_classes() if getattr(c, "supports_tensor_parallel", False)} \
        == set(capabilities.TP_BLOCK_KINDS)
    assert {c.__name__: plan for c, plan in REGION_PLANS.items()} == capabilities.TP_REGIONS
    assert set(capabilities.TP_DIVIDES) == set(capabilities.TP_REGIONS)


@pytest.mark.parametrize(("heads", "kv_heads", "mlp", "kind"),
                         [(4, 2, 64, "swiglu"), (6, 6, 36, "gelu"), (8, 4, 120, "swiglu"), (3, 3, 64, "gelu")])
def test_tp_accepts_exactly_the_degrees_dividing_the_listed_sizes(heads, kv_heads, mlp, kind):
    block = TransformerLayer(8 * heads, heads, mlp, n_kv_heads=kv_heads, mlp=kind)
    sizes = {"heads": heads, "kv_heads": kv_heads, "mlp width": mlp}
    regions = [type(m).__name__ for m in block.modules() if type(m).__name__ in capabilities.TP_REGIONS]
    listed = [sizes[what] for r in regions for what in capabilities.TP_DIVIDES[r]]
    assert supports_tp(block) and tp_divisor(block) == math.gcd(*listed)
    for tp in range(1, 13):
        try:
            check_tp(block, tp)
            ok = True
        except MmplanError:
            ok = False
        assert ok == all(size % tp == 0 for size in listed), tp


def test_sequence_parallelism_takes_exactly_the_listed_kinds():
    from runtime.models.configs import DecoderConfig
    from runtime.models.flamingo import FlamingoLayer

    cfg = DecoderConfig(type="llama", hidden=16, layers=1, heads=2, vocab=16, text_seq=4, cross_attention_every=1)
    from runtime.models.projector import Projector

    blocks = [TransformerLayer(16, 2, 32), FlamingoLayer(cfg, cross_attention=True), Projector(8, 16, hidden=32),
              nn.Linear(2, 2), nn.LayerNorm(2)]
    assert {type(b).__name__ for b in blocks} >= set(capabilities.TP_BLOCK_KINDS)
    for block in blocks:
        assert supports_sequence_parallel(block) == (type(block).__name__ in capabilities.SEQUENCE_PARALLEL_KINDS)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x)).sum()


def test_tied_parameters_across_stages_are_held_as_listed():
    """Across stages: each stage keeps its own whole copy (runtime/ties.py sums their gradients); across groups: refused
    before launch, in the capabilities' words."""
    from runtime.preflight import check_ties

    assert capabilities.TIED_ACROSS_STAGES is True and capabilities.TIED_ACROSS_GROUPS is False
    model = _Tied()
    weight = model.blocks[0].weight.detach().clone()
    rm = build_rank_model(model, {"x": torch.ones(2, 4)}, {"blocks.0"}, torch.device("cpu"))
    assert torch.equal(rm.local["blocks.0"].weight, weight)
    assert model.blocks[1].weight.device.type == "meta" and model.blocks[1].weight is not rm.local["blocks.0"].weight
    build_rank_model(_Tied(), {"x": torch.ones(2, 4)}, {"blocks.0", "blocks.1"}, torch.device("cpu"))
    from runtime.source import call_factory, resolve
    from tests.runtime.plan_builder import make_plan

    one_group = make_plan("tiny-vlm-tied", [{"name": "all", "stages": [(["vision", "vision_proj", "llm.embed"], [0]),
                                                                      (["llm"], [1])]}])
    two_groups = make_plan("tiny-vlm-tied", [{"name": "enc", "stages": [(["vision", "vision_proj", "llm.embed"], [0])]},
                                             {"name": "dec", "stages": [(["llm"], [1])]}])
    module, _ = call_factory(resolve("tiny-vlm-tied"), 1)
    check_ties(one_group, module, Path("plan.json"))
    with pytest.raises(MmplanError, match="share a parameter but are in groups enc, dec"):
        check_ties(two_groups, module, Path("plan.json"))
