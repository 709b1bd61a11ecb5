"""Timing on a real device: each distinct block alone, the whole model in context, and the threads they run with."""
from __future__ import annotations

import copy
import statistics
import time
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from plans.errors import MmplanError
from planner.profiler.analyse import scalar_loss
from planner.profiler.records import TensorSpec


def _materialise(module: nn.Module, device: torch.device) -> nn.Module:
    """A real copy of one block on `device` (random weights when the model was built on meta)."""
    block = copy.deepcopy(module)
    if any(t.device.type == "meta" for t in (*block.parameters(), *block.buffers())):
        block = block.to_empty(device=device)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
            for b in block.buffers():
                b.zero_()
        return block
    return block.to(device)


def _make_inputs(in_spec: Any, device: torch.device, batch_scale: int = 1) -> tuple[tuple, dict]:
    """Random inputs of the recorded shapes; batch_scale multiplies dim 0 (the batch) of every tensor."""
    leaves, spec = in_spec
    out = []
    for x in leaves:
        if isinstance(x, TensorSpec):
            if batch_scale != 1 and x.shape:
                x = TensorSpec((x.shape[0] * batch_scale, *x.shape[1:]), x.dtype, x.requires_grad)
            if x.value is not None and tuple(x.value.shape) == x.shape:
                t = x.value.to(device)
            elif x.dtype.is_floating_point:
                t = torch.randn(x.shape, dtype=x.dtype, device=device).requires_grad_(x.requires_grad)
            elif x.dtype == torch.bool:
                t = torch.ones(x.shape, dtype=x.dtype, device=device)
            else:
                t = torch.zeros(x.shape, dtype=x.dtype, device=device)
            out.append(t)
        else:
            out.append(x)
    args, kwargs = spec.unflatten(out)
    return args, kwargs


def measure_block(module: nn.Module, in_spec: Any, device: torch.device, reps: int = 5,
                  batch_scale: int = 1) -> tuple[float, float]:
    """Forward and backward milliseconds of one block on a real device: the best of `reps` (noise on a shared
    machine only ever adds time, and these times serve as proportions, see _in_context)."""
    block = _materialise(module, device)
    args, kwargs = _make_inputs(in_spec, device, batch_scale)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    for i in range(reps + 2):  # two warm-up repetitions
        sync()
        t0 = time.perf_counter()
        out = block(*args, **kwargs)
        sync()
        t1 = time.perf_counter()
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        sync()
        t2 = time.perf_counter()
        if i >= 2:
            fwd.append((t1 - t0) * 1e3)
            bwd.append((t2 - t1) * 1e3)
        del out, outs
        for p in (*block.parameters(), *(a for a in args if isinstance(a, torch.Tensor))):
            p.grad = None
    return min(fwd), min(bwd)


def _in_context(timings: dict, records: list, model: nn.Module, batch: dict[str, Any], device: torch.device,
                micro_batch: int, reps: int) -> tuple[dict, float]:
    """Fit the blocks' isolated times to the whole model's measured forward + backward, at the micro-batch and at
    twice it (an affine fit in the batch: a fixed part per call and a part per sample). Each block keeps the fixed
    part and the per-sample part it showed alone, both scaled so that the blocks add up to the whole model at both
    batches (`_affine_fit`): a host-bound block (a narrow layer dispatching the same ops whatever its batch) keeps
    its flat time beside a compute-bound one (a large vocabulary head) that grows with the batch, which is what
    choosing a micro-batch per group hinges on. Where the isolated parts cannot be fitted (no fixed or no per-sample
    part left after the scaling), the whole model's time and slope are spread in proportion to the isolated times
    instead. Also returns the relative spread of the whole-model time (measure_model)."""
    doubled = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
    (at_1, spread), (at_2, _) = measure_model(model, [batch, doubled], device, reps)
    slope = max(at_2 - at_1, 0.0) / micro_batch  # ms per extra sample, whole model
    count: dict[str, int] = {}
    for r in records:
        count[r.signature] = count.get(r.signature, 0) + 1
    fitted = _affine_fit(timings, count, at_1, slope, micro_batch)
    if fitted is not None:
        return fitted, spread
    total = sum(timings[r.signature][0] + timings[r.signature][1] for r in records)
    out = {}
    for key, (f, b, *_rest) in timings.items():
        share = (f + b) / total if total > 0 else 0.0
        fwd_part = f / (f + b) if f + b > 0 else 0.5
        out[key] = (share * at_1 * fwd_part, share * at_1 * (1 - fwd_part),
                    share * slope * fwd_part, share * slope * (1 - fwd_part))
    return out, spread


def _affine_fit(timings: dict, count: dict[str, int], at_1: float, slope: float, micro_batch: int) -> dict | None:
    """Block timings (fwd ms, bwd ms at `micro_batch`; fwd, bwd ms per extra sample) fitted to the whole model's
    `at_1` ms at the micro-batch and `slope` ms per extra sample: block i alone took a_i + s_i x b at b samples
    (a_i = its time at the micro-batch less micro_batch x its slope, both parts >= 0); in context it is taken as
    alpha x a_i + beta x s_i x b, with the one alpha and the one beta that make the blocks (each distinct block times
    its `count`) add up to the whole model at both batches. None when there is no fixed or no per-sample part to
    scale, or the fit needs a negative alpha (the whole model's slope exceeds its time: noise)."""
    parts = {}
    for key, (f, b, fs, bs) in timings.items():
        fs, bs = max(fs, 0.0), max(bs, 0.0)
        fs, bs = min(fs, f / micro_batch), min(bs, b / micro_batch)  # a slope above the time would leave a < 0
        parts[key] = (f - fs * micro_batch, b - bs * micro_batch, fs, bs)
    fixed = sum(count.get(k, 0) * (fa + ba) for k, (fa, ba, _, _) in parts.items())
    per_sample = sum(count.get(k, 0) * (fs + bs) for k, (_, _, fs, bs) in parts.items())
    if fixed <= 0 or per_sample <= 0:
        return None
    beta = slope / per_sample
    alpha = (at_1 - beta * per_sample * micro_batch) / fixed
    if alpha <= 0:
        return None
    return {k: (alpha * fa + beta * fs * micro_batch, alpha * ba + beta * bs * micro_batch, beta * fs, beta * bs)
            for k, (fa, ba, fs, bs) in parts.items()}


# measure_model: repetitions per round, the most rounds, and the change of the median between two rounds below
# which it counts as stable (other jobs on a shared machine come and go: a single short round can be off by 2x)
ROUND_REPS, MAX_ROUNDS, STABLE = 3, 8, 0.03


def measure_model(model: nn.Module, batches: list[dict[str, Any]], device: torch.device,
                  reps: int = ROUND_REPS) -> list[tuple[float, float]]:
    """(median milliseconds, relative spread) of one forward + backward of the whole model (glue, caches and all)
    for each batch. The batches are timed in alternation, `reps` each per round, so that a change of load hits
    them alike (their difference is the batch slope); rounds repeat until every batch's median over all rounds
    moves by less than STABLE from one round to the next (at most MAX_ROUNDS). Spread = interquartile range /
    median."""
    model = model.to(device)
    batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once(batch: dict[str, Any]) -> float:
        sync()
        t0 = time.perf_counter()
        scalar_loss(model(**batch)).backward()
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        model.zero_grad(set_to_none=True)
        return ms

    for batch in batches:  # warm-up
        once(batch)
        once(batch)
    times: list[list[float]] = [[] for _ in batches]
    previous: list[float] | None = None
    for _ in range(MAX_ROUNDS):
        for _ in range(max(1, reps)):
            for i, batch in enumerate(batches):
                times[i].append(once(batch))
        medians = [statistics.median(t) for t in times]
        if previous is not None and all(abs(m - p) <= STABLE * p for m, p in zip(medians, previous)):
            break
        previous = medians
    out = []
    for t in times:
        q = statistics.quantiles(t, n=4) if len(t) >= 2 else [t[0]] * 3
        median = statistics.median(t)
        out.append((median, (q[2] - q[0]) / median if median > 0 else 0.0))
    return out


def profiled_model_ms(profile) -> float | None:
    """The whole model's forward + backward at the profile's micro-batch as the profile measured it: its blocks'
    measured times add up to it (_in_context fits them so). None when a block has no measured time (a meta profile,
    or one measured on a GPU, where the whole model is not timed)."""
    if not profile.blocks or any(b.fwd_ms is None or b.bwd_ms is None for b in profile.blocks):
        return None
    return sum(b.fwd_ms + b.bwd_ms for b in profile.blocks)


def machine_speed(source, profile, reps: int = ROUND_REPS) -> float | None:
    """How much longer (> 1) or shorter the model's forward + backward takes in this process now than when it was
    profiled: measure_model again, as the profile did (the ranks' threads, its micro-batch and dtype), over
    profiled_model_ms. A shared machine's speed drifts between the profile and a run minutes later, and a
    prediction made from the profile drifts with it. None for a profile without whole-model times on the CPU."""
    from planner.profiler.analyse import cast_model
    from planner.profiler.profile import DTYPES
    from runtime.source import call_factory

    then = profiled_model_ms(profile)
    if then is None or then <= 0 or profile.measured_on != "cpu":
        return None
    with rank_threads("cpu"):
        model, batch = call_factory(source, profile.micro_batch)
        batch = cast_model(model, batch, DTYPES[profile.dtype])
        (now, _spread), = measure_model(model, [batch], torch.device("cpu"), reps)
    return now / then


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@contextmanager
def rank_threads(device: str):
    """On the CPU, time as `mmplan run`'s ranks run: with the torch threads it gives each rank
    (runtime.launch.RANK_THREADS; the caller's setting is restored afterwards) and keeping freed memory in the
    process (runtime.host_memory, which stays in force). Yields the number of threads the measurement runs with."""
    from runtime.host_memory import keep_freed_memory
    from runtime.launch import RANK_THREADS

    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(RANK_THREADS)
        keep_freed_memory()
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def measure_blocks(records, model, batch, device, micro_batch, reps, fake, note) -> tuple[dict, float]:
    """Block timings (profile_model's `measure`) and the relative spread of the whole-model time (0 on cuda)."""
    timings: dict[str, tuple[float, ...]] = {}
    spread = 0.0
    target = torch.device(device)
    distinct = list({r.signature: r for r in records}.values())
    for i, rec in enumerate(distinct):
        note(f"measuring {rec.name}", 0.3 + 0.7 * i / len(distinct))
        try:
            f1, b1 = measure_block(rec.module, rec.in_spec, target, reps)
        except Exception as e:  # one line naming the block, never a traceback
            raise MmplanError(f"--measure: block {rec.name} ({type(rec.module).__name__}) fails alone on random inputs of "
                              f"its profiled shapes: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        try:
            f2, b2 = measure_block(rec.module, rec.in_spec, target, reps, batch_scale=2)
        except Exception:  # integer inputs that describe the batch (cu_seqlens) do not double: proportional
            f2, b2 = 2 * f1, 2 * b1
        timings[rec.signature] = (f1, b1, (f2 - f1) / micro_batch, (b2 - b1) / micro_batch)
    if not fake:  # the whole model is on the device: fit the block times to the in-context times
        timings, spread = _in_context(timings, records, model, batch, torch.device(device), micro_batch, reps)
    return timings, spread

