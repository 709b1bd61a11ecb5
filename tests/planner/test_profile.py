"""The profiling pass describes the real model: data flow, FLOPs, saved activations, parameters."""
from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from runtime.source import resolve
from planner.profiler.blocks import discover_blocks
from planner.profiler.profile import profile_model
from plans.errors import MmplanError
from plans.graph import from_digraph, profile_from_data, to_digraph
from plans.serial import dumps, to_data
from runtime.models import zoo


@pytest.fixture(scope="module")
def profiles():
    return {name: profile_model(resolve(name), micro_batch=2) for name in ("tiny-avlm", "tiny-flamingo", "tiny-clip", "tiny-vlm")}


def graph_of(profile):
    return to_digraph(profile)


def test_avlm_encoders_reach_llm_and_never_each_other(profiles):
    p = profiles["tiny-avlm"]
    g = graph_of(p)
    group = nx.get_node_attributes(g, "group")
    vision = [n for n in g if group[n] == "vision"]
    audio = [n for n in g if group[n] == "audio"]
    llm = [n for n in g if group[n] == "llm"]
    assert any(nx.has_path(g, v, l) for v in vision for l in llm)
    assert any(nx.has_path(g, a, l) for a in audio for l in llm)
    assert not any(nx.has_path(g, v, a) or nx.has_path(g, a, v) for v in vision for a in audio)
    assert not [e for e in p.edges if {group[e.src], group[e.dst]} == {"vision", "audio"}]


def test_flamingo_vision_feeds_several_decoder_layers(profiles):
    p = profiles["tiny-flamingo"]
    g = graph_of(p)
    vision_side = {n for n, d in g.nodes(data=True) if d["group"] in ("vision", "vision_proj")}
    fed = {e.dst for e in p.edges if e.src in vision_side and g.nodes[e.dst]["group"] == "llm"}
    assert len({n for n in fed if ".layers." in n}) >= 2, fed


def test_clip_towers_meet_only_at_the_head(profiles):
    p = profiles["tiny-clip"]
    g = graph_of(p)
    group = nx.get_node_attributes(g, "group")
    image = {n for n in g if group[n] in ("image_tower", "image_proj")}
    text = {n for n in g if group[n] in ("text_tower", "text_proj")}
    assert image and text
    for e in p.edges:
        assert not ({e.src, e.dst} & image and {e.src, e.dst} & text), e
    head = [n for n in g if group[n] == "head"]
    assert len(head) == 1
    preds = set(g.predecessors(head[0]))
    assert preds & image and preds & text
    assert not any(nx.has_path(g, a, b) for a in image for b in text)


def test_param_totals_equal_the_model(profiles):
    for name, p in profiles.items():
        model, _ = zoo.build(name)
        assert sum(b.params for b in p.blocks) == sum(t.numel() for t in model.parameters()), name


def test_blocks_are_container_elements_and_leaves():
    model, _ = zoo.build("tiny-vlm")
    names = [n for n, _ in discover_blocks(model)]
    assert "llm.layers.0" in names and "llm.embed" in names and "llm.head" in names
    assert "vision_proj" in names and "vision.patch_embed" in names
    assert not any(n.startswith("vision_proj.") for n in names)


LLAMA_TOML = """
name = "flop-check"
dtype = "fp32"
[decoder]
type = "llama"
hidden = 64
layers = 2
heads = 4
kv_heads = 2
mlp = 96
vocab = 100
text_seq = 24
"""


def test_decoder_layer_flops_match_the_analytic_count(tmp_path):
    path = tmp_path / "flop-check.toml"
    path.write_text(LLAMA_TOML)
    p = profile_model(resolve(str(path)), micro_batch=2)
    d, h, kv, f, s = 64, 4, 2, 96, 24
    hd = d // h
    # matmuls cost 2*m*n*k: q and o (d x d), k and v (d x kv*hd), SwiGLU w1, w3 (d x f) and w2 (f x d),
    # attention scores QK^T and the weighted sum AV (each 2*S*S*d over all heads; the causal mask is ignored).
    projections = 2 * s * d * (d + 2 * kv * hd + d)
    attention = 2 * (2 * s * s * d)
    mlp = 3 * 2 * s * d * f
    analytic = projections + attention + mlp
    layer = p.block("llm.layers.1")
    assert layer.fwd_flops == pytest.approx(analytic, rel=0.01)
    # backward: inputs and weights both need gradients, twice the matmul work (Kaplan et al. 2020, C = 6N);
    # flash attention's backward recomputes the scores QK^T: five S x S matmuls instead of four (Dao 2022).
    assert layer.bwd_flops == pytest.approx(2 * (projections + mlp) + 2.5 * attention, rel=0.01)


@pytest.mark.parametrize("name", ["tiny-vlm", "tiny-avlm", "tiny-flamingo", "tiny-clip"])
def test_meta_profile_equals_a_real_cpu_run(name):
    meta = profile_model(resolve(name), micro_batch=2, device="meta")
    torch.manual_seed(0)
    cpu = profile_model(resolve(name), micro_batch=2, device="cpu")
    for a, b in zip(meta.blocks, cpu.blocks, strict=True):
        assert (a.name, a.activation_bytes, a.output_bytes, a.params, a.fwd_flops, a.bwd_flops) == \
               (b.name, b.activation_bytes, b.output_bytes, b.params, b.fwd_flops, b.bwd_flops)
    assert meta.edges == cpu.edges and meta.fingerprint == cpu.fingerprint


def test_saved_activations_match_autograd_on_a_real_run():
    """Sum of per-block activation bytes = bytes of distinct non-parameter storages autograd keeps."""
    torch.manual_seed(0)
    model, batch = zoo.build("tiny-vlm", micro_batch=2)
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    p = profile_model(resolve("tiny-vlm"), micro_batch=2, device="cpu")
    assert sum(b.activation_bytes for b in p.blocks) * 2 == sum(kept.values())


def test_profile_round_trips_through_json_and_networkx(profiles):
    p = profiles["tiny-avlm"]
    text = dumps(p)
    import json

    again = profile_from_data(json.loads(text))
    assert dumps(again) == text
    assert dumps(from_digraph(to_digraph(p))) == text


def test_identical_blocks_share_one_measurement():
    p = profile_model(resolve("tiny-vlm"), micro_batch=1, device="cpu", measure=True, reps=2)
    assert p.measured_on == "cpu"
    layers = [b for b in p.blocks if b.name.startswith("llm.layers.")]
    assert len(layers) >= 2 and len({(b.fwd_ms, b.bwd_ms) for b in layers}) == 1
    assert all(b.fwd_ms is not None and b.fwd_ms > 0 for b in p.blocks)


def test_group_overrides(tmp_path):
    p = profile_model(resolve("tiny-vlm"), groups=[("llm.head", "head"), ("vision_proj", "vision")])
    assert p.block("llm.head").group == "head" and p.block("vision_proj").group == "vision"
    assert "vision_proj" not in p.groups


def test_a_contrastive_head_reduces_the_batch_and_plans_must_give_it_dp1(profiles):
    from planner.solver.construct import GroupLayout, build_plan
    from cost_models.cluster_spec import parse_cluster
    from plans.errors import FormatError
    from plans.plan import Training

    p = profiles["tiny-clip"]
    assert [b.name for b in p.blocks if b.reduces_batch] == ["head"]
    assert not any(b.reduces_batch for b in profiles["tiny-vlm"].blocks)
    layout = GroupLayout("all", tuple(b.name for b in p.blocks), (), dp=2, tp=1, ranks=(0, 1))
    with pytest.raises(FormatError, match="reduces over the batch"):
        build_plan(p, parse_cluster("2xlocal-cpu"), Training(global_batch=8, micro_batches=2, dtype="fp32"), [layout])


def test_fingerprint_describes_the_model_not_the_profiling_run():
    a = profile_model(resolve("tiny-vlm"), micro_batch=1, device="meta", dtype="fp32")
    b = profile_model(resolve("tiny-vlm"), micro_batch=3, device="cpu", dtype="bf16")
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != profile_model(resolve("tiny-avlm")).fingerprint


class _FloatDependent(nn.Module):
    """Selects activations by their values: no static shape exists for it on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        h = self.layers[0](x)
        return self.layers[1](h[(h > -1e9).all(-1)]).sum()  # rows chosen by value (all of them)


def test_a_value_dependent_op_on_meta_is_one_line_naming_where():
    from runtime.source import ModelSource

    source = ModelSource("float-dependent", lambda mb: (_FloatDependent(), {"x": torch.randn(mb, 8, 4)}))
    with pytest.raises(MmplanError, match=r"the glue after block layers\.0 runs aten\.nonzero.*--device cpu"):
        profile_model(source)
    assert profile_model(source, device="cpu").blocks  # on real tensors it profiles
