"""What every rank of a run is given: the plan, the model spec and the run's options (identical on every rank)."""
from __future__ import annotations

from dataclasses import dataclass

from plans.plan import Plan


@dataclass(frozen=True)
class Job:
    """Everything a rank needs to train; identical on every rank."""

    plan: Plan
    model: str  # model source: zoo name, architecture TOML, or package.module:factory
    steps: int
    seed: int = 0
    lr: float = 1e-3
    data: str | None = None  # None: the built-in synthetic dataset; else package.module:factory
    log: str | None = None  # JSONL path written by rank 0
    probe_grads: bool = False  # return the first step's gradients (parity tests)
    fail_at: tuple[int, int] | None = None  # (rank, step): raise there (failure-handling tests)
    device_budget: float | None = None  # bytes each rank's device tier may hold (None: unbounded)
    nvme_dir: str | None = None  # where the nvme tier's files go
    prefetch: bool = True  # bring offloaded activations / parameters back ahead of use
    checkpoint_every: int = 0  # steps between checkpoints (0: none)
    checkpoint_dir: str | None = None
    checkpoint_format: str = "dcp"  # "dcp": every rank writes its shards (format /2); "gather": one file per block (/1)
    checkpoint_async: bool = False  # dcp only: write in a background thread while training goes on (dcp.async_save)
    resume: str | None = None  # checkpoint directory to resume from (its latest complete checkpoint)
    trace: bool = False  # return every rank's timeline of the last step (rank 0's results["trace"])
    lineage: str = ""  # the training run the checkpoints belong to (kept across resumptions; see checkpoint.py)
    bucket_bytes: int = 25 * 2**20  # dp gradient all-reduce in buckets during the backward (grad_buckets.py); 0: after it
    progress: str | None = None  # rank 0 appends each step's metrics here as a JSON line (the launcher's monitor reads it)
