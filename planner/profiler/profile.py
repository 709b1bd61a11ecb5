"""The profiling pass: runs the real model once and records blocks, FLOPs, saved activations and data flow.

How each figure is obtained (one forward + backward of the model at `micro_batch`):
- blocks: elements of every nn.ModuleList/Sequential, plus each maximal submodule holding no such container;
  blocks that never run in the forward are dropped;
- FLOPs: torch.utils.flop_counter's per-op formulas, counted by a dispatch mode; a forward op counts for the
  block running, a backward op for the block whose forward created its autograd node (known from the node's
  sequence number: each block's forward creates a contiguous range of them);
- activation bytes: saved_tensors_hooks attribute every storage autograd saves to the block running
  (parameters and buffers excluded, each storage counted once, for the first block that saves it;
  tensors saved by glue code between blocks count for the last block that ran);
- edges: a TorchFunctionMode propagates, through the glue code between blocks, which block outputs each
  tensor derives from; a block's inputs then name the blocks (and batch inputs) that feed it.
With `measure`, each distinct block is timed alone on the device at the micro-batch and at twice it (an
affine fit: small blocks are overhead-bound); when the whole model is on the device (`device="cpu"`) the
whole model's forward + backward is measured too, at both batch sizes, and spread over the blocks in
proportion to their isolated times — what a block costs in context (caches, glue), not in a tight loop.
On `device="meta"` the model is built on the meta device and run on FakeTensors with CPU dispatch, so no
memory is allocated and the kernels (hence FLOPs and saved tensors) are exactly those a real CPU run uses.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable, Literal

import torch

from runtime.fake_exec import MetaFloats
from runtime.samples import check_traceable
from runtime.source import ModelSource, call_factory, model_dtype
from plans.errors import MmplanError
from plans.graph import Profile, ProfileOptions
from plans.limits import MAX_BLOCKS
from planner.profiler.analyse import analyse, cast_model
from planner.profiler.assemble import adopted_parameters, assemble, token_vocab
from planner.profiler.blocks import auto_groups, check_overrides, discover_blocks, freeze_blocks
from planner.profiler.measure import device_name, measure_blocks, rank_threads
from planner.profiler.shape import model_shapes

Device = Literal["meta", "cpu", "cuda"]
Progress = Callable[[str, float], None]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def profile_model(
    source: ModelSource,
    *,
    micro_batch: int = 1,
    device: Device = "meta",
    dtype: str | None = None,
    measure: bool = False,
    groups: list[tuple[str, str]] = (),
    reps: int = 5,
    progress: Progress | None = None,
    freeze: Sequence[str] = (),
    fused: bool = True,
    softmax_grad_in_memory: bool = False,
) -> Profile:
    """Profile a model: see the module docstring for what is measured and how. `fused=False` counts memory-bound
    traffic as eager PyTorch moves it (Trace.fuse; bench/fidelity_bench.py's Hugging Face rows);
    `softmax_grad_in_memory=True`, the softmax backward as a kernel of its own reading its incoming gradient from
    memory (Megatron-LM's separate attention-dropout kernel: Trace.fuse; the bench's Megatron rows)."""
    note = progress or (lambda step, frac: None)
    if micro_batch < 1:
        raise MmplanError(f"--micro-batch must be >= 1, got {micro_batch}")
    dtype = dtype or source.default_dtype
    if dtype is not None and dtype not in DTYPES:
        raise MmplanError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MmplanError("--device cuda: no CUDA device is available here (use --device meta or cpu)")
    if measure and device == "meta":
        raise MmplanError("--measure needs a real device: add --device cpu or --device cuda")
    fake = device != "cpu"  # cuda: analyse on fake tensors (the model may not fit), measure blocks on the GPU
    if not fake:
        _check_host_memory(source, micro_batch, dtype)
    note("building model", 0.0)
    with MetaFloats() if fake else nullcontext():  # parameters on meta; token ids real (runtime/fake_exec.py)
        model, batch = call_factory(source, micro_batch)
    if dtype is None:  # a factory: profiled in its model's dtype (a transformers config's, as hf: does)
        dtype, where = model_dtype(model)
        note(f"profiling in {dtype} ({where}; --dtype to change)", 0.05)
    batch = cast_model(model, batch, DTYPES[dtype])
    freeze_blocks(model, freeze, source.name)
    blocks = len(discover_blocks(model))
    if blocks > MAX_BLOCKS:  # before the trace, whose time and the solver's grow with them
        raise MmplanError(f"{source.name} has {blocks:,} blocks, more than the {MAX_BLOCKS:,} mmplan plans for")
    note("tracing forward and backward", 0.1)
    check_traceable(batch, f"profiling {source.name}")
    try:
        records, trace = analyse(model, batch, fake=fake, fused=fused, softmax_grad_in_memory=softmax_grad_in_memory)
    except MmplanError:
        raise
    except Exception as e:
        raise MmplanError(f"profiling {source.name} failed in its forward/backward: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    timings: dict[str, tuple[float, ...]] = {}
    spread, threads = 0.0, 0
    if measure:
        with rank_threads(device) as threads:
            timings, spread = measure_blocks(records, model, batch, device, micro_batch, reps, fake, note)
    note("done", 1.0)
    options = ProfileOptions(groups=tuple(tuple(g) for g in groups), device=device, measure=measure, freeze=tuple(freeze),
                             threads=threads)
    auto = auto_groups(records, trace)
    check_overrides(groups, [r.name for r in records], auto)
    profile = assemble(source.name, dtype, micro_batch, records, trace, groups, timings,
                       device_name(torch.device(device)) if measure else None, options, auto,
                       adopted=adopted_parameters(model, batch, records))
    profile = replace(profile, shapes=model_shapes(model, records, {b.name: b.group for b in profile.blocks}, token_vocab(records)))
    profile = replace(profile, measure_spread=round(spread, 4)) if measure else profile
    return written_as_read(profile, source.name)


def written_as_read(profile: Profile, name: str) -> Profile:
    """The profile as `show` and `solve` will read it back (schema, names, edges, no cycle, fingerprint): a profile
    they would refuse is an error here, naming what is wrong, rather than a file written with exit code 0."""
    from plans.errors import FormatError
    from plans.graph import profile_from_data
    from plans.serial import to_data

    try:
        profile_from_data(to_data(profile), f"the profile of {name}")
    except FormatError as e:
        raise MmplanError(f"{e} (a profiler defect: please report it with the model)") from None
    return profile



def _check_host_memory(source: ModelSource, micro_batch: int, dtype: str) -> None:
    """A real CPU profile holds the model's parameters and their gradients in this process: counted on the meta
    device (no memory) and refused before the build when they exceed the memory available (a real-size model died
    after 154 s with the allocator's error, issue 30)."""
    from plans.units import format_bytes
    from runtime.preflight import available_memory

    available = available_memory()
    if available is None:
        return
    with torch.device("meta"):
        model, _ = call_factory(source, micro_batch)
    # a factory without --dtype is profiled in its own parameters' dtype
    params = sum(p.numel() * (DTYPES[dtype].itemsize if dtype else p.element_size()) for p in model.parameters())
    need = 2 * params + sum(b.numel() * b.element_size() for b in model.buffers())
    if need > available:
        raise MmplanError(f"profiling {source.name} on --device cpu needs at least {format_bytes(need)} for its parameters "
                          f"and their gradients, but this machine has {format_bytes(available)} available; profile it with "
                          "--device meta (no memory: FLOPs and saved activations are the same) or on a larger machine")
