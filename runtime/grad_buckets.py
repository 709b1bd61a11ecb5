"""Bucketed data-parallel gradient reduction during the backward (as PyTorch DDP's Reducer, Li et al. 2020,
"PyTorch Distributed", section 3.2.3): a stage's gradients are all-reduced over its dp replicas in buckets
of about 25 MB, each launched asynchronously as soon as its last gradient is final, so the communication
overlaps the rest of the backward; the step waits for all of them before the optimizer.

A gradient is final during the stage's last backward task of the step (the last micro-batch): the buckets
are armed just before it, and `register_post_accumulate_grad_hook` reports each parameter once its gradient
has been accumulated. Buckets hold parameters in reverse order (the backward reaches the last blocks first)
and are launched strictly in bucket order on every replica, so all replicas issue the same collectives in
the same order whatever the order their gradients become ready in. Parameters without a gradient this step
(unused) are sent as zeros, as the synchronous reduction does.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default


def all_reduce_grads(params: list[nn.Parameter], group: Any) -> None:
    """Sum the gradients of `params` over `group` in one flat all-reduce (a missing gradient counts as zeros);
    afterwards every member holds the sums."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


class GradBuckets:
    """One stage's parameters, in buckets of about `bucket_bytes`, all-reduced over `group` as they get ready."""

    def __init__(self, params: list[nn.Parameter], group: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.group = group
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes
        for p in reversed(params):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.armed = False
        self.ready: list[set[int]] = []
        self.launched: list[tuple[torch.Tensor, Any]] = []
        self.during_backward = 0  # buckets of the last step launched by the backward's hooks (the overlapped ones)
        self.handles = [p.register_post_accumulate_grad_hook(self._on_ready) for p in params if p.requires_grad]

    def arm(self) -> None:
        """The next backward is the stage's last of the step: launch each bucket once its gradients are final."""
        self.armed = True
        self.ready = [set() for _ in self.buckets]
        self.launched = []
        self.during_backward = 0

    def _on_ready(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        self.ready[self.bucket_of[id(p)]].add(id(p))
        while len(self.launched) < len(self.buckets):
            i = len(self.launched)
            if len(self.ready[i]) < len(self.buckets[i]):
                break
            self._launch(i)
            self.during_backward += 1

    def _launch(self, i: int) -> None:
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.buckets[i]])
        self.launched.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """Launch what is left (buckets with unused parameters, or all of them when no backward ran), wait for
        every bucket and write the sums back into the gradients."""
        if not self.armed:
            self.launched = []
        while len(self.launched) < len(self.buckets):
            self._launch(len(self.launched))
        for bucket, (flat, work) in zip(self.buckets, self.launched):
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        self.armed = False
        self.launched = []

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
