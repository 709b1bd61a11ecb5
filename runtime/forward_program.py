"""The model's own forward as a stage's program: other stages' blocks stand in as proxies (no fx tracing).

Why: torch.fx cannot trace stock Hugging Face models with blocks as leaves (HF v5 gathers `hidden_states`
with forward hooks that never fire on fx leaves; its glue branches on tensor values), and rewriting their
forward by hand is what a user should not have to do. torch.export was the other candidate; it needs the
whole model exportable (data-dependent glue, hooks) and re-exports per shape, so it fails on the same
models. Here every stage simply runs the model's forward: each block's `forward` is replaced, on this
instance only, by a dispatcher —
- a block of this stage runs for real (through the stage's memory tiers; the module's hooks fire once),
- a block whose output this stage receives returns the received value (a leaf that takes gradients),
- any other block returns zeros of its output's shape (nothing this stage computes reads them: the data flow
  was recorded, and the plan's routes are checked against it),
and once this stage's blocks have all run, a stage that does not compute the loss stops the forward there.
The glue between blocks (masks, rotary tables, merging image features into the text) is recomputed on
every stage from the batch, which each stage therefore holds whole (its few integer and pixel tensors).
The data flow (which block outputs and batch inputs each block reads, what the loss reads) and every
block's output shape come from one forward on fake tensors with integer inputs real (runtime/fake_exec.py).
Cost: every stage recomputes the forward's glue up to its last block (not measured separately yet).
"""
from __future__ import annotations

import contextlib
from fractions import Fraction
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from plans.errors import MmplanError
from runtime.output_spec import OutputSpec
from runtime.fake_exec import fake_batch, fakify_module, static_fake
from runtime.sample_probe import PROBE, SampleProbe, probe_key, shape_key
from runtime.samples import batch_samples, check_traceable, grid_rows, model_inputs, sample_rows, split_samples
from runtime.vocab_parallel import HeadPaths
from runtime.source import model_loss

LOSS = "(loss)"  # the node name of the forward's loss
PARAM = "param:"  # provenance of a parameter outside every block
BATCH = "batch:"  # provenance of a batch input (what tells a block's output batch-dependent from a fixed one)


class _Stop(Exception):
    """Raised by a proxy once the stage has computed everything it needs."""


class _Flow(TorchFunctionMode):
    """Outside blocks, every op's tensor outputs derive from the union of its tensor inputs' sources."""

    def __init__(self, prov: dict[int, frozenset], alive: list, inside: list):
        super().__init__()
        self.prov, self.alive, self.inside = prov, alive, inside

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside:
            src = _sources(self.prov, (args, kwargs))
            if src:
                for leaf in tree_flatten(out)[0]:
                    if isinstance(leaf, torch.Tensor):
                        self.prov[id(leaf)] = self.prov.get(id(leaf), frozenset()) | src
                        self.alive.append(leaf)
        return out


def _sources(prov: dict[int, frozenset], tree: Any) -> frozenset:
    out: frozenset = frozenset()
    for x in tree_flatten(tree)[0]:
        if isinstance(x, torch.Tensor):
            out |= prov.get(id(x), frozenset())
    return out


class ForwardProgram:
    """The Program interface of runtime/program.py for a model run by its own forward (see the module docstring)."""

    def __init__(self, model: nn.Module, batch: dict[str, Any], blocks: dict[str, nn.Module]):
        check_traceable(batch, f"tracing {type(model).__name__}")
        self.modules = blocks
        self.inputs = tuple(k for k, v in batch.items() if isinstance(v, torch.Tensor))
        self.constants = {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)}  # e.g. return_loss=True
        order, reads, loss, specs, heads = _record(model, batch, blocks)
        # nn.Linear blocks read only by F.cross_entropy through shape-only glue: LM heads that tensor parallelism
        # may shard over the vocabulary (runtime/vocab_parallel.shard_head fills vocab_loss)
        self.vocab_heads = heads & loss
        self.vocab_loss: dict[str, Any] = {}  # head -> (its vocabulary-parallel cross-entropy, full vocab, tp)
        self.blocks: dict[str, str] = {b: b for b in order}  # block name -> its node (the name itself)
        self._reads = {b: {s for s in r if not s.startswith((PARAM, BATCH))} for b, r in reads.items()}
        self._loss = {s for s in loss if not s.startswith((PARAM, BATCH))}
        # parameters outside every block (CLIP's logit_scale): consumers from the data flow, owner block
        consumers: dict[str, set[str]] = defaultdict(set)
        for node, srcs in [*reads.items(), (LOSS, loss)]:
            for s in srcs:
                if s.startswith(PARAM):
                    consumers[s[len(PARAM):]].add(node)
        self.free_consumers = dict(consumers)
        self.free_owner = {p: self._owner(c) for p, c in consumers.items()}
        self.output = LOSS
        n = batch_samples(batch)  # a leaf of k·n rows is packed, k rows per sample (runtime/samples.py)
        batched: set[str] = set()  # blocks whose output depends on the batch: they read it, or a block that does
        for b in order:
            if any(s.startswith(BATCH) or s in batched for s in reads[b]):
                batched.add(b)
        inputs = sample_rows(batch)
        gridded = {k: r for k, r in inputs.items() if k in grid_rows(batch)}
        self.specs = {}
        for b, (tree, leaves) in specs.items():
            rules = [_rows(b, i, s[0], n, gridded) if b in batched else (s[0], None) for i, (s, _) in enumerate(leaves)]
            self.specs[b] = OutputSpec(tree, tuple((s[1:], dtype) for s, dtype in leaves), tuple(r for r, _ in rules),
                                       fixed=b not in batched,
                                       scaled=tuple(rule for _, rule in rules) if any(rule for _, rule in rules) else ())
        self.probe = _probe(model, batch, self.specs, self.constants)

    def _owner(self, consumers: set[str]) -> str:
        """The block a free parameter joins: its consumer latest in execution order (the loss: the block the
        loss stage is placed by, runtime/layout.py)."""
        def last(names):
            return max(names, key=list(self.blocks).index)

        blocks = {c for c in consumers if c != LOSS}
        if LOSS in consumers:
            blocks |= {last(self._loss)} if self._loss else set()
        if not blocks:
            raise MmplanError(f"parameter(s) outside every block feed only the loss, which reads no block")
        return last(blocks)

    def deps(self, node: str) -> tuple[set[str], set[str]]:
        """Blocks whose outputs `node` reads; batch inputs: all of them (every stage runs the forward's glue)."""
        blocks = self._loss if node == LOSS else self._reads[node]
        return set(blocks), set(self.inputs)

    def loss_deps(self) -> set[str]:
        return set(self._loss)

    def edges(self) -> list[tuple[str, str]]:
        return [(src, b) for b in self.blocks for src in sorted(self._reads[b])]

    def input_edges(self) -> list[tuple[str, str]]:
        return [(k, b) for b in self.blocks for k in self.inputs]

    def run_stage(self, model: nn.Module, names: tuple[str, ...], batch: dict[str, Any], received: dict[str, Any],
                  mine, want_loss: bool) -> tuple[dict[str, Any], torch.Tensor | None]:
        """One forward of a stage: (outputs of its blocks, the loss when `want_loss`)."""
        samples = batch_samples(batch)
        rows = self.batch_rows(batch) if any(spec.scaled for spec in self.specs.values()) else {}
        device = next(v.device for v in batch.values() if isinstance(v, torch.Tensor))
        outputs: dict[str, Any] = {}
        todo = set(names)
        _refuse_sharded_idle([b for b in names if self.no_rows(b, samples, rows)], self.modules)

        def proxy(name: str, module: nn.Module):
            def forward(*args, **kwargs):
                if name in todo:
                    out = mine[name](*args, **kwargs)
                    outputs[name] = out
                    todo.discard(name)
                    return out
                if not todo and not want_loss:
                    raise _Stop
                if name in received:
                    return received[name]
                return self.zeros(name, samples, device, rows)

            return forward

        vocab = _VocabLoss(self.vocab_loss, outputs) if want_loss and self.vocab_loss else contextlib.nullcontext()
        with _patched(self.modules, proxy):
            try:
                with vocab:
                    out = model(**{**self.constants, **model_inputs(batch)})
            except _Stop:
                out = None
        for name in [b for b in todo if self.no_rows(b, samples, rows)]:  # no image in this batch: ran on nothing
            outputs[name] = self.zeros(name, samples, device, rows)
            todo.discard(name)
        if out is None:
            return outputs, None
        if todo:
            raise MmplanError(f"block(s) {', '.join(sorted(todo)[:3])} did not run in the model's forward on this batch")
        return outputs, (model_loss(out) if want_loss else None)

    def no_rows(self, name: str, samples: int, rows: dict) -> bool:
        """Whether block `name`'s output has no rows for this batch (its samples have none of its images)."""
        spec = self.specs[name]
        return not spec.fixed and bool(spec.leaves) and all(
            sum(spec.sample_rows(i, rows, samples)) == 0 for i in range(len(spec.leaves)))

    def batch_rows(self, batch: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Per key, the rows of each of the batch's samples: its inputs' (samples.sample_rows) and the probed block
        output leaves' (runtime/sample_probe.py), which OutputSpec.scaled names."""
        rows = sample_rows(batch)
        return {**rows, **self.probe.rows(batch)} if self.probe is not None else rows

    def zeros(self, name: str, samples: int, device: torch.device, rows: dict | None = None) -> Any:
        """Zeros of block `name`'s output for `samples` samples (`rows`: the batch's per-sample input rows, which
        a leaf of images of different sizes needs: samples.sample_rows)."""
        spec = self.specs[name]
        samples = 1 if spec.fixed else samples  # a batch-independent output keeps its whole shape
        leaves = [torch.zeros((sum(spec.sample_rows(i, rows or {}, samples)), *shape), dtype=dtype, device=device)
                  for i, (shape, dtype) in enumerate(spec.leaves)]
        return tree_unflatten(leaves, spec.tree)


def _refuse_sharded_idle(idle: list[str], modules: dict[str, nn.Module]) -> None:
    """A block with no rows in this batch does not run here (run_stage); one sharded by ZeRO (FSDP2) would then
    skip the all-gathers and reduce-scatters its data-parallel peers run for it, so refuse before any of them."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [b for b in idle if isinstance(modules[b], FSDPModule)]
    if sharded:
        raise MmplanError(f"this rank's share of a micro-batch has no image, so block(s) {', '.join(sharded[:2])} run on "
                          "nothing here, and under ZeRO (FSDP2) they would skip the collectives their data-parallel peers "
                          "run: use zero 0 for their group, or data in which every share of a micro-batch has an image")


def _rows(block: str, leaf: int, rows: int, samples: int, inputs: dict[str, tuple[int, ...]]) -> tuple[int, tuple | None]:
    """(rows of the first sample, None or (key, num, den)) of a block output leaf of `rows` rows: one per sample
    (batch-major); else num/den of a packed input's rows per sample (`inputs`: those an image grid gives, whose
    samples differ first; Qwen2-VL's patches: its vision blocks keep or merge them), when that is whole for every
    sample; else what a forward of each sample alone outputs (runtime/sample_probe.py: LLaVA-NeXT's tiles, which
    image_sizes decide, one image per sample or several)."""
    if rows == samples:
        return 1, None
    packed = sorted((k for k, r in inputs.items() if max(r) > 1), key=lambda k: len(set(inputs[k])) == 1)
    for key in packed:
        ratio = Fraction(rows, sum(inputs[key]))
        if all(r * ratio.numerator % ratio.denominator == 0 for r in inputs[key]):
            return inputs[key][0] * ratio.numerator // ratio.denominator, (key, ratio.numerator, ratio.denominator)
    return rows // samples, (probe_key(block, leaf), 1, 1)


def _probe(model: nn.Module, batch: dict[str, Any], specs: dict[str, OutputSpec], constants: dict) -> SampleProbe | None:
    """The probe of the leaves `_rows` left to it; the example's rows seed its cache when its samples are alike."""
    leaves: dict[str, tuple[int, ...]] = {}
    for b, spec in specs.items():
        idx = tuple(i for i, rule in enumerate(spec.scaled) if rule is not None and rule[0].startswith(PROBE))
        if idx:
            leaves[b] = idx
    if not leaves:
        return None
    known = {}
    keys = {shape_key(s) for s in split_samples(batch)}
    if len(keys) == 1:
        known[keys.pop()] = {probe_key(b, i): specs[b].rows_of(i) for b, idx in leaves.items() for i in idx}
    return SampleProbe(model, leaves, constants, known)


class _VocabLoss(TorchFunctionMode):
    """The loss glue of a vocabulary-parallel head (runtime/vocab_parallel.py): its output is this tp rank's
    logits slice (..., V/tp); shape-only glue reshaping to the full vocabulary V reshapes to V/tp, and
    F.cross_entropy of the slice becomes the vocabulary-parallel cross-entropy. The data flow recorded that
    nothing else reads the head's output (ForwardProgram.vocab_heads)."""

    def __init__(self, heads: dict[str, Any], outputs: dict[str, Any]):
        super().__init__()
        self.heads, self.outputs = heads, outputs
        self.logits: dict[int, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for head in self.heads:  # the head's output, once it ran
            out = self.outputs.get(head)
            if isinstance(out, torch.Tensor) and id(out) not in self.logits:
                self.logits[id(out)] = head
        head = self.logits.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
        if head is None:
            return func(*args, **kwargs)
        loss, vocab, tp = self.heads[head]
        if func is torch.nn.functional.cross_entropy:
            return loss(*args, **kwargs)
        if getattr(func, "__name__", "") in ("view", "reshape"):
            args = (args[0], *_local_shape(args[1:], vocab, tp))
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.logits[id(out)] = head
        return out


def _local_shape(shape: tuple, vocab: int, tp: int) -> tuple:
    """A view's shape arguments with a last dim of the full vocabulary replaced by this rank's slice."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return (tuple(_local_shape(tuple(shape[0]), vocab, tp)),)
    if shape and shape[-1] == vocab:
        return (*shape[:-1], vocab // tp)
    return shape


class _Bare:
    """A block's original forward without its module's __call__ (whose hooks already fire around the proxy)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)


def bare(modules: dict[str, nn.Module]) -> dict[str, _Bare]:
    return {name: _Bare(m) for name, m in modules.items()}


@contextmanager
def _patched(blocks: dict[str, nn.Module], make) -> Iterator[None]:
    for name, m in blocks.items():
        m.forward = make(name, m)
    try:
        yield
    finally:
        for m in blocks.values():
            m.__dict__.pop("forward", None)


def _record(model: nn.Module, batch: dict[str, Any], blocks: dict[str, nn.Module]):
    """One forward on fake tensors: execution order, what each block and the loss read, output specs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    in_blocks = {id(p) for m in blocks.values() for p in m.parameters()}
    free = [n for n, p in model.named_parameters() if id(p) not in in_blocks and p.requires_grad]
    restore = fakify_module(model, mode)
    prov: dict[int, frozenset] = {}
    alive: list = []
    for n in free:  # a trained parameter outside every block: its readers are found like a block output's
        fake = model.get_parameter(n)
        prov[id(fake)] = frozenset({PARAM + n})
        alive.append(fake)
    inside: list[str] = []
    order: list[str] = []
    reads: dict[str, set[str]] = defaultdict(set)
    specs: dict[str, tuple] = {}
    handles = []
    flow, heads = _Flow(prov, alive, inside), HeadPaths()
    try:
        fb = fake_batch(batch, mode)
        for k, v in fb.items():  # batch inputs: their readers' outputs depend on the batch (ForwardProgram.specs)
            if isinstance(v, torch.Tensor):
                prov[id(v)] = prov.get(id(v), frozenset()) | {BATCH + k}
                alive.append(v)
        for name, m in blocks.items():
            def pre(module, args, kwargs, name=name):
                if not inside:
                    if name not in order:
                        order.append(name)
                    reads[name] |= {s for s in _sources(prov, (args, kwargs))}
                inside.append(name)

            def post(module, args, kwargs, output, name=name):
                inside.pop()
                if inside:
                    return
                flat, tree = tree_flatten(output)
                specs.setdefault(name, (tree, tuple((tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor))))
                for leaf in flat:
                    if isinstance(leaf, torch.Tensor):
                        prov[id(leaf)] = frozenset({name})
                        alive.append(leaf)
                heads.watch(name, module, output)

            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True))
        try:
            with static_fake(mode), flow, heads, torch.no_grad():
                out = model(**fb)
        except MmplanError:
            raise
        except Exception as e:
            raise MmplanError(f"running {type(model).__name__}'s forward on fake tensors failed: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}") from None
        loss = model_loss(out)
        if loss is None:
            raise MmplanError(f"{type(model).__name__}'s forward returns neither a loss tensor nor an object with .loss")
        loss_reads = _sources(prov, loss)
    finally:
        for h in handles:
            h.remove()
        restore()
    return order, {b: reads[b] for b in order}, set(loss_reads), specs, heads.found()
