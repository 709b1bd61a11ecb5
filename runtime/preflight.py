"""The runtime's checks of a plan before any rank starts: its model, precision, ranks, parallelism, ZeRO tiers, this host.

Each refusal is one sentence naming the plan file; none of them allocates more than the model on the meta device,
built and traced once here (`check_model`) and handed to the others.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plans.capabilities import ZERO_TIERS, zero_runs_with
from plans.errors import MmplanError
from plans.plan import Plan, check_plan
from plans.units import format_bytes
from runtime.precision import torch_dtype
from runtime.program import model_fingerprint, trace_program, traced_flow
from runtime.source import call_factory, is_factory, resolve
from runtime.tensor_parallel import check_tp, supports_tp

MAX_LOCAL_RANKS = 64  # beyond this a plan is for a real cluster: start it with torchrun
RANKS_PER_CORE = 4  # local ranks beyond this many per CPU core are refused (each is a process with its own model)
# A forked local rank's own memory besides the model it builds: 32 MB private dirty measured per rank of the
# tiny-vlm-pp2 example on CPU (/proc/self/smaps_rollup after 2 steps), doubled for margin.
RANK_OVERHEAD_BYTES = 64e6


@dataclass(frozen=True)
class CheckedModel:
    """The plan checked against its model: the plan (with its flow), the model spec, and the model built on the
    meta device with its example batch and traced program, for the other checks to reuse."""

    plan: Plan
    spec: str
    model: nn.Module
    example: dict[str, Any]
    program: Any
    sample_bytes: float  # bytes of one sample of the model's inputs
    model_bytes: float  # bytes of the whole model's parameters and buffers (every local rank builds it first)


def plan_model(plan: Plan, plan_path: Path) -> str:
    """The plan's model when it names no code: a zoo name or an architecture TOML. A plan file must not choose
    code to import and run, so a `package.module:factory` in it is used only when the user passes it as --model."""
    spec = plan.profile.model
    if is_factory(spec):
        raise MmplanError(f"plan {plan_path} names the Python factory {spec!r} as its model; a plan does not choose "
                          f"code to run: pass --model {spec} to run that factory")
    return spec


def backend(plan: Plan) -> str:
    """nccl for a GPU plan on a host with CUDA, else gloo."""
    if plan.cluster.backend == "nccl" and torch.cuda.is_available():
        return "nccl"
    return "gloo"


def check_model(plan: Plan, plan_path: Path, model: str | None) -> CheckedModel:
    """Build the model on the meta device (its floating-point tensors: MetaFloats) and trace it with torch.fx (no profiling analysis); refuse a model whose
    structural fingerprint differs from the plan's. A hand-written plan without a flow gets the traced one."""
    spec = model or plan_model(plan, plan_path)
    from runtime.fake_exec import MetaFloats

    with MetaFloats():  # parameters on meta, the batch's token ids real (a factory's own batch decides shapes)
        module, batch = call_factory(resolve(spec), 1)
    program = trace_program(module, batch)
    found = model_fingerprint(module, program)
    if found != plan.profile.fingerprint:
        raise MmplanError(
            f"plan {plan_path} was solved for model {plan.profile.model!r} with fingerprint {plan.profile.fingerprint}, "
            f"but {spec!r} builds a model with fingerprint {found} (another module tree or data flow): re-profile and re-solve")
    if plan.flow is None:  # a hand-written plan: the flow of the model it was just checked against
        plan = check_plan(replace(plan, flow=traced_flow(program, module)), None, f"plan {plan_path}")
    sample_bytes = sum(t[:1].numel() * t.element_size() for t in batch.values() if isinstance(t, torch.Tensor))
    model_bytes = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    return CheckedModel(plan, spec, module, batch, program, float(sample_bytes), float(model_bytes))


def check_runs(checked: CheckedModel, plan_path: Path) -> None:
    """What the runtime can run (plans/capabilities.py): precision, rank numbering, tensor parallelism (sequence
    parallelism runs on any sequence length: runtime/sequence_parallel.py pads it to a multiple of tp)."""
    check_precision(checked.plan, plan_path)
    check_rank_numbering(checked.plan, plan_path)
    check_tensor_parallel(checked.plan, checked.model, checked.example, plan_path)
    check_ties(checked.plan, checked.model, plan_path)


def check_ties(plan: Plan, model: nn.Module, plan_path: Path) -> None:
    """A parameter tied between blocks on different stages must sit where the runtime keeps its copies
    (plans/capabilities.tied_across_stages_refusal: the stages of one group; runtime/ties.py)."""
    from plans.capabilities import tied_across_stages_refusal
    from runtime.blocks import block_modules
    from runtime.ties import find_ties

    order = [b.name for b in plan.flow.blocks] if plan.flow is not None else []
    for tie in find_ties(block_modules(model), order):
        names = [b for b, _ in tie]
        holders = [(g.name, g.dp, g.tp) for g in plan.groups for st in g.stages if set(names).intersection(st.blocks)]
        why = tied_across_stages_refusal(names, holders)
        if why:
            raise MmplanError(f"plan {plan_path}: {why}")


def check_precision(plan: Plan, plan_path: Path) -> None:
    """The runtime trains fp32 and bf16 plans (runtime/precision.py); refuse another before any rank starts."""
    try:
        torch_dtype(plan.training.dtype)
    except MmplanError as e:
        raise MmplanError(f"plan {plan_path}: {e}") from None


def check_rank_numbering(plan: Plan, plan_path: Path) -> None:
    """The runtime starts one process per rank of the plan: the ranks must be 0..N-1 without gaps."""
    used = sorted({r for g in plan.groups for r in g.ranks})
    if used != list(range(len(used))):
        present = set(used)
        missing = [r for r in range(min(used[-1], len(used) + 8)) if r not in present]  # bounded: ranks may be huge
        raise MmplanError(f"plan {plan_path} uses ranks {_ranks(used)} but not {_ranks(missing)}; the runtime starts one "
                          f"process per rank of the plan, numbered 0..{len(used) - 1}: renumber its ranks without gaps")


def check_tensor_parallel(plan: Plan, model: nn.Module, example: dict[str, Any], plan_path: Path) -> None:
    """Every tensor-parallel block must shard exactly (tp divides its heads, kv heads and MLP width): checked on
    the model built on the meta device (no memory) before any rank starts, not by the ranks mid-setup."""
    sharded = [(g, b) for g in plan.groups if g.tp > 1 for b in g.blocks]
    if not sharded:
        return
    for g, b in sharded:
        block = model.get_submodule(b)
        if supports_tp(block):
            try:
                check_tp(block, g.tp)
            except MmplanError as e:
                raise MmplanError(f"plan {plan_path}: group {g.name!r} has tp={g.tp}, which block {b} cannot use: {e}") from None


def check_zero(plan: Plan, plan_path: Path) -> None:
    """ZeRO runs on FSDP2 (runtime/zero.py): only the memory tiers it can hold (plans/capabilities.zero_runs_with)."""
    for g in plan.groups:
        if not g.zero:
            continue
        for i, st in enumerate(g.stages):
            m = st.memory
            if not zero_runs_with(m.params, m.grads, m.optimizer):
                raise MmplanError(f"plan {plan_path}: group {g.name} stage {i} uses ZeRO stage {g.zero} with parameters in "
                                  f"{m.params!r}, gradients in {m.grads!r} and optimizer state in {m.optimizer!r}; "
                                  f"{ZERO_TIERS}: set zero=0 or change the tiers")


def check_zero_shares(checked: CheckedModel, plan_path: Path, data: str | None) -> None:
    """Under ZeRO, a data-parallel share of a micro-batch whose samples have no image leaves the blocks that read
    the images idle on its rank, while FSDP2 runs their collectives on the others: refused (runtime/forward_program.py
    refuses it on the rank, at its step, for any data). The built-in synthetic data is known here: sample i takes
    template i mod T (runtime/synthetic.py), so the first T steps hold every share there is."""
    from plans.stage_graph import slice_of
    from runtime.hf import data_example
    from runtime.rank import vocab_of
    from runtime.synthetic import DerivedDataset
    from runtime.train import step_samples

    plan, program = checked.plan, checked.program
    groups = [g for g in plan.groups if g.zero and g.dp > 1]
    if not groups or data is not None or not hasattr(program, "no_rows"):
        return
    example = data_example(checked.spec, plan.training.micro_batch, checked.example)
    if example is checked.example:
        return  # the traced example's samples, each of which runs every block (samples.check_traceable)
    dataset = DerivedDataset(example, vocab_of(checked.model), 0)
    for g in groups:
        mb = plan.micro_batch_of(g)
        blocks = [b for st in g.stages for b in st.blocks]
        for step in range(len(dataset.templates)):
            for j in range(plan.training.global_batch // mb):
                for r in range(g.dp):
                    samples = step_samples(step, plan, j, *slice_of(r, g.dp, mb), mb)
                    if any(dataset.has_rows(i) for i in samples):
                        continue
                    batch = dataset.sample_batch(samples)
                    rows = program.batch_rows(batch)
                    idle = [b for b in blocks if program.no_rows(b, len(samples), rows)]
                    if idle:
                        raise MmplanError(
                            f"plan {plan_path}: group {g.name} runs ZeRO-{g.zero} over dp={g.dp}, but replica {r}'s share "
                            f"of micro-batch {j} of step {step} (samples {samples.start}..{samples.stop - 1}) has no image, "
                            f"so {idle[0]} would run on nothing there while FSDP2 runs its collectives on the others: use "
                            "zero 0 for the group, or data in which every share of a micro-batch has an image")


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what joining a job reads (env:// rendezvous)
LAUNCHER_VAR = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent for every process it starts


@dataclass(frozen=True)
class TorchrunJob:
    """The torchrun job this process is one rank of."""

    rank: int
    world: int
    master: str  # ADDR:PORT
    run_id: str

    def describe(self) -> str:
        return f"torchrun job {self.run_id}: rank {self.rank} of {self.world}, master {self.master}"


def torchrun_job(environ: Any = None) -> TorchrunJob | None:
    """The torchrun job that launched this process, None when none did. Stray variables are refused in one line
    instead of waiting up to --op-timeout for ranks that never come (issue 30): some of torchrun's variables set
    without the others, or all of them without torchrun's agent (TORCHELASTIC_RUN_ID; another launcher that sets
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT itself sets it too, to any job id)."""
    env = os.environ if environ is None else environ
    present = [v for v in (*TORCHRUN_VARS, "LOCAL_RANK") if v in env]
    if not present:
        return None
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing or LAUNCHER_VAR not in env:
        why = f"not {', '.join(missing)}" if missing else f"no torchrun launched this process ({LAUNCHER_VAR} is unset)"
        raise MmplanError(f"the environment sets {', '.join(f'{v}={env[v]}' for v in present)} but {why}: these are "
                          "torchrun's variables, and this process would wait as one rank of a job that is not there; unset "
                          f"them to run the plan's ranks here, or start it with torchrun (another launcher: set {LAUNCHER_VAR} too)")
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        raise MmplanError(f"the environment variables RANK={env['RANK']!r}, WORLD_SIZE={env['WORLD_SIZE']!r} are not "
                          "numbers of ranks") from None
    if not 0 <= rank < world:
        raise MmplanError(f"the environment sets RANK={rank} outside WORLD_SIZE={world}")
    return TorchrunJob(rank, world, f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", env[LAUNCHER_VAR])


def launched_world_size() -> int | None:
    """WORLD_SIZE of a torchrun launch, None when not launched by one (stray variables refused: torchrun_job)."""
    job = torchrun_job()
    return job.world if job else None


def check_launch(plan: Plan, plan_path: Path, launched: int | None) -> None:
    """A torchrun job of the plan's size, or local ranks this host can start."""
    if launched is not None:
        if launched != plan.world_size:
            raise MmplanError(f"the plan needs {plan.world_size} ranks but this job was launched with {launched}")
    else:
        check_host_ranks(plan, plan_path)


def check_host_ranks(plan: Plan, plan_path: Path) -> None:
    """A local run starts one process per rank here: refused when this host cannot hold that many (more ranks than
    CUDA devices for an nccl plan on a GPU host; more than RANKS_PER_CORE per CPU core or MAX_LOCAL_RANKS on CPU)."""
    world, cluster = plan.world_size, plan.cluster
    if backend(plan) == "nccl":
        limit, what = torch.cuda.device_count(), "one per CUDA device"
    else:
        limit, what = min(MAX_LOCAL_RANKS, RANKS_PER_CORE * (os.cpu_count() or 1)), f"{RANKS_PER_CORE} per CPU core"
    if world > limit:
        raise MmplanError(f"plan {plan_path} is for cluster {cluster.name} ({world} ranks), but {_host()} runs at most "
                          f"{limit} local ranks ({what}); {_torchrun_hint(plan)}")


def check_host_memory(checked: CheckedModel, plan_path: Path, state_bytes: float) -> None:
    """A local run must fit this machine: the ranks' training state and activations (`state_bytes`: the cost model's
    prediction, summed over ranks), each rank's own process and the whole model it builds first, plus the input
    samples of two steps (the data loader builds the next step ahead), refused before any rank allocates them (a
    global batch may be 16 M samples)."""
    plan = checked.plan
    available = _available_memory()
    if available is None:
        return
    data = 2 * plan.training.global_batch * checked.sample_bytes
    ranks = plan.world_size * (RANK_OVERHEAD_BYTES + checked.model_bytes)
    if data + state_bytes + ranks > available:
        raise MmplanError(f"plan {plan_path} is for cluster {plan.cluster.name} ({plan.world_size} ranks) and needs about "
                          f"{format_bytes(data + state_bytes + ranks)} of memory to run locally ({format_bytes(state_bytes)} "
                          f"for its ranks' state and activations, {format_bytes(ranks)} for {plan.world_size} rank processes "
                          f"that each build the model, {format_bytes(data)} for the input samples of two steps of "
                          f"{plan.training.global_batch:,}), but {_host()}; lower the global batch, or "
                          f"{_torchrun_hint(plan)}")


def _host() -> str:
    """This machine in a few words, for refusals: name, CPU cores, CUDA devices, available memory."""
    import socket

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = _available_memory()
    memory = f", {format_bytes(available)} memory available" if available is not None else ""
    return f"this host ({socket.gethostname()}: {os.cpu_count() or 1} CPU cores, {gpus} CUDA devices{memory})"


def _torchrun_hint(plan: Plan) -> str:
    c = plan.cluster
    return (f"start it on its cluster with torchrun, one process per GPU: torchrun --nnodes {c.nodes} --nproc-per-node "
            f"{c.gpus_per_node} -m planner.cli run PLAN")


def available_memory() -> float | None:
    """This machine's memory available to a new process, in bytes (None where unknown)."""
    return _available_memory()


def _available_memory() -> float | None:
    """MemAvailable + SwapFree from /proc/meminfo, in bytes (None where unknown)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return sum(float(fields[k].split()[0]) * 1024 for k in ("MemAvailable", "SwapFree") if k in fields) or None
    except (OSError, ValueError):
        return None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
