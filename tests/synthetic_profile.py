"""A profile of any number of blocks, made without profiling: a zoo profile's vision and LLM layers repeated (the
bounds and scaling tests of issue 30: 10,000-block profiles must be refused or solved in bounded time and memory)."""
from __future__ import annotations

from dataclasses import replace

from plans.graph import Edge, Profile, profile_fingerprint


def wide_profile(base: Profile, blocks: int) -> Profile:
    """`base` (tiny-vlm's profile: vision.patch_embed, vision.layers.*, vision.norm, vision_proj, llm.embed,
    llm.layers.*, llm.norm, llm.head) with its layers repeated to `blocks` blocks in all, a quarter of the layers in
    the vision tower; edges chain each tower's layers as the base does, the fingerprint recomputed."""
    by_name = {b.name: b for b in base.blocks}
    fixed = len(base.blocks) - sum(".layers." in b.name for b in base.blocks)
    layers = max(2, blocks - fixed)
    vision_n = max(1, layers // 4)
    llm_n = layers - vision_n
    vision = [replace(by_name["vision.layers.0"], name=f"vision.layers.{i}") for i in range(vision_n)]
    llm = [replace(by_name["llm.layers.0"], name=f"llm.layers.{i}") for i in range(llm_n)]
    out = [by_name["vision.patch_embed"], *vision, by_name["vision.norm"], by_name["vision_proj"], by_name["llm.embed"],
           *llm, by_name["llm.norm"], by_name["llm.head"]]
    edge = {(e.src, e.dst): e.bytes for e in base.edges}
    chain_v = ["vision.patch_embed", *(b.name for b in vision), "vision.norm", "vision_proj"]
    chain_l = ["llm.embed", *(b.name for b in llm), "llm.norm", "llm.head"]
    v_bytes = edge[("vision.layers.0", "vision.layers.1")]
    l_bytes = edge[("llm.layers.0", "llm.layers.1")]
    edges = [Edge(a, b, v_bytes) for a, b in zip(chain_v, chain_v[1:])]
    edges += [Edge(a, b, l_bytes) for a, b in zip(chain_l, chain_l[1:])]
    edges.append(Edge("vision_proj", "llm.layers.0", edge[("vision_proj", "llm.layers.0")]))
    wide = replace(base, model=f"{base.model}-x{len(out)}", blocks=tuple(out), edges=tuple(edges))
    return replace(wide, fingerprint=profile_fingerprint(wide))
