"""The single-process reference run that every plan must reproduce: same model, data, micro-batches, optimizer."""
from __future__ import annotations

from typing import Any

import torch

from runtime.data import open_dataset
from runtime.source import model_loss
from runtime.train import Job, build_model, step_samples, vocab_of


def reference_run(job: Job) -> dict[str, Any]:
    """Losses per step and the first step's gradients, training the whole model in this process."""
    training = job.plan.training
    model, example = build_model(job)
    dataset = open_dataset(job.data, example, vocab_of(model), job.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=job.lr)
    losses, grads = [], {}
    m = training.micro_batches
    for step in range(job.steps):
        total = 0.0
        for j in range(m):
            batch = dataset.sample_batch(step_samples(step, job.plan, j, 0, training.micro_batch))
            loss = model_loss(model(**batch)) / m
            loss.backward()
            total += float(loss.detach())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "grads": grads}
