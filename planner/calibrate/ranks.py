"""The measuring ranks of `mmplan calibrate` (launched as training ranks are) and what each one measures, in order."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from planner.calibrate.probes import (CONV_SHAPE, OPTIMIZER_POINTS, OPTIMIZER_POINTS_QUICK, OPTIMIZER_WARMUP,
                                      busy_gap, call_time, collective_iterations, expected)
from planner.calibrate.runtime_probes import median_time, slowdown_probe, zero_probe
from planner.calibrate.settings import Reporter, Settings
from planner.profiler.host_probe import host_probe
from plans.errors import MmplanError


def run_ranks(ranks: int, settings: Settings, report: Reporter, start_method: str) -> list[dict[str, Any]]:
    """The measuring ranks, launched by runtime/launch.py as training ranks are (file:// rendezvous, one thread
    each; the first failure, or the deadline, ends them all and names the root cause). Rank 0's progress comes
    back through a queue that a thread here forwards to `report`."""
    from runtime.launch import RankFailure, launch

    messages = mp.get_context(start_method).Queue()
    step = ["start"]

    def forward() -> None:
        try:
            while (item := messages.get()) is not None:
                _, _, step[0], fraction = item
                report(step[0], fraction)
        except (EOFError, OSError, ValueError):  # a rank killed mid-message: progress is best effort
            return

    forwarder = threading.Thread(target=forward, name="mmplan-calibrate-progress", daemon=True)
    forwarder.start()
    try:
        return launch(_rank_main, ranks, (settings, messages), backend="gloo", timeout_s=settings.deadline_s,
                      op_timeout_s=settings.timeout_s, start_method=start_method)
    except RankFailure as e:
        if e.rank is None:
            raise MmplanError(f"calibration timed out after {settings.deadline_s:g} s in step {step[0]}") from None
        cause = str(e).removeprefix(f"rank {e.rank} failed: ")
        raise MmplanError(f"calibration failed on rank {e.rank} in step {step[0]}: {cause}") from None
    finally:
        messages.put(None)  # after every rank's messages: the ranks flushed theirs before exiting
        forwarder.join(timeout=5)
        messages.close()
        messages.cancel_join_thread()  # a rank killed while writing may hold the queue's lock: never wait on it


def _rank_main(ctx: Any, payload: tuple[Settings, Any]) -> dict[str, list[float]]:
    """One rank (runtime.launch worker): measure, then flush the progress messages before the process exits."""
    settings, messages = payload
    try:
        return _rank_measure(ctx.rank, ctx.world_size, settings, messages)
    finally:
        messages.close()
        messages.join_thread()


def _rank_measure(rank: int, world: int, settings: Settings, messages: Any) -> dict[str, list[float]]:
    """Seconds per call for every point, the best of `settings.rounds` rounds (each a lower quartile)."""
    def progress(step: str, fraction: float) -> None:
        if rank == 0:
            messages.put(("progress", 0, step, fraction))

    out: dict[str, list[float]] = {}
    out["probe"] = list(slowdown_probe(rank, settings))  # [alone (rank 0), all ranks at once]
    _matmul_points(out, settings, progress)
    dist.barrier()
    _copy_points(out, settings, progress)
    dist.barrier()  # the optimizer step as `run` takes it: torch's Adam, every rank stepping at once
    _optimizer_points(out, settings, progress)

    dist.barrier()  # the host's work per op and per saved tensor, every rank at once
    out["host"] = list(host_probe(settings.point_budget_s * 8))
    progress("host", 1.0)

    dist.barrier()  # ZeRO's FSDP2 beyond its collectives, every rank at once
    out["zero"] = zero_probe(rank, world, settings.point_budget_s)
    progress("zero", 1.0)

    _collective_points(out, rank, world, settings, progress)
    _p2p_points(out, rank, settings, progress)
    dist.barrier()
    return out


def _keep(out: dict[str, list[float]], key: str, i: int, seconds: float) -> None:
    """Point `i` of `key`: the best (lowest) of the rounds so far."""
    values = out.setdefault(key, [])
    if i == len(values):
        values.append(seconds)
    else:
        values[i] = min(values[i], seconds)


def _matmul_points(out: dict, settings: Settings, progress: Callable[[str, float], None]) -> None:
    """fp32, bf16 and fp16 n x n matmuls and the convolution probe (CONV_SHAPE), every round."""
    budget = settings.point_budget_s
    rounds = range(settings.rounds)
    points = [("matmul", torch.float32, j, n) for j, n in enumerate(settings.matmul_sizes)]
    points += [("bf16", torch.bfloat16, j, n) for j, n in enumerate(settings.bf16_sizes)]
    points += [("fp16", torch.float16, j, n) for j, n in enumerate(settings.fp16_sizes)]
    progress("matmul", 0.0)
    for r in rounds:
        for i, (key, dtype, j, n) in enumerate(points):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            _keep(out, key, j, call_time(lambda: torch.mm(a, b), budget if key == "matmul" else budget / 2))
            progress("matmul", (r * len(points) + i + 1) / (len(points) * len(rounds)))
        x, w = torch.randn(CONV_SHAPE[:2] + (CONV_SHAPE[2],) * 2), torch.randn(CONV_SHAPE[1], CONV_SHAPE[1], 3, 3)
        _keep(out, "conv", 0, call_time(lambda: torch.nn.functional.conv2d(x, w, padding=1), budget / 2))


def _copy_points(out: dict, settings: Settings, progress: Callable[[str, float], None]) -> None:
    """Memory copies of `settings.copy_bytes`, every round (freed on return, before the collectives)."""
    budget = settings.point_budget_s
    rounds = range(settings.rounds)
    src = torch.ones(max(settings.copy_bytes), dtype=torch.uint8)  # allocated and paged in once; sizes are
    dst = torch.empty_like(src)                                     # prefixes of it
    for r in rounds:
        for i, nbytes in enumerate(settings.copy_bytes):
            to, frm = dst[:nbytes], src[:nbytes]
            _keep(out, "copy", i, call_time(lambda: to.copy_(frm), budget / 2))
            progress("memory", (r * len(settings.copy_bytes) + i + 1) / (len(settings.copy_bytes) * len(rounds)))


def _optimizer_points(out: dict, settings: Settings, progress: Callable[[str, float], None]) -> None:
    """torch's Adam step over (tensors, elements) points (OPTIMIZER_POINTS), every round, as `run` takes it: every
    rank stepping at once. After its warm-up each point starts on all ranks together (a barrier) and is the median
    of the calls in the same window of seconds (max(point budget, probe_s) / 2, the compute_slowdown probe's half
    turn: long beside the ranks' skew at the barrier), as runtime_probes.slowdown_probe times the sharing of the
    cores. The lower quartile of calls each rank timed on its own in a 20 ms budget was a rank stepping while the
    other did not: on the 2-vCPU development VM it fitted 17-20 us per tensor, where one Adam step over 286 tensors
    of 1,054 elements (the micro-batch demo's model) took 5.8-6.7 ms alone and 12.0-15.3 ms with both ranks
    stepping at once, and the demo's 2-rank runs spent 13.5-17.7 ms a step in their optimizer against 8.0 ms
    predicted."""
    window = max(settings.point_budget_s, settings.probe_s) / 2
    rounds = range(settings.rounds)
    points = OPTIMIZER_POINTS if settings.point_budget_s > 0.1 else OPTIMIZER_POINTS_QUICK
    for r in rounds:
        for i, (k, n) in enumerate(points):
            params = [torch.nn.Parameter(torch.randn(n)) for _ in range(k)]
            for p in params:
                p.grad = torch.randn(n)
            adam = torch.optim.Adam(params, lr=1e-3)
            for _ in range(OPTIMIZER_WARMUP):
                adam.step()
            dist.barrier()  # every rank steps for the same seconds from here: at once
            _keep(out, "optimizer", i, median_time(adam.step, window))
            progress("optimizer", (r * len(points) + i + 1) / (len(points) * len(rounds)))


def _collective_points(out: dict, rank: int, world: int, settings: Settings,
                       progress: Callable[[str, float], None]) -> None:
    """all-reduce, all-gather and reduce-scatter of every message size, each timed after a busy gap, every round."""
    from runtime.sequence_parallel import _reduce_scatter  # the runtime's reduce-scatter, whatever torch names it

    _all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the latter deprecated)

    budget = settings.point_budget_s
    rounds = range(settings.rounds)
    sizes = settings.message_bytes
    gap = busy_gap(rank)
    for r in rounds:
        for i, nbytes in enumerate(sizes):
            n = max(world, nbytes // 4 // world * world)  # float32 elements, a multiple of the ranks
            x, part = torch.ones(n), torch.empty(n // world)
            calls = {"all_reduce": lambda: dist.all_reduce(x),  # each on a tensor of `nbytes`: the reduced
                     "all_gather": lambda: _all_gather(x, part),  # input, the gathered
                     "reduce_scatter": lambda: _reduce_scatter(part, x)}  # result (cost_models/comm.py)
            for key, call in calls.items():
                dist.barrier()
                call()  # warm-up
                times = []
                for _ in range(collective_iterations(nbytes, budget)):
                    gap()
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                _keep(out, key, i, expected(times))
            progress("all-reduce", (r * len(sizes) + i + 1) / (len(sizes) * len(rounds)))


def _p2p_points(out: dict, rank: int, settings: Settings, progress: Callable[[str, float], None]) -> None:
    """send/recv ping-pongs between ranks 0 and 1 of every message size, every round."""
    budget = settings.point_budget_s
    rounds = range(settings.rounds)
    sizes = settings.message_bytes
    for r in rounds:
        for i, nbytes in enumerate(sizes):
            x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            dist.barrier()
            if rank < 2:  # ping-pong between ranks 0 and 1; one-way time = half a round trip
                peer = 1 - rank
                times = []
                for it in range(collective_iterations(nbytes, budget) + 1):
                    t0 = time.perf_counter()  # no busy gap: a pipeline's receiver waits in recv
                    if rank == 0:
                        dist.send(x, peer)
                        dist.recv(x, peer)
                    else:
                        dist.recv(x, peer)
                        dist.send(x, peer)
                    if it:  # the first round trip is the warm-up
                        times.append((time.perf_counter() - t0) / 2)
                _keep(out, "p2p", i, expected(times))
            progress("p2p", (r * len(sizes) + i + 1) / (len(sizes) * len(rounds)))
