"""The model's forward as a program of block calls and glue, traced once with torch.fx (blocks are leaves).

A plan cuts the model's blocks into stages on ranks; the glue between blocks (concatenation, slicing,
the loss) is arbitrary tensor code in the model's forward. Tracing with every block as an fx leaf module
gives a small graph whose `call_module` nodes are the blocks and whose other nodes are the glue. A stage
then runs: the glue its blocks need (recomputed locally from placeholders and received block outputs),
its blocks, and — on the stage that owns the loss — the loss. Cross-stage values are always raw block
outputs, batched along dim 0, so every transfer is a slice of samples.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from plans.errors import MmplanError
from plans.graph import block_structure, fingerprint
from plans.plan import Flow, FlowBlock
from runtime.blocks import block_modules, is_hf_model
from runtime.forward_program import ForwardProgram



@dataclass(frozen=True)
class Program:
    """The traced forward: the fx graph, block nodes by name, and the loss's owning block."""

    graph: fx.Graph
    blocks: dict[str, fx.Node]  # block name -> its call_module node
    inputs: tuple[str, ...]  # batch keys the program reads
    output: fx.Node  # the node whose value is the loss

    def deps(self, node: fx.Node) -> tuple[set[str], set[str]]:
        """Blocks and batch inputs that `node`'s arguments derive from through glue (not through blocks)."""
        blocks: set[str] = set()
        inputs: set[str] = set()
        stack = list(node.all_input_nodes)
        seen: set[fx.Node] = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "call_module" and n.target in self.blocks:
                blocks.add(str(n.target))
            elif n.op == "placeholder":
                inputs.add(str(n.target))
            else:
                stack.extend(n.all_input_nodes)
        return blocks, inputs

    def loss_deps(self) -> set[str]:
        """Blocks whose outputs the loss reads (the block itself when the forward returns a block's output)."""
        if self.output.op == "call_module" and str(self.output.target) in self.blocks:
            return {str(self.output.target)}
        return self.deps(self.output)[0]

    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) block pairs of the traced data flow, consumers in execution order."""
        return [(src, name) for name, node in self.blocks.items() for src in sorted(self.deps(node)[0])]

    def input_edges(self) -> list[tuple[str, str]]:
        """(batch key, consumer block) pairs of the traced data flow."""
        return [(key, name) for name, node in self.blocks.items() for key in sorted(self.deps(node)[1])]


def is_frozen(module: nn.Module) -> bool:
    """plans.graph.Block.frozen of a module as built: it has parameters and none of them requires grad."""
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def traced_flow(program: Program, model: nn.Module | None = None) -> Flow:
    """The data flow of a traced model in the plan's form (output bytes unknown: 0; blocks frozen as `model` builds
    them), for a hand-written plan that carries none; plans/stage_graph.py then derives stages and routes from it
    as from a profile's."""
    modules = block_modules(model) if model is not None else {}
    return Flow(blocks=tuple(FlowBlock(b, 0.0, b in modules and is_frozen(modules[b])) for b in program.blocks),
                edges=tuple(program.edges()),
                loss=tuple(sorted(program.loss_deps(), key=list(program.blocks).index)))


def module_structure(module: nn.Module) -> str:
    """plans.graph.block_structure of a module: its class name and its parameters' names and shapes."""
    return block_structure(type(module).__name__, [(n, tuple(p.shape)) for n, p in module.named_parameters()])


def model_fingerprint(model: nn.Module, program: Program) -> str:
    """The structural fingerprint (plans.graph.fingerprint) of a model from its module tree and its traced
    forward — what a profile of it records, without profiling it."""
    modules = block_modules(model)
    return fingerprint([(b, module_structure(modules[b])) for b in program.blocks], program.edges(),
                       sorted(program.loss_deps()))


class _BlockTracer(fx.Tracer):
    def __init__(self, leaves: set[int]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, qualname)


def trace_program(model: nn.Module, batch: dict[str, Any]):
    """Trace model(**batch) with blocks as leaves; inputs absent from the batch are specialised to None.
    Hugging Face models, and models fx cannot trace, run their own forward per stage instead
    (runtime/forward_program.py): a ForwardProgram, with the same interface."""
    blocks = block_modules(model)
    if is_hf_model(model):
        return ForwardProgram(model, batch, blocks)
    try:
        return _fx_program(model, batch, blocks)
    except MmplanError as fx_error:
        try:
            return ForwardProgram(model, batch, blocks)
        except MmplanError:
            raise fx_error from None


def _fx_program(model: nn.Module, batch: dict[str, Any], blocks: dict[str, nn.Module]) -> Program:
    params = inspect.signature(model.forward).parameters
    concrete = {k: None for k, p in params.items() if k not in batch and p.default is None}
    try:
        graph = _BlockTracer({id(m) for m in blocks.values()}).trace(model, concrete_args=concrete or None)
    except Exception as e:
        raise MmplanError(f"cannot trace {type(model).__name__}'s forward with torch.fx to split it into stages: "
                          f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    nodes = {str(n.target): n for n in graph.nodes if n.op == "call_module" and str(n.target) in blocks}
    (output_node,) = [n for n in graph.nodes if n.op == "output"]
    (loss,) = output_node.all_input_nodes or (None,)
    if loss is None:
        raise MmplanError("the model's forward returns no tensor")
    inputs = tuple(str(n.target) for n in graph.nodes if n.op == "placeholder" and str(n.target) in batch)
    return Program(graph=graph, blocks=nodes, inputs=inputs, output=loss)


def evaluate(node: fx.Node, env: dict[fx.Node, Any], fetch, modules: dict[str, nn.Module]) -> Any:
    """Value of `node`, computing glue recursively; `fetch(node)` supplies placeholders and non-local blocks."""
    if node in env:
        return env[node]
    if node.op == "placeholder" or (node.op == "call_module" and str(node.target) not in modules):
        value = fetch(node)
    else:
        args = fx.node.map_arg(node.args, lambda n: evaluate(n, env, fetch, modules))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: evaluate(n, env, fetch, modules))
        if node.op == "call_module":
            value = modules[str(node.target)](*args, **kwargs)
        elif node.op == "call_function":
            value = node.target(*args, **kwargs)
        elif node.op == "call_method":
            obj, *rest = args
            value = getattr(obj, node.target)(*rest, **kwargs)
        elif node.op == "get_attr":
            value = fetch(node)
        else:  # pragma: no cover - output nodes are never evaluated
            raise MmplanError(f"cannot evaluate fx node {node.op}")
    env[node] = value
    return value


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]
