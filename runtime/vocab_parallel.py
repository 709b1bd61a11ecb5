"""Vocabulary parallelism under tensor parallelism: the token embedding, the LM head and the cross-entropy
sharded over the vocabulary (Shoeybi et al. 2019, "Megatron-LM", section 3: "Parallelize the input and
output embedding"; Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy).

tp rank r of tp owns vocabulary rows [r*V/tp, (r+1)*V/tp):
    embedding  looks up the ids it owns, zeros the others' rows and all-reduces (g): every tp rank holds the
               full, identical (B, S, D) output; the backward passes the gradient through, each rank's rows
               getting exactly their tokens' gradients.
    head       column-parallel over the vocabulary: its input goes through f (identity forward, all-reduce
               of the input gradient backward) and it returns this rank's logits slice (B, S, V/tp).
    loss       cross-entropy from the logits slices with two all-reduces of (N,) vectors — the max and the
               sum of exp — and one of the target logit, never gathering the (N, V) logits; the backward is
               softmax - one-hot on the local slice.
The head's output is read only by the loss (checked on the traced program: the path from the head to
F.cross_entropy may only reshape, slice or cast), so a sliced logit never leaves the stage. For a model
running its own forward (Hugging Face models, runtime/forward_program.py) the same path is checked on the
recorded data flow, and the forward's loss glue is rewritten while it runs (views to V/tp, the loss).
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from plans.errors import MmplanError

from .tensor_parallel import copy_to_tp_region, reduce_from_tp_region
from .tensor_tree import tensors_in
from .tp_shards import LAYOUT_ATTR, ShardInfo, TPLayout

# glue allowed between the head and the loss: it must keep the vocabulary as the last dim
_PASS_METHODS = {"flatten", "view", "reshape", "float", "to", "contiguous", "__getitem__", "type_as"}
_PASS_FUNCTIONS = {operator.getitem, torch.flatten}
# reading a tensor's metadata (properties such as .shape / .dtype / .device come as "__get__") reads no logit
_METADATA = {"__get__", "size", "dim", "numel", "is_floating_point", "element_size", "get_device", "is_contiguous"}


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding holding rows [vocab_start, vocab_start + rows) of the full table (set by shard_embedding)."""

    vocab_start: int
    group: Any

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx, self.max_norm,
                          self.norm_type, self.scale_grad_by_freq, self.sparse)  # (..., D)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group)


class VocabParallelHead(nn.Linear):
    """An nn.Linear holding output rows [vocab_start, vocab_start + out_features): returns a logits slice."""

    vocab_start: int
    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)  # (..., V/tp)


# ----------------------------------------------------------------------------------------------- the loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of (N, V/tp) logit slices against (N,) targets; ignored rows give 0."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any,
                ignore_index: int) -> torch.Tensor:
        logits = logits.float()
        row_max = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        local = target - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])  # (N,) targets whose logit this rank holds
        idx = local.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine  # (N,)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([sum_exp, target_logit])  # one all-reduce for the two (N,) sums
        dist.all_reduce(both, group=group)
        sum_exp, target_logit = both[0], both[1]
        kept = target != ignore_index
        loss = (sum_exp.log() - target_logit) * kept
        exp.div_(sum_exp.unsqueeze(-1))  # softmax slice, kept for the backward
        ctx.save_for_backward(exp, idx, mine, kept)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, idx, mine, kept = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g.mul_((grad * kept).unsqueeze(-1))
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Any = None,
                                 size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                                 reduction: str = "mean", label_smoothing: float = 0.0, *, vocab_start: int,
                                 vocab: int, group: Any) -> torch.Tensor:
    """F.cross_entropy(full_logits, target, ...) from this rank's (N, V/tp) slice (F.cross_entropy's signature)."""
    if weight is not None or size_average is not None or reduce is not None or label_smoothing:
        raise MmplanError("vocabulary-parallel cross-entropy supports ignore_index and reduction only (no class "
                          "weights, label smoothing or legacy size_average/reduce); use tp=1 for the loss stage")
    if logits.dim() != 2 or logits.shape[-1] * dist.get_world_size(group) != vocab:
        raise MmplanError(f"vocabulary-parallel cross-entropy expects (N, {vocab} / tp) logits, got "
                          f"{tuple(logits.shape)}: the glue between the head and the loss changed the vocabulary dim")
    loss = _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group, ignore_index).to(logits.dtype)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


# --------------------------------------------------------------------------- which heads qualify (no fx graph)
class HeadPaths(TorchFunctionMode):
    """While a model's forward runs: which nn.Linear blocks' outputs reach F.cross_entropy (as its first
    argument) through shape-only glue (_PASS_METHODS) and nothing else — the heads shard_head may make
    vocabulary-parallel when there is no fx graph to check (runtime/forward_program.py), and the heads the
    profile marks vocab_parallel="head" (planner/profiler/profile.py), so prediction and execution agree."""

    def __init__(self) -> None:
        super().__init__()
        self.logits: dict[int, str] = {}  # tensor id -> the head it is a shape-only view of
        self.keep: list[torch.Tensor] = []  # ids stay unique while the forward runs
        self.to_loss: set[str] = set()
        self.other: set[str] = set()  # heads whose output other glue read

    def watch(self, name: str, module: nn.Module, output: Any) -> None:
        """A block's forward hook: an nn.Linear block's tensor output starts a path."""
        if type(module) is nn.Linear and isinstance(output, torch.Tensor):
            self.logits[id(output)] = name
            self.keep.append(output)

    def found(self) -> set[str]:
        return self.to_loss - self.other

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        heads = {self.logits[id(x)] for x in tensors_in((args, kwargs)) if id(x) in self.logits}
        if heads and getattr(func, "__name__", "") not in _METADATA:
            first = self.logits.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
            if func is F.cross_entropy and heads == {first}:
                self.to_loss.add(first)
            elif getattr(func, "__name__", "") in _PASS_METHODS and heads == {first} and isinstance(out, torch.Tensor):
                self.logits[id(out)] = first
                self.keep.append(out)
            else:
                self.other |= heads
        return out


# ----------------------------------------------------------------------------------------------- apply
def _shard_rows(p: nn.Parameter, tp_rank: int, tp: int) -> nn.Parameter:
    piece = p.detach().chunk(tp, dim=0)[tp_rank].clone(memory_format=torch.contiguous_format)
    return nn.Parameter(piece, requires_grad=p.requires_grad)


def _record(block: nn.Module, tp: int, tp_rank: int, shards: dict[str, ShardInfo]) -> None:
    old: TPLayout | None = getattr(block, LAYOUT_ATTR, None)
    merged = {**(old.shards if old else {}), **shards}
    setattr(block, LAYOUT_ATTR, TPLayout(tp, tp_rank, merged))


def vocab_embeddings(block: nn.Module, vocab: int) -> dict[str, nn.Embedding]:
    """The token embeddings (nn.Embedding with `vocab` rows) inside `block`, by module path ('' = the block)."""
    return {n: m for n, m in block.named_modules() if type(m) is nn.Embedding and m.num_embeddings == vocab}


def shard_embedding(block: nn.Module, group: Any, tp_rank: int, tp: int, vocab: int,
                    shared: dict[int, nn.Parameter]) -> bool:
    """Make the block's token embeddings vocabulary-parallel; False (unchanged) when tp does not divide vocab."""
    found = vocab_embeddings(block, vocab)
    if not found or vocab % tp:
        return False
    shards = {}
    for path, emb in found.items():
        name = f"{path}.weight" if path else "weight"
        shards[name] = ShardInfo(name, 0, tp_rank, tp, tuple(emb.weight.shape))
        emb.weight = shared.setdefault(id(emb.weight), _shard_rows(emb.weight, tp_rank, tp))
        emb.num_embeddings = emb.weight.shape[0]
        emb.__class__ = VocabParallelEmbedding
        emb.vocab_start, emb.group = tp_rank * emb.num_embeddings, group
        if emb.padding_idx is not None:
            raise MmplanError("a vocabulary-parallel embedding cannot have a padding_idx")
    _record(block, tp, tp_rank, shards)
    return True


def _loss_node(program: Any, head: str) -> Any:
    """The F.cross_entropy node reading `head`'s output through shape-only glue, or None."""
    node = program.blocks[head]
    if not hasattr(node, "users"):  # a model running its own forward (runtime/forward_program.py): no fx graph
        return None
    while True:
        if len(node.users) != 1:
            return None
        (user,) = node.users
        if not user.args or user.args[0] is not node:
            return None
        if user.op == "call_function" and user.target is F.cross_entropy:
            return user
        passes = (user.op == "call_method" and user.target in _PASS_METHODS) or \
                 (user.op == "call_function" and user.target in _PASS_FUNCTIONS)
        if not passes:
            return None
        node = user


def shard_head(program: Any, name: str, block: nn.Module, group: Any, tp_rank: int, tp: int, vocab: int,
               leaving: set[str], shared: dict[int, nn.Parameter]) -> bool:
    """Make an LM head (an nn.Linear block with `vocab` outputs, read only by F.cross_entropy on this stage)
    column-parallel over the vocabulary and its loss vocabulary-parallel; False when it does not qualify."""
    if type(block) is not nn.Linear or block.out_features != vocab or vocab % tp or name in leaving:
        return False
    own = hasattr(program, "vocab_heads")  # a model running its own forward (runtime/forward_program.py)
    loss = None if own else _loss_node(program, name)
    if (name not in program.vocab_heads) if own else loss is None:
        return False
    shards = {"weight": ShardInfo("weight", 0, tp_rank, tp, tuple(block.weight.shape))}
    block.weight = shared.setdefault(id(block.weight), _shard_rows(block.weight, tp_rank, tp))
    if block.bias is not None:
        shards["bias"] = ShardInfo("bias", 0, tp_rank, tp, tuple(block.bias.shape))
        block.bias = _shard_rows(block.bias, tp_rank, tp)
    block.out_features = block.weight.shape[0]
    block.__class__ = VocabParallelHead
    block.vocab_start, block.group = tp_rank * block.out_features, group
    ce = functools.partial(vocab_parallel_cross_entropy, vocab_start=block.vocab_start, vocab=vocab, group=group)
    if own:
        program.vocab_loss[name] = (ce, vocab, tp)  # its forward's loss glue is rewritten while it runs
    else:
        loss.target = ce
    _record(block, tp, tp_rank, shards)
    return True
