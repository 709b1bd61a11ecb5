"""profile.json: the module dependency graph of a model (blocks, data-flow edges) and its networkx view."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from plans.errors import FormatError
from plans.limits import MAX_BLOCKS
from plans.serial import OMIT_DEFAULT, dumps, from_data, read_json, to_data, validate, write_atomic

PROFILE_SCHEMA = "mmplan.profile/2"


@dataclass(frozen=True, slots=True)
class Block:
    """The unit of planning: one element of a ModuleList/Sequential, or a container-free leaf module.

    All sizes are per sample (the profile's micro-batch divided out); times are for the whole
    profiled micro-batch, because time is not linear in batch size.
    """

    name: str  # module path, e.g. "llm.layers.3"
    group: str  # module group (modality tower, projector, LLM) that gets its own layout
    kind: str  # the block's class name
    params: int  # parameter count
    param_bytes: int
    fwd_flops: float  # forward FLOPs per sample (torch.utils.flop_counter)
    bwd_flops: float  # backward FLOPs per sample
    activation_bytes: float  # bytes autograd saves for backward, per sample (saved-tensor hooks; Profile.kernels)
    output_bytes: float  # bytes of the block's outputs, per sample
    supports_tp: bool = False  # Megatron-style tensor parallelism applies
    reduces_batch: bool = False  # its output has no batch dimension (e.g. a contrastive loss): needs dp = 1
    signature: str = ""  # equal for blocks of identical structure and input shapes (they share one measurement)
    structure: str = ""  # hash of the class and parameter names and shapes: see block_structure()
    fwd_ms: float | None = None  # measured median forward time at the profile's micro-batch
    bwd_ms: float | None = None  # measured median backward time at the profile's micro-batch
    # measured extra milliseconds per additional sample (from a second measurement at twice the micro-batch):
    # time(b samples) = fwd_ms + fwd_ms_per_sample * (b - micro_batch); small blocks are overhead-bound
    fwd_ms_per_sample: float | None = None
    bwd_ms_per_sample: float | None = None
    # The work by op class, per sample, for timing (cost_models/compute.py); all 0 in profiles made before these
    # fields existed, which are then timed as if every FLOP were a GEMM.
    fwd_matmul_flops: float = 0.0  # of fwd_flops: GEMMs (mm, addmm, bmm, baddbmm, convolution)
    bwd_matmul_flops: float = 0.0
    fwd_attention_flops: float = 0.0  # fused attention kernels (SDPA / flash): FLOPs they execute (causal: half)
    bwd_attention_flops: float = 0.0
    fwd_memory_bytes: float = 0.0  # bytes read + written by every other op (norms, softmax, elementwise, copies)
    bwd_memory_bytes: float = 0.0
    replicated_memory_fraction: float = 0.0  # of the memory-bound work: the share outside the tensor-parallel region
    # (norms, residual adds), which every tp rank repeats unless sequence parallelism shards it (forward's share)
    # the GEMM kernels by shape: (FLOPs, bytes read + written, count) per sample, for the roofline of each kernel
    fwd_gemms: tuple[tuple[float, float, int], ...] = ()
    bwd_gemms: tuple[tuple[float, float, int], ...] = ()
    matmuls: int = 0  # GEMM kernels in one forward (launches; their FLOPs set each GEMM's size)
    # The saved activations by how tensor parallelism stores them (parts of activation_bytes, per sample):
    activation_replicated_bytes: float = 0.0  # saved outside the column->row parallel region (norms, linear inputs,
    # residual-side dropout): every tp rank holds them whole unless sequence parallelism shards them
    attention_core_bytes: float = 0.0  # saved by the attention core (scores, softmax, its dropout, rotary):
    # what selective recompute drops (Korthikanti et al. 2022, section 5)
    # of fwd_gemms: the attention core's own GEMM kernels (QK^T and AV of a math attention; a fused attention kernel is
    # fwd_attention_flops instead), which selective recompute reruns; (FLOPs, bytes, count) per sample
    attention_core_gemms: tuple[tuple[float, float, int], ...] = field(default=(), metadata={OMIT_DEFAULT: True})
    vocab_parallel: str = ""  # "embedding" | "head": a vocabulary-sized embedding / output projection that tensor
    # parallelism shards along the vocabulary (Shoeybi et al. 2019, section 3); "" otherwise
    # not trained: `mmplan profile --freeze` matched it, or it has parameters and none requires grad (no gradients,
    # optimizer state or gradient sync; profiled with its parameters frozen)
    frozen: bool = field(default=False, metadata={OMIT_DEFAULT: True})
    # trained parameter tensors: the optimizer's per-tensor work (cost_models/overhead.py); 0 when not recorded
    param_tensors: int = field(default=0, metadata={OMIT_DEFAULT: True})
    # the sequence length of the block's (batch, sequence, hidden) input, when it has one (0: unknown or none): sequence
    # parallelism over tp ranks needs tp to divide it (written only when known)
    sequence: int = field(default=0, metadata={OMIT_DEFAULT: True})
    # the gcd of the sizes tensor parallelism must divide in the block (heads, kv heads, widths): tp shards it exactly
    # only if tp divides this (runtime/tensor_parallel.tp_divisor); 0: not recorded or no such size (any tp)
    tp_divisor: int = field(default=0, metadata={OMIT_DEFAULT: True})
    # the host's work, per call at any batch size (0: not recorded): aten ops one forward and one backward of the block
    # dispatch, and the distinct activation storages its forward saves (parameters left out: what the runtime's
    # saved-tensor hook accounts and releases); priced by Cluster.forward_op_s / backward_op_s / saved_tensor_s /
    # released_tensor_s (cost_models/overhead.host_time)
    fwd_ops: int = field(default=0, metadata={OMIT_DEFAULT: True})
    bwd_ops: int = field(default=0, metadata={OMIT_DEFAULT: True})
    saved_tensors: int = field(default=0, metadata={OMIT_DEFAULT: True})

    def takes_tp(self, tp: int) -> bool:
        """Whether tensor parallelism of degree tp can run on this block: replicated when it does not support tp,
        sharded exactly when tp divides its heads and widths (tp_divisor; not recorded: assumed)."""
        return tp == 1 or not self.supports_tp or not self.tp_divisor or self.tp_divisor % tp == 0


@dataclass(frozen=True, slots=True)
class Edge:
    """Data flow: outputs of block `src` are inputs of block `dst`; `bytes` per sample."""

    src: str
    dst: str
    bytes: float


@dataclass(frozen=True, slots=True)
class InputEdge:
    """A model input (a key of the example batch) consumed by block `dst`; `bytes` per sample."""

    input: str
    dst: str
    bytes: float


def _omit(default):
    return field(default=default, metadata={OMIT_DEFAULT: True})


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture of one group's transformer, read from the real model by the profiler (what `mmplan export`
    writes as the target's model flags). Every field is optional: 0 / "" means not known (then an export writes a
    placeholder its target refuses); profiles made before these fields existed have none."""

    group: str
    layers: int = _omit(0)  # transformer layers (blocks of a numbered container holding an attention)
    hidden: int = _omit(0)  # model width (the attention's input)
    heads: int = _omit(0)  # query heads
    kv_heads: int = _omit(0)  # key / value heads (= heads without grouped-query attention)
    ffn: int = _omit(0)  # the MLP's inner width (of each of the two input projections of a gated MLP)
    vocab: int = _omit(0)  # rows of the token embedding; 0: the group embeds no tokens
    sequence: int = _omit(0)  # tokens per sample through the layers
    tied: bool = _omit(False)  # the output head shares the token embedding's weight (only with vocab > 0)
    norm: str = _omit("")  # "rmsnorm" | "layernorm"
    mlp: str = _omit("")  # "swiglu" (gated, SiLU) | "gelu" (two linears, GELU)
    position: str = _omit("")  # "rope" | "learned"
    bias: str = _omit("")  # "yes" | "no": whether the layers' linears have biases
    dropout: bool = _omit(False)  # the layers apply dropout (nn.Dropout or a dropout rate > 0): its masks are saved
    rope_base: float = _omit(0.0)  # RoPE's base (theta) with position "rope" and no frequency scaling; 0: not known


@dataclass(frozen=True, slots=True)
class Tie:
    """One parameter held by several blocks (a token embedding tied to the LM head): its name in its owner, the blocks
    holding it (the owner, the first in execution order, first: the owner's `params` count it, the others' do not),
    its elements and bytes. A stage holding some of `blocks` but not the owner holds a copy (cost_models/ties.py)."""

    parameter: str  # "owner block.local name", the name checkpoints and the reference run give it
    blocks: tuple[str, ...]
    params: int
    param_bytes: int


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """How a profile was made: what `mmplan profile` was given beyond the model, dtype and micro-batch."""

    groups: tuple[tuple[str, str], ...] = ()  # --group overrides (pattern, group), in order
    device: str = "meta"
    measure: bool = False
    freeze: tuple[str, ...] = field(default=(), metadata={OMIT_DEFAULT: True})  # --freeze patterns, in order
    threads: int = field(default=0, metadata={OMIT_DEFAULT: True})  # torch threads the measurement ran with (0: not measured)


@dataclass(frozen=True, slots=True)
class Profile:
    """A profiled model: blocks in execution order, edges of its real data flow, and how it was measured."""

    model: str
    fingerprint: str  # structural hash: see fingerprint()
    dtype: str  # dtype of parameters and floating activations while profiling
    micro_batch: int  # batch size the model was profiled at
    blocks: tuple[Block, ...]
    edges: tuple[Edge, ...]
    inputs: tuple[InputEdge, ...] = ()
    measured_on: str | None = None  # device name the fwd/bwd times come from
    attention: str = ""  # the attention kernel whose FLOPs and saved tensors are modelled
    loss: tuple[str, ...] = ()  # blocks whose outputs the loss reads
    options: ProfileOptions = field(default_factory=ProfileOptions)
    schema: str = PROFILE_SCHEMA
    # relative spread (interquartile range / median) of the measured whole-model step at the micro-batch (0: not measured)
    measure_spread: float = field(default=0.0, metadata={OMIT_DEFAULT: True})
    # per group, its transformer's shape as the model defines it (ModelShape); empty in older profiles
    shapes: tuple[ModelShape, ...] = field(default=(), metadata={OMIT_DEFAULT: True})
    # which kernels the layers' saved activations are counted for: "eager" as the saved-tensor hooks measured them;
    # "fused" (TransformerEngine / flash attention) by cost_models/fused.py's per-op count (written only when fused)
    kernels: str = field(default="eager", metadata={OMIT_DEFAULT: True})
    # parameters held by several blocks (Tie); empty when none, or in profiles made before ties were recorded
    ties: tuple[Tie, ...] = field(default=(), metadata={OMIT_DEFAULT: True})

    def shape(self, group: str) -> ModelShape | None:
        return next((s for s in self.shapes if s.group == group), None)

    @classmethod
    def build(cls, model: str, dtype: str, micro_batch: int, blocks: tuple[Block, ...], edges: tuple[Edge, ...],
              inputs: tuple[InputEdge, ...] = (), loss: tuple[str, ...] | None = None, **fields) -> "Profile":
        """A checked profile of hand-made blocks (tests, benchmarks); the loss reads the last block by default."""
        made = cls(model, "", dtype, micro_batch, tuple(blocks), tuple(edges), tuple(inputs),
                   loss=tuple(loss) if loss is not None else (blocks[-1].name,), **fields)
        return check(replace(made, fingerprint=profile_fingerprint(made)))

    @property
    def groups(self) -> tuple[str, ...]:
        """Module groups in order of first appearance."""
        return tuple(dict.fromkeys(b.group for b in self.blocks))

    def block(self, name: str) -> Block:
        return self._by_name()[name]

    def group_blocks(self, group: str) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.group == group)

    def _by_name(self) -> dict[str, Block]:
        return {b.name: b for b in self.blocks}

    def with_groups(self, assign: dict[str, str]) -> "Profile":
        """A copy whose blocks are regrouped by `assign` (block name -> group); groups are not structure,
        so the fingerprint stays."""
        return replace(self, blocks=tuple(replace(b, group=assign.get(b.name, b.group)) for b in self.blocks))


def block_structure(kind: str, params: list[tuple[str, tuple[int, ...]]]) -> str:
    """Hash of a block's class name and its parameters' names and shapes: what the block *is*, whatever
    the dtype, device, batch or inputs it was profiled with. The profiler and `mmplan run` compute it the
    same way from the module (runtime.program.block_structures)."""
    text = "|".join([kind, *(f"{n}:{list(s)}" for n, s in params)])
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def fingerprint(blocks: list[tuple[str, str]], edges: list[tuple[str, str]], loss: list[str]) -> str:
    """Structural fingerprint of a model: its module tree (block name -> block_structure) and its data flow
    between blocks (block -> block edges, the blocks the loss reads). Batch inputs are left out: which
    glue reads an input's shape is not data flow the plan depends on. Independent of dtype,
    device, micro-batch, attention-mask construction, measured times, groups and profiling options, so a
    plan stays valid for any re-profiling of the same model; computed without profiling by `mmplan run`."""
    structure = {
        "blocks": sorted(list(b) for b in blocks),
        "edges": sorted(list(e) for e in set(edges)),
        "loss": sorted(set(loss)),
    }
    return hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:16]


def profile_fingerprint(profile: "Profile") -> str:
    return fingerprint([(b.name, b.structure) for b in profile.blocks], [(e.src, e.dst) for e in profile.edges],
                       list(profile.loss))


def check(profile: Profile, what: str = "profile") -> Profile:
    """Consistency beyond the schema: unique names, measured times in pairs, edges between known blocks, matching
    fingerprint."""
    names = [b.name for b in profile.blocks]
    seen: set[str] = set()
    for n in names:
        if n in seen:
            raise FormatError(f"{what}: block {n!r} appears twice")
        seen.add(n)
    for b in profile.blocks:  # a measurement times both passes (the cost model uses a block's only with both)
        if (b.fwd_ms is None) != (b.bwd_ms is None):
            raise FormatError(f"{what}: block {b.name!r} has a measured {'forward' if b.bwd_ms is None else 'backward'} "
                              f"time but no {'backward' if b.bwd_ms is None else 'forward'} one (fwd_ms and bwd_ms come together)")
    for e in profile.edges:
        for end in (e.src, e.dst):
            if end not in seen:
                raise FormatError(f"{what}: edge {e.src} -> {e.dst} names unknown block {end!r}")
    for i in profile.inputs:
        if i.dst not in seen:
            raise FormatError(f"{what}: input {i.input!r} feeds unknown block {i.dst!r}")
    for b in profile.loss:
        if b not in seen:
            raise FormatError(f"{what}: the loss reads unknown block {b!r}")
    for t in profile.ties:
        unknown = [b for b in t.blocks if b not in seen]
        if unknown or len(t.blocks) < 2:
            raise FormatError(f"{what}: tied parameter {t.parameter!r} names " + (f"unknown block {unknown[0]!r}" if unknown
                              else "one block; a tie has two or more"))
    _check_acyclic([(e.src, e.dst) for e in profile.edges], what)
    expected = profile_fingerprint(profile)
    if profile.fingerprint != expected:
        raise FormatError(f"{what}: fingerprint {profile.fingerprint} does not match its blocks ({expected}); was it edited?")
    return profile


# items of a profile's arrays equal but for their names are validated once (plans/serial.validate)
DISTINCT = {("blocks",): ("name",), ("edges",): ("src", "dst"), ("inputs",): ("input", "dst")}


def _check_acyclic(edges: list[tuple[str, str]], what: str) -> None:
    flow = nx.DiGraph(edges)
    if not nx.is_directed_acyclic_graph(flow):
        cycle = [u for u, _ in nx.find_cycle(flow)]
        loop = " -> ".join(cycle[:6] + (["..."] if len(cycle) > 6 else []) + [cycle[0]])
        raise FormatError(f"{what}: its edges form a cycle ({loop}); data flows from earlier blocks to later ones only")


def profile_from_data(data: Any, what: str = "profile") -> Profile:
    if isinstance(data, dict) and "schema" in data and data["schema"] != PROFILE_SCHEMA:
        raise FormatError(f"{what}: schema {data['schema']!r} is not supported (expected {PROFILE_SCHEMA!r})")
    precheck(data, what)
    validate(data, "profile", what, distinct=DISTINCT)
    return check(from_data(Profile, data), what)


def precheck(data: Any, what: str) -> None:
    """The checks that cost little, before the schema (seconds on a large file): the number of blocks against
    MAX_BLOCKS, and the fingerprint when the fields it is computed from are well-formed (else the schema names
    the problem)."""
    if not isinstance(data, dict) or not isinstance(data.get("blocks"), list):
        return
    blocks = data["blocks"]
    if len(blocks) > MAX_BLOCKS:
        raise FormatError(f"{what} has {len(blocks):,} blocks, more than the {MAX_BLOCKS:,} mmplan plans for; "
                          "is it the right file?")
    edges, loss = data.get("edges"), data.get("loss")
    if not (isinstance(edges, list) and isinstance(loss, list) and isinstance(data.get("fingerprint"), str)):
        return
    if not (all(isinstance(b, dict) and isinstance(b.get("name"), str) and isinstance(b.get("structure", ""), str)
                for b in blocks)
            and all(isinstance(e, dict) and isinstance(e.get("src"), str) and isinstance(e.get("dst"), str) for e in edges)
            and all(isinstance(x, str) for x in loss)):
        return
    expected = fingerprint([(b["name"], b.get("structure", "")) for b in blocks], [(e["src"], e["dst"]) for e in edges], loss)
    if data["fingerprint"] != expected:
        _check_acyclic([(e["src"], e["dst"]) for e in edges], what)  # the more precise refusal of an edited flow
        raise FormatError(f"{what}: fingerprint {data['fingerprint']} does not match its blocks ({expected}); was it edited?")


def load_profile(path: str | os.PathLike) -> Profile:
    return profile_from_data(read_json(path, "profile"), f"profile {path}")


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    write_atomic(path, dumps(profile))


def to_digraph(profile: Profile) -> nx.DiGraph:
    """The networkx view: one node per block (attributes = Block fields), edge attribute `bytes`."""
    g = nx.DiGraph(**{k: v for k, v in to_data(profile).items() if k not in ("blocks", "edges", "inputs")})
    g.graph["inputs"] = [to_data(i) for i in profile.inputs]
    for b in profile.blocks:
        g.add_node(b.name, **to_data(b))
    for e in profile.edges:
        g.add_edge(e.src, e.dst, bytes=e.bytes)
    return g


def from_digraph(g: nx.DiGraph) -> Profile:
    """Inverse of to_digraph (node insertion order is the execution order)."""
    data = {k: v for k, v in g.graph.items()}
    data["blocks"] = [dict(attrs) for _, attrs in g.nodes(data=True)]
    data["edges"] = [{"src": u, "dst": v, "bytes": d["bytes"]} for u, v, d in g.edges(data=True)]
    return profile_from_data(data)
