"""Boundary communicators: move slices of block outputs forward and their gradients back between stages.

One mechanism serves pipeline hand-overs and group boundaries (fan-in, fan-out, disjoint or shared
ranks, one encoder feeding several stages): a route's pieces say which samples of which producer
replica go to which consumer replica, and, where the route re-batches between groups of different micro-batch counts
(plans/stage_graph.py), which of their micro-batches: a producer micro-batch feeding several consumer ones slices its
output for each and sums their gradients before its one backward. Remote pieces travel by isend/irecv with a unique
tag per (route, piece, tensor, direction, window: a micro-batch unless the route re-batches); pieces between stages on the same rank are handed over
through a local mailbox. Sends never block; receives block, and the static task order (schedule.py)
guarantees the matching send was issued first. With tensor parallelism a replica's tp ranks hold
identical block outputs and input gradients. Between stages of equal tp > 1 on different ranks, Megatron's
scatter/gather (Narayanan et al. 2021, section 4.1; cost_models/routes.route_time prices it so): tp-rank j
of the sending replica sends the j-th 1/tp of each floating-point piece to tp-rank j of the receiving replica,
and the receiving tp ranks all-gather the parts over their tp group — in both directions. Otherwise (and for
integer leaves) the sending replica's tp-rank 0 sends each tp rank of the receiving replica its own copy.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from runtime.output_spec import OutputSpec
from runtime.samples import sample_rows
from runtime.stage_map import Route, StageMap


class Exchange:
    """This rank's end of every route; counts the seconds it spends waiting for data."""

    def __init__(self, stage_map: StageMap, rank: int, specs: dict[str, OutputSpec], device: torch.device,
                 rows_of: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]] = sample_rows):
        self.stage_map = stage_map
        self.rows_of = rows_of  # a batch's per-sample rows of its inputs and probed outputs (ForwardProgram.batch_rows)
        self.rank = rank
        self.specs = specs
        self.device = device
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.sends: list[dist.Work] = []
        self.wait_s = 0.0
        self.bytes_sent = 0
        self.tp_groups: dict[str, Any] = {}  # stage key -> this rank's tp group there (set by the trainer)
        self._tag: dict[tuple, int] = {}
        self.rows: dict[tuple[int, int], dict[str, int]] = {}  # (micro-batch, sample) -> input key -> its rows
        for i, route in enumerate(stage_map.routes):
            for k in range(len(route.pieces)):
                for leaf in range(len(specs[route.block].leaves)):
                    for direction in (0, 1):
                        self._tag[(i, k, leaf, direction)] = len(self._tag)

    def tag(self, route: int, piece: int, leaf: int, direction: int, window: int) -> int:
        """Unique per route, piece (of a window), tensor leaf, direction and window (a micro-batch when the route's two
        groups count micro-batches alike; plans/stage_graph.py)."""
        return self._tag[(route, piece, leaf, direction)] * self.stage_map.most_micro_batches + window

    def _rank(self, stage: str, replica: int) -> int:
        return self.stage_map.stages[stage].leader(replica)

    def _leads(self, stage: str, replica: int) -> bool:
        return self.stage_map.stages[stage].leader(replica) == self.rank

    def _put(self, dst: int, tensor: torch.Tensor, key: tuple, tag: int) -> None:
        if dst == self.rank:
            self.mailbox[key] = tensor.detach().clone()
        else:
            tensor = tensor.detach().contiguous()
            self.sends.append(dist.isend(tensor, dst, tag=tag))
            self.bytes_sent += tensor.numel() * tensor.element_size()

    def _get(self, src: int, shape: tuple[int, ...], dtype: torch.dtype, key: tuple, tag: int) -> torch.Tensor:
        if src == self.rank:
            return self.mailbox.pop(key)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        t0 = _now()
        dist.recv(buf, src, tag=tag)
        self.wait_s += _now() - t0
        return buf

    def _scattered(self, route: Route) -> int:
        """tp when the route hands over by scatter/gather (see the module docstring), else 0."""
        src, dst = self.stage_map.stages[route.src], self.stage_map.stages[route.dst]
        return src.tp if src.tp == dst.tp > 1 and src.ranks != dst.ranks else 0

    def _gather(self, part: torch.Tensor, stage: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor of `shape` from this rank's part and its tp group's (parts in tp-rank order)."""
        group = self.tp_groups[self.stage_map.stages[stage].key]
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        t0 = _now()
        dist.all_gather(parts, part, group=group)
        self.wait_s += _now() - t0
        return torch.cat(parts)[:math.prod(shape)].view(shape)

    # forward: producer replica -> consumer replicas
    def send_forward(self, route_idx: int, replica: int, mb: int, value: Any) -> None:
        route = self.stage_map.routes[route_idx]
        tp, stage = self._scattered(route), self.stage_map.stages[route.src]
        if not self._leads(route.src, replica) and not (tp and self.rank in stage.tp_ranks(replica)):
            return
        spec, graph, w = self.specs[route.block], self.stage_map.graph, self._window(route_idx, mb, True)
        g_route = graph.routes[route_idx]
        first = self._first_sample(route.src, replica, mb)
        leaves = [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]
        for k, p in self._pieces_of(route_idx, replica, mb, True):
            off, n = graph.src_offset(g_route, p), p.stop - p.start
            for j, dst in enumerate(self.stage_map.stages[route.dst].tp_ranks(p.dst_replica)):
                for leaf, t in enumerate(leaves):
                    key = (route_idx, k, leaf, 0, w)
                    piece = t.narrow(0, self._span(route.block, leaf, first, first + off),
                                     self._span(route.block, leaf, first + off, first + off + n))
                    if tp and piece.is_floating_point():
                        if stage.tp_index(self.rank) == j:
                            self._put(dst, _part(piece, j, tp), key, self.tag(*key))
                    elif self._leads(route.src, replica):
                        self._put(dst, piece, key, self.tag(*key))

    def recv_forward(self, route_idx: int, replica: int, mb: int, needs_grad: bool = True) -> tuple[Any, list[torch.Tensor]]:
        """The producer's output for this consumer replica's samples, as fresh leaves (requiring grad when
        `needs_grad`: the producer runs a backward)."""
        route = self.stage_map.routes[route_idx]
        spec = self.specs[route.block]
        tp = self._scattered(route)
        j = self.stage_map.stages[route.dst].tp_index(self.rank) if tp else 0
        parts: list[list[torch.Tensor]] = [[] for _ in spec.leaves]
        w = self._window(route_idx, mb, False)
        for k, p in self._pieces_of(route_idx, replica, mb, False):
            for leaf, (shape, dtype) in enumerate(spec.leaves):
                key = (route_idx, k, leaf, 0, w)
                full = (self._span(route.block, leaf, *self._global(route_idx, p, w)), *shape)
                if tp and dtype.is_floating_point:
                    src = self.stage_map.stages[route.src].tp_ranks(p.src_replica)[j]
                    part = self._get(src, (_part_len(full, tp),), dtype, key, self.tag(*key))
                    parts[leaf].append(self._gather(part, route.dst, full))
                else:
                    parts[leaf].append(self._get(self._rank(route.src, p.src_replica), full, dtype, key, self.tag(*key)))
        leaves = [torch.cat(chunks) if len(chunks) > 1 else chunks[0] for chunks in parts]
        leaves = [t.requires_grad_() if needs_grad and t.is_floating_point() else t for t in leaves]
        return tree_unflatten(leaves, spec.tree), leaves

    # backward: consumer replica -> producer replicas
    def send_backward(self, route_idx: int, replica: int, mb: int, leaves: list[torch.Tensor]) -> None:
        route = self.stage_map.routes[route_idx]
        tp, stage = self._scattered(route), self.stage_map.stages[route.dst]
        if not self._leads(route.dst, replica) and not (tp and self.rank in stage.tp_ranks(replica)):
            return
        spec, graph, w = self.specs[route.block], self.stage_map.graph, self._window(route_idx, mb, False)
        first = self._first_sample(route.dst, replica, mb)
        for k, p in self._pieces_of(route_idx, replica, mb, False):
            off, n = graph.dst_offset(graph.routes[route_idx], p), p.stop - p.start
            for j, src in enumerate(self.stage_map.stages[route.src].tp_ranks(p.src_replica)):
                if tp and stage.tp_index(self.rank) != j:
                    continue  # scatter/gather: tp-rank j sends the j-th part to its counterpart only
                for leaf, t in enumerate(leaves):
                    if not t.is_floating_point():
                        continue
                    grad = t.grad if t.grad is not None else torch.zeros_like(t)
                    key = (route_idx, k, leaf, 1, w)
                    piece = grad.narrow(0, self._span(route.block, leaf, first, first + off),
                                        self._span(route.block, leaf, first + off, first + off + n))
                    self._put(src, _part(piece, j, tp) if tp else piece, key, self.tag(*key))

    def recv_backward(self, route_idx: int, replica: int, mb: int, grads: list[torch.Tensor | None]) -> None:
        """Add the gradients of this producer replica's output that the route's consumers send back."""
        route = self.stage_map.routes[route_idx]
        spec, graph, w = self.specs[route.block], self.stage_map.graph, self._window(route_idx, mb, True)
        tp = self._scattered(route)
        j = self.stage_map.stages[route.src].tp_index(self.rank) if tp else 0
        first = self._first_sample(route.src, replica, mb)
        for k, p in self._pieces_of(route_idx, replica, mb, True):  # every consumer micro-batch of this one's samples
            off = graph.src_offset(graph.routes[route_idx], p)
            dst = self.stage_map.stages[route.dst].tp_ranks(p.dst_replica)[j] if tp else self._rank(route.dst, p.dst_replica)
            for leaf, (shape, dtype) in enumerate(spec.leaves):
                if not dtype.is_floating_point:
                    continue
                key = (route_idx, k, leaf, 1, w)
                full = (self._span(route.block, leaf, *self._global(route_idx, p, w)), *shape)
                if tp:
                    part = self._get(dst, (_part_len(full, tp),), dtype, key, self.tag(*key))
                    piece = self._gather(part, route.src, full)
                else:
                    piece = self._get(dst, full, dtype, key, self.tag(*key))
                if grads[leaf] is None:
                    n = self.stage_map.slice(route.src, replica)
                    grads[leaf] = torch.zeros((self._span(route.block, leaf, first, first + n[1] - n[0]), *shape),
                                              dtype=dtype, device=self.device)
                grads[leaf].narrow(0, self._span(route.block, leaf, first, first + off), full[0]).add_(piece)

    def note_batches(self, batches: dict[tuple, dict[str, Any]]) -> None:
        """Remember the per-sample input rows of this rank's (stage, replica, micro-batch) batches, by global sample
        index, which the rows of a block output of images of different sizes follow (OutputSpec.scaled); only when
        some output has such."""
        self.rows.clear()
        if not any(spec.scaled for spec in self.specs.values()):
            return
        for (stage, replica, mb), batch in batches.items():
            first = self._first_sample(stage, replica, mb)
            for key, rows in self.rows_of(batch).items():
                for i, r in enumerate(rows):
                    self.rows.setdefault(first + i, {})[key] = r

    def _first_sample(self, stage: str, replica: int, mb: int) -> int:
        """The global index of the replica's first sample in the stage's micro-batch `mb` (its own count's)."""
        return mb * self.stage_map.stages[stage].micro_batch + self.stage_map.slice(stage, replica)[0]

    def _global(self, route_idx: int, p: Any, window: int) -> tuple[int, int]:
        """The global samples [start, stop) of a route piece of window `window` (a piece's samples count from its
        window's first: the window is src_per producer micro-batches)."""
        route = self.stage_map.graph.routes[route_idx]
        base = window * route.src_per * self.stage_map.graph.chunks[route.src].micro_batch
        return base + p.start, base + p.stop

    def _span(self, block: str, leaf: int, start: int, stop: int) -> int:
        """Rows of global samples [start, stop) in block `block`'s output leaf `leaf`."""
        spec = self.specs[block]
        if not spec.varies(leaf):
            return (stop - start) * spec.rows_of(leaf)
        key, num, den = spec.scaled[leaf]
        try:
            return sum(self.rows[s][key] * num // den for s in range(start, stop))
        except KeyError:
            raise RuntimeError(f"rank {self.rank} holds no batch telling the rows of samples {start}-{stop - 1} "
                               f"(block {block}'s output follows input {key!r})") from None

    def _window(self, route_idx: int, mb: int, producer: bool) -> int:
        """The route's window holding this producer (or consumer) micro-batch."""
        route = self.stage_map.graph.routes[route_idx]
        return mb // (route.src_per if producer else route.dst_per)

    def _pieces_of(self, route_idx: int, replica: int, mb: int, producer: bool) -> list:
        """(index, piece) of the route's window pieces of this producer (or consumer) replica and micro-batch, by start."""
        route = self.stage_map.graph.routes[route_idx]
        if producer:
            a = mb % route.src_per
            got = [(k, p) for k, p in enumerate(route.pieces) if p.src_replica == replica and p.src_mb == a]
        else:
            b = mb % route.dst_per
            got = [(k, p) for k, p in enumerate(route.pieces) if p.dst_replica == replica and p.dst_mb == b]
        return sorted(got, key=lambda kp: kp[1].start)

    def finish(self) -> None:
        """Wait for every send of the step (bounded by the process group's timeout)."""
        t0 = _now()
        for w in self.sends:
            w.wait()
        self.sends.clear()
        self.wait_s += _now() - t0
        if self.mailbox:
            raise RuntimeError(f"{len(self.mailbox)} local hand-overs were never consumed: schedule bug")


def _part_len(shape: tuple[int, ...], tp: int) -> int:
    """Elements of each of the tp parts of a tensor of `shape` (the last part zero-padded)."""
    return -(-math.prod(shape) // tp)


def _part(t: torch.Tensor, j: int, tp: int) -> torch.Tensor:
    """The j-th of tp equal parts of t's elements, zero-padded to _part_len."""
    n = _part_len(tuple(t.shape), tp)
    flat = t.detach().reshape(-1)
    part = flat[j * n:(j + 1) * n]
    return part if part.numel() == n else torch.cat([part, part.new_zeros(n - part.numel())])


def _now() -> float:
    import time

    return time.perf_counter()
