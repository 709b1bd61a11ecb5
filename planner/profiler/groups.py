"""Module groups by modality, found from the data flow at any depth of the module tree.

The default groups are the model's top-level children. That is right for models whose towers are top-level
(the zoo), wrong for Hugging Face models, whose towers sit a level down (`model.vision_tower`,
`model.multi_modal_projector`, `model.language_model`) next to a top-level `lm_head`. So:
- the **text side** is every block downstream of a token embedding, itself included: the LLM (or a text tower,
  or an encoder-decoder's decoder). A token embedding is found from the data flow alone: a block that no other
  block feeds (batch inputs do) and whose nn.Embedding looks up one of its own inputs (not a position
  buffer, as a vision tower's patch embedding does). Mllama's aspect-ratio embeddings look up a batch input
  too, but the patch convolution feeds them, so they are part of the vision tower; so is every block a
  modality input reaches before the text does (cross-attention layers read the towers, the towers never read
  the text);
- every other block that runs belongs to a **modality**; its groups are the maximal module subtrees whose
  blocks are all modality blocks (e.g. `model.vision_tower`), and inside them a descendant whose attribute
  name says projector (`multi_modal_projector`, Qwen2-VL's `merger`) is a group of its own;
- a pure subtree of one block not named like a projector joins the modality group that feeds it.
Names come from the attribute names as hints ("vision", "audio", "projector"), else from the batch input feeding
the group (`pixel_values`: vision, Whisper's `input_features`: audio), else the attribute itself;
the text side is "llm" when a modality feeds it, else "text".
Only when some top-level child mixes text and modality blocks is this used; otherwise the top-level
children stand (so models laid out as towers keep their groups).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_HINTS = (
    ("projector", r"project|merger|connector|adapter|resampler|aligner"),
    ("vision", r"vision|visual|image|vit|pixel"),
    ("audio", r"audio|speech|whisper|sound|input_features|mel"),
    ("video", r"video"),
)


def hint_name(attribute: str) -> str:
    """The group name an attribute name suggests ("vision_tower" -> "vision"), else the attribute itself."""
    low = attribute.lower()
    for name, pattern in _HINTS:
        if re.search(pattern, low):
            return name
    return attribute


def top_level(block: str) -> str:
    return block.split(".", 1)[0]


def modality_groups(blocks: list[str], edges: Iterable[tuple[str, str]], input_edges: Iterable[tuple[str, str]],
                    embedders: set[str]) -> dict[str, str] | None:
    """Block -> group (see the module docstring); None when the top-level children already separate modalities.
    `embedders`: the blocks whose nn.Embedding looked up one of their own inputs."""
    edges, input_edges = list(edges), list(input_edges)
    consumers: dict[str, list[str]] = {b: [] for b in blocks}
    producers: dict[str, list[str]] = {b: [] for b in blocks}
    for src, dst in edges:
        if src in consumers and dst in producers and src != dst:
            consumers[src].append(dst)
            producers[dst].append(src)
    fed = {dst: key for key, dst in input_edges}
    text = _downstream({b for b in embedders if b in fed and b in producers and not producers[b]}, consumers)
    modal = [b for b in blocks if b not in text]
    if not text or not modal or not {top_level(b) for b in text} & {top_level(b) for b in modal}:
        return None
    group = _name_modalities(blocks, modal, text, producers, fed)
    llm = "llm" if any(p in group for b in text for p in producers[b]) else "text"
    for b in text:
        group[b] = llm
    return group


def _downstream(roots: set[str], consumers: Mapping[str, list[str]]) -> set[str]:
    out: set[str] = set()
    stack = list(roots)
    while stack:
        b = stack.pop()
        if b not in out:
            out.add(b)
            stack.extend(consumers[b])
    return out


def _name_modalities(blocks, modal, text, producers, fed) -> dict[str, str]:
    """Modality block -> group: its maximal pure subtree (or a projector inside it), named by hint."""
    group: dict[str, str] = {}
    taken: dict[str, str] = {}  # group name -> subtree root, so two roots never share a name by accident
    under: dict[str, list[str]] = {}

    def claim(root: str) -> str:
        name = hint_name(root.rsplit(".", 1)[-1])
        if name[-1].isdigit():  # an element of a container: name it by the container
            name = hint_name(root.rsplit(".", 2)[-2]) if root.count(".") else name
        if hint_name(name) == name and not any(re.search(p, name.lower()) for _, p in _HINTS):
            keys = [fed[b] for b in under[root] if b in fed]  # no hint in the attribute: the input feeding it
            name = next((h for h in map(hint_name, keys) if h != "projector" and h in dict(_HINTS)), name)
        base, k = name, 2
        while taken.get(name, root) != root:
            name, k = f"{base}{k}", k + 1
        taken[name] = root
        return name

    roots = {}
    for b in modal:
        root = _maximal_pure(b, blocks, text)
        roots[b] = _projector_under(b, root) or root
        under.setdefault(roots[b], []).append(b)
    for b in modal:
        group[b] = claim(roots[b])
    single = {g for g in set(group.values()) if list(group.values()).count(g) == 1 and hint_name(taken[g].rsplit(".", 1)[-1]) != "projector"}
    for b in modal:  # a lone unnamed block joins the modality that feeds it
        if group[b] in single:
            fed_by = [group[p] for p in producers[b] if p in group and group[p] != group[b]]
            if fed_by:
                group[b] = fed_by[0]
    return group


def _maximal_pure(block: str, blocks: list[str], text: set[str]) -> str:
    """The highest ancestor path of `block` (itself included) under which no block is on the text side."""
    parts = block.split(".")
    best = block
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        under = [b for b in blocks if b == prefix or b.startswith(prefix + ".")]
        if any(b in text for b in under):
            break
        best = prefix
    return best


def _projector_under(block: str, root: str) -> str | None:
    """The path of the outermost module between `root` (excluded) and `block` named like a projector."""
    parts = block.split(".")
    depth = root.count(".") + 1
    for i in range(depth + 1, len(parts) + 1):
        if hint_name(parts[i - 1]) == "projector":
            return ".".join(parts[:i])
    return None


def contiguous_order(blocks: list[str], group: Mapping[str, str], edges: Iterable[tuple[str, str]]) -> list[str]:
    """The blocks in an order that respects the data flow and keeps each group's blocks together, when one
    exists (else the execution order as it is). Hugging Face LLaVA embeds its tokens before it runs the vision
    tower, so its LLM group is not contiguous in execution order; nothing flows between the two, so the token
    embedding can as well run after the projector, and the LLM group gets one layout of its own."""
    edges = [(s, d) for s, d in edges if s in group and d in group]
    first = {}
    for i, b in enumerate(blocks):
        first.setdefault(group[b], i)
    needs: dict[str, set[str]] = {g: set() for g in first}
    for s, d in edges:
        if group[s] != group[d]:
            needs[group[d]].add(group[s])
    order: list[str] = []
    while len(order) < len(first):
        ready = [g for g in first if g not in order and needs[g] <= set(order)]
        if not ready:
            return list(blocks)  # groups feed each other both ways: no such order
        order.append(min(ready, key=first.__getitem__))
    rank = {g: k for k, g in enumerate(order)}
    out = sorted(blocks, key=lambda b: (rank[group[b]], blocks.index(b)))
    position = {b: i for i, b in enumerate(out)}
    if any(position[s] >= position[d] for s, d in edges):
        return list(blocks)
    return out
