"""Probes of the runtime's own costs: compute with every rank busy, ZeRO's FSDP2 work, the fixed per-step cost."""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from planner.calibrate.probes import call_time, collective_iterations
from planner.calibrate.settings import Settings, load_factor
from plans.cluster import Cluster, Link


NEAR_EMPTY_MODEL = "planner.calibrate.runtime_probes:near_empty_model"


class _NearEmpty(torch.nn.Module):
    """Two 4 x 4 Linear layers and a mean as the loss: a training step with almost no work."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def near_empty_model(micro_batch: int = 1):
    """The model whose training step is the runtime's own cost (factory: model, example batch)."""
    return _NearEmpty(), {"x": torch.randn(micro_batch, 4)}


def measure_step_overhead(cluster: Cluster, *, steps: int = 14) -> float:
    """The runtime's fixed cost per step (Python, metrics, logging): train NEAR_EMPTY_MODEL with `mmplan run`'s own
    path (dp over every rank of `cluster`, one sample per rank) and take its median step (the first two warm up)
    minus what the cost model predicts for that plan on `cluster` (its gradient all-reduce and optimizer step)."""
    from cost_models.evaluate import evaluate
    from planner.solver.baselines import homogeneous_plan
    from planner.profiler.profile import profile_model
    from planner.commands.run import run_plan
    from plans.plan import save_plan
    from runtime.source import resolve

    profile = profile_model(resolve(NEAR_EMPTY_MODEL), device="meta")
    plan = homogeneous_plan(profile, cluster, cluster.world_size, f"tp=1,pp=1,dp={cluster.world_size}")
    with tempfile.TemporaryDirectory(prefix="mmplan-calibrate-") as scratch:
        path = Path(scratch) / "plan.json"
        save_plan(plan, path)
        metrics = run_plan(path, steps=steps, model=NEAR_EMPTY_MODEL, timeout_s=120 * load_factor(),
                           op_timeout_s=60 * load_factor()).metrics
    measured = statistics.median(m["step_time_s"] for m in (metrics[2:] or metrics))
    return max(0.0, measured - evaluate(plan, profile, cluster).predicted.step_time_s)


# compute_slowdown's probe: the forward and backward of a small MLP block (256 -> 1024 -> 256 on 128 tokens, GELU,
# LayerNorm: GEMMs and memory-bound elementwise work, as a training step mixes them), timed for Settings.probe_s
# seconds (median), by rank 0 alone and by every rank at once, in turns (slowdown_probe). Medians, not the lower
# quartiles of the other points: the probe is to see the sharing of cores, caches and memory bandwidth.
_PROBE_WIDTH, _PROBE_TOKENS = 256, 128


def _probe_step() -> Callable[[], Any]:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(_PROBE_WIDTH), torch.nn.Linear(_PROBE_WIDTH, 4 * _PROBE_WIDTH),
                                torch.nn.GELU(), torch.nn.Linear(4 * _PROBE_WIDTH, _PROBE_WIDTH))
    x = torch.randn(_PROBE_TOKENS, _PROBE_WIDTH, requires_grad=True)
    return lambda: block(x).square().mean().backward()


def median_time(step: Callable[[], Any], seconds: float) -> float:
    """Median seconds of one call of `step` over `seconds` of repetitions (at least 5)."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < end:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# turns of the probe (rank 0 alone, then every rank at once); the slowdown is the median of the turns' ratios. A
# shared VM's speed drifts by +-20 % over seconds whatever runs on it (2 vCPUs of a KVM guest: the same step alone
# took 469-715 ms in three turns a minute apart); each turn's ratio pairs two measurements a fraction of a second apart,
# and the median drops a turn that a drift or another job's spike hit (two turns, averaged, gave 1.02-1.63 in five
# quick calibrations of one machine)
_PROBE_TURNS = 5


def slowdown_probe(rank: int, settings: Settings) -> tuple[list[float], list[float]]:
    """(rank 0's probe step alone, this rank's with every rank at once) per turn, median seconds of each: measured in
    turns by the same processes (threads as in training), so that a drift of the machine's speed between the two
    hits both alike; ranks not measuring wait in a barrier. Rank 0's first list is empty on the other ranks."""
    step = _probe_step()
    step()  # warm-up
    alone, together = [], []
    for _ in range(_PROBE_TURNS):
        dist.barrier()
        if rank == 0:
            alone.append(median_time(step, settings.probe_s / 2))
        dist.barrier()
        together.append(median_time(step, settings.probe_s / 2))
    return alone, together


def probe_slowdown(alone: list[float], together: list[list[float]]) -> float:
    """compute_slowdown from slowdown_probe's turns: the median over turns of every rank's time at once (mean
    over the ranks) over rank 0's alone in the same turn; never below 1."""
    ratios = [statistics.fmean(ranks) / a for a, ranks in zip(alone, zip(*together)) if a > 0]
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


# ZeRO's probe: ZERO_BLOCKS blocks (Linear w -> w + LayerNorm: 4 parameter tensors each) on 16 rows, trained plain
# and sharded over all the ranks by the runtime's own FSDP2 path (runtime/zero.apply_zero, ZeRO-2: each step
# all-gathers every block's parameters in the forward and reduce-scatters its gradients in the backward, as a
# ZeRO-1/2 step of one micro-batch does). What the sharded step costs beyond the plain one and beyond the two
# collectives as the cost model prices them (one ring all-gather and one ring reduce-scatter of all the bytes on the
# measured link, cost_models/comm.zero_collectives) is FSDP2's own: per block (hooks, DTensor views, and one gloo
# all-gather and reduce-scatter per block, each paying the latency) and per parameter byte (copying into and out of
# the flat buffers, and gloo's all-gather / reduce-scatter moving bytes slower than its all-reduce: measured here
# ~3x the ring model's time). Two widths separate the two.
ZERO_BLOCKS, ZERO_TENSORS_PER_BLOCK, ZERO_WIDTHS = 8, 4, (64, 1024)


def zero_block_bytes(width: int) -> int:
    """fp32 parameter bytes of one probe block (Linear weight + bias, LayerNorm weight + bias)."""
    return 4 * (width * width + 3 * width)


def _lockstep_time(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of `fn` (collectives inside) over `reps` calls after one warm-up, every call started together
    on all ranks (a barrier before each): every rank must run the same `reps`."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def zero_probe(rank: int, world: int, budget: float) -> list[float]:
    """Seconds on this rank for the probe model: [fwd+bwd plain, fwd+bwd sharded] at each width, then [Adam plain,
    Adam sharded] at the narrow width."""
    from runtime.zero import apply_zero

    out: list[float] = []
    adams = []
    for width in ZERO_WIDTHS:
        torch.manual_seed(0)
        plain = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width)) for _ in range(ZERO_BLOCKS)]
        sharded = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width)) for _ in range(ZERO_BLOCKS)]
        apply_zero({str(i): m for i, m in enumerate(sharded)}, dist.group.WORLD, 2, torch.device("cpu"))
        x = torch.randn(16, width)
        reps = min(10, collective_iterations(ZERO_BLOCKS * zero_block_bytes(width), budget))  # the same on every rank
        for blocks in (plain, sharded):
            def step(blocks=blocks) -> None:
                y = x
                for m in blocks:
                    y = m(y)
                y.sum().backward()
            out.append(_lockstep_time(step, reps))
        if width == ZERO_WIDTHS[0]:
            adams = [torch.optim.Adam([p for m in blocks for p in m.parameters()], lr=1e-6) for blocks in (plain, sharded)]
    return out + [call_time(adam.step, budget / 2) for adam in adams]


def zero_costs(per_rank: list[list[float]], priced: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, float]:
    """(zero_block_s, zero_byte_s, zero_tensor_s) from the ranks' zero_probe results (medians over the ranks) and
    what the cost model prices the probe's collectives at, per width (`priced`): the per-block residual at the two
    widths as a + b x bytes per block; never < 0."""
    narrow_plain, narrow_sharded, wide_plain, wide_sharded, adam_plain, adam_sharded = (
        statistics.median(r[i] for r in per_rank) for i in range(6))
    narrow, wide = (max(0.0, (s - p - c) / ZERO_BLOCKS)
                    for p, s, c in ((narrow_plain, narrow_sharded, priced[0]), (wide_plain, wide_sharded, priced[1])))
    small, large = (zero_block_bytes(w) for w in ZERO_WIDTHS)
    per_byte = max(0.0, (wide - narrow) / (large - small))
    return (max(0.0, narrow - small * per_byte), per_byte,
            max(0.0, (adam_sharded - adam_plain) / (ZERO_BLOCKS * ZERO_TENSORS_PER_BLOCK)))


def zero_priced(link: Link, ranks: int) -> tuple[float, float]:
    """The cost model's time for the probe's collectives at each width: one all-gather and one reduce-scatter of
    all its parameter bytes over `ranks` (cost_models/comm.py)."""
    from cost_models.comm import all_gather_time, reduce_scatter_time

    return tuple(all_gather_time(b, ranks, link) + reduce_scatter_time(b, ranks, link)
                 for b in (ZERO_BLOCKS * zero_block_bytes(w) for w in ZERO_WIDTHS))

