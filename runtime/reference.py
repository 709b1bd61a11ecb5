"""The single-process reference run that every plan must reproduce: same model, data, micro-batches, optimizer."""
from __future__ import annotations

from typing import Any

import torch

from runtime.data import open_dataset
from runtime.hf import data_example
from runtime.param_tiers import TieredAdam
from runtime.precision import cast_inputs, torch_dtype
from runtime.source import model_loss
from runtime.job import Job
from runtime.rank import build_model, vocab_of
from runtime.samples import model_inputs
from runtime.train import step_samples


def reference_run(job: Job) -> dict[str, Any]:
    """Losses per step and the first step's gradients, training the whole model in this process."""
    training = job.plan.training
    model, example = build_model(job)
    data = data_example(job.model, job.plan.training.micro_batch, example)  # images of several sizes: runtime/hf.py
    dataset = open_dataset(job.data, data, vocab_of(model), job.seed, model=model)
    dtype = torch_dtype(training.dtype)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # mixed precision (bf16): Adam on fp32 master copies, as every rank runs it (param_tiers.TieredAdam)
    optimizer = TieredAdam(named, lr=job.lr) if dtype != torch.float32 else torch.optim.Adam(model.parameters(), lr=job.lr)
    losses, grads = [], {}
    m = training.micro_batches
    for step in range(job.steps):
        total = 0.0
        for j in range(m):
            batch = cast_inputs(dataset.sample_batch(step_samples(step, job.plan, j, 0, training.micro_batch)), dtype)
            loss = model_loss(model(**model_inputs(batch))) / m
            loss.backward()
            total += float(loss.detach())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "grads": grads}
