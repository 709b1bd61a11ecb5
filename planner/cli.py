"""The `mmplan` command line: thin typer commands forwarding to one core function each."""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Callable, Literal, Optional

import typer

from planner import console
from plans.errors import MmplanError

app = typer.Typer(
    name="mmplan",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
    help="Plan and run parallel training of multimodal models.\n\n"
         "[bold]profile[/] a model -> [bold]solve[/] for a cluster -> [bold]run[/] the plan -> [bold]compare[/] plans offline.",
)


def version() -> str:
    """mmplan's version: the installed distribution's, else pyproject.toml's beside the sources."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("mmplan")
    except PackageNotFoundError:
        import tomllib

        try:
            return tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
        except (OSError, KeyError, ValueError):
            return "unknown"


def _print_version(value: bool) -> None:
    if value:
        print(f"mmplan {version()}")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print mmplan's version and exit.")] = False,
) -> None:
    from planner.torch_cache import remove_at_exit_if_made_here

    remove_at_exit_if_made_here()  # torch's empty inductor cache directory left in $TMPDIR


def user_errors(fn: Callable) -> Callable:
    """Turn MmplanError (and unwritable paths) into one line on stderr and exit code 2; SIGTERM and SIGHUP stop
    the command like Ctrl-C (its cleanup runs: ranks killed, temporary files removed) with one line and 128+signal."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from runtime.signals import Terminated, terminate_like_interrupt

        try:
            with terminate_like_interrupt():
                return fn(*args, **kwargs)
        except Terminated as e:
            console.fail(f"terminated by {e}")
            raise typer.Exit(code=e.exit_code) from None
        except MmplanError as e:
            console.fail(str(e))
            raise typer.Exit(code=2) from None
        except OSError as e:  # the file system refused a path the user gave: a name too long, a file as directory
            console.fail(f"cannot use {e.filename}: {e.strerror or e}" if e.filename else f"{e.strerror or e}")
            raise typer.Exit(code=2) from None
        except KeyboardInterrupt:
            console.fail("interrupted")
            raise typer.Exit(code=130) from None

    return wrapper


def check_writable(path: Path, option: str = "output path") -> None:
    """Fail before any work when the output cannot be written (nothing is left behind) or is not a regular file."""
    from plans.serial import refuse_non_regular

    parent = path.parent if str(path.parent) else Path(".")
    refuse_non_regular(path, option)
    try:
        if parent.exists() and not parent.is_dir():
            raise MmplanError(f"cannot write {path}: {parent} is a file, not a directory")
        if not parent.is_dir():
            raise MmplanError(f"cannot write {path}: directory {parent} does not exist")
        # the temporary file plans.serial.write_atomic will write, by the same pattern (so a name too long fails now)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.tmp-")
    except OSError as e:
        raise MmplanError(f"cannot write {path}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def check_not_input(output: Path, option: str, inputs: list) -> None:
    """Refuse an output path that is one of the command's input files (the same file, through any link)."""
    for inp in inputs:
        if inp is None:
            continue
        try:
            same = output.exists() and Path(inp).exists() and os.path.samefile(output, inp)
        except (OSError, ValueError):
            same = False
        if same:
            raise MmplanError(f"{option} {output} is the input file {inp}; writing it would replace that input: choose another path")


@app.command()
@user_errors
def profile(
    model: Annotated[str, typer.Argument(help="Zoo name (e.g. [cyan]tiny-vlm[/], [cyan]llava-1.5-7b[/]), an architecture [cyan].toml[/], or [cyan]package.module:factory[/].")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the profile.")] = Path("profile.json"),
    micro_batch: Annotated[int, typer.Option(help="Batch size to profile at; figures are stored per sample.")] = 1,
    device: Annotated[str, typer.Option(help="[cyan]meta[/]: no memory, fake tensors (any size); [cyan]cpu[/]/[cyan]cuda[/]: real tensors.")] = "meta",
    dtype: Annotated[Optional[str], typer.Option(help="fp32 | bf16 | fp16 (default: the model's, bf16 for real-size zoo models).")] = None,
    measure: Annotated[bool, typer.Option(help="Time forward/backward of each distinct block on --device (cpu or cuda).")] = False,
    group: Annotated[Optional[list[str]], typer.Option(help="Override module groups: PATTERN=GROUP (fnmatch on block names, repeatable).")] = None,
    freeze: Annotated[Optional[list[str]], typer.Option(help="Freeze the blocks matching PATTERN (fnmatch on block names, repeatable): not trained, no gradients or optimizer state.")] = None,
    kernels: Annotated[str, typer.Option(help="Saved activations of the transformer layers: [cyan]eager[/] as measured (mmplan's runtime), [cyan]fused[/] as TransformerEngine / flash attention keep them (counted per op from each group's shape).")] = "eager",
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
) -> None:
    """Profile a model: module dependency graph, per-block FLOPs, params, saved activations, data flow."""
    from runtime.source import resolve
    from planner.profiler.blocks import parse_group_overrides
    from planner.profiler.profile import profile_model
    from cost_models.fused import KERNELS, with_kernels
    from plans.graph import save_profile

    if device not in ("meta", "cpu", "cuda"):
        raise MmplanError(f"--device must be meta, cpu or cuda, got {device!r}")
    if micro_batch < 1:  # refusals that need no model, before the model is resolved or built (issue 30)
        raise MmplanError(f"--micro-batch must be >= 1, got {micro_batch}")
    if measure and device == "meta":
        raise MmplanError("--measure needs a real device: add --device cpu or --device cuda")
    if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
        raise MmplanError(f"unknown dtype {dtype!r}; choose one of fp32, bf16, fp16")
    if kernels not in KERNELS:
        raise MmplanError(f"--kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    check_writable(output, "--output")
    check_not_input(output, "--output", [Path(model)] if model.endswith(".toml") else [])
    groups = parse_group_overrides(group or [])
    source = resolve(model)
    with console.progress(f"profiling {source.name}", enabled=not quiet and not as_json) as note:
        prof = profile_model(source, micro_batch=micro_batch, device=device, dtype=dtype, measure=measure,
                             groups=groups, progress=note, freeze=freeze or [])
    prof = with_kernels(prof, kernels)
    save_profile(prof, output)
    if as_json:
        print(json.dumps({"profile": str(output), "model": prof.model, "fingerprint": prof.fingerprint,
                          "blocks": len(prof.blocks), "groups": list(prof.groups),
                          "params": sum(b.params for b in prof.blocks), "measured_on": prof.measured_on}))
    elif not quiet:
        from planner.profiler.show import render_profile

        render_profile(prof, console.out)
        console.out.print(f"wrote [bold]{console.safe(output)}[/]", soft_wrap=True, markup=True)


@app.command()
@user_errors
def show(
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="A profile.json written by [cyan]mmplan profile[/].")],
    top: Annotated[int, typer.Option(help="How many of the largest blocks to list.")] = 5,
) -> None:
    """Summarise a profile: per-group params, FLOPs and activations, the largest blocks, edges between groups."""
    from planner.profiler.show import render_profile
    from plans.graph import load_profile

    if top < 0:
        raise MmplanError(f"--top must be >= 0, got {top}")
    render_profile(load_profile(profile_path), console.out, top=top)


def _given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among `names` the user set on the command line (not left at their defaults), as --flags."""
    out = []
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            off = ctx.params.get(name) is False  # a --flag / --no-flag option set to its --no- side
            out.append("--" + ("no-" if off else "") + name.replace("_", "-"))
    return out


@app.command()
@user_errors
def solve(
    ctx: typer.Context,
    profile_path: Annotated[Path, typer.Argument(metavar="PROFILE", help="A profile.json written by [cyan]mmplan profile[/].")],
    cluster: Annotated[str, typer.Option(help="[cyan]64xh100-sxm[/], [cyan]4xlocal-cpu[/] (catalog: a100-40g, a100-80g, h100-sxm, h200, local-cpu) or a cluster [cyan].toml[/].")],
    global_batch: Annotated[int, typer.Option(help="Samples per optimizer step.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the plan.")] = Path("plan.json"),
    placement: Annotated[Literal["auto", "colocated", "non-colocated"], typer.Option(help="Groups on the same ranks ([cyan]colocated[/]), on disjoint ones ([cyan]non-colocated[/]), or the best of both and of one shared layout ([cyan]auto[/]).")] = "auto",
    schedule: Annotated[Literal["1f1b", "gpipe", "interleaved"], typer.Option(help="Pipeline schedule of every group; [cyan]interleaved[/] searches heterogeneous layouts as 1f1b. Left out, the Megatron-style baseline's grid holds 1F1B, GPipe and interleaved 1F1B (v = 2 and 4 model chunks per rank), emitted where faster; given, only that schedule (interleaved: with 1F1B).")] = "1f1b",
    micro_batch: Annotated[Optional[int], typer.Option(help="Samples per micro-batch (over a group's data-parallel replicas); default: searched.")] = None,
    time_limit: Annotated[Optional[float], typer.Option(help="Seconds: return the best plan found so far when they are up.")] = None,
    solver: Annotated[Literal["highs", "cbc"], typer.Option(help="ILP solver (HiGHS in-process; CBC is the fallback).")] = "highs",
    memory_tiers: Annotated[bool, typer.Option(help="Place state and activations in CPU / NVMe tiers or recompute them when that fits or is faster.")] = True,
    gpus_per_node: Annotated[Optional[int], typer.Option(help="Regroup the cluster's GPUs into nodes of this size.")] = None,
    baseline: Annotated[Optional[Literal["homogeneous", "megatron", "zero3", "gpipe-even"]], typer.Option(help="Write a baseline plan instead of solving: the best of its kind (homogeneous and megatron: exactly the ones solve compares with), or exactly [cyan]--layout[/].")] = None,
    memory_reserve: Annotated[float, typer.Option(help="Fraction of each GPU's memory every plan leaves free: usable = capacity x (1 - reserve).")] = 0.10,
    sequence_parallel: Annotated[bool, typer.Option(help="Search sequence parallelism for tp > 1 layouts (where tp divides the sequence).")] = True,
    layout: Annotated[Optional[str], typer.Option(help="With [cyan]--baseline homogeneous[/] or [cyan]megatron[/]: KEY=VALUE pairs joined by commas, e.g. [cyan]tp=8,pp=2,dp=32[/]; optional keys: micro-batch (1), schedule (1f1b, gpipe or interleaved:2), recompute (none, selective, layers or full), zero (0 to 3), sp (sequence parallelism: true or false), split (layers, flops or encoders-first). homogeneous: exactly this layout (split flops: stages of even FLOPs); megatron: what it writes is fixed, the rest searched (split encoders-first: encoders and projector on the first stage). Without a baseline, one layout per group, GROUP:KEY=VALUE pairs, groups joined by semicolons (e.g. [cyan]vision:dp=4; llm:tp=2[/]): exactly that plan, each group on ranks of its own (or with the key colocated-with naming another group: on that group's ranks, and with fill-bubbles true in their idle slots) with its own micro-batch count, split (flops unless written) and schedule (interleaved for a pipelined group, one V for all).")] = None,
    from_: Annotated[Optional[tuple[str, str]], typer.Option("--from", metavar="KIND VALUE", help="Your current configuration as the plan: [cyan]--from megatron \"ARGS\"[/] (or @FILE) or [cyan]--from deepspeed ds_config.json[/] (with [cyan]--baseline homogeneous[/]).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout (plan path, step times, speed-up, solve time, fits).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
    allow_unfit: Annotated[bool, typer.Option("--allow-unfit", help="Exit 0 when the plan written (--layout, --from, a baseline) does not fit its GPUs' memory.")] = False,
) -> None:
    """Solve for the fastest plan: cut points (DP), per-group layouts, GPUs per modality (ILP), memory tiers (ILP).

    Compared, in the same run, with the best homogeneous (Megatron-style) plan, which is written instead if it
    is faster. Exit code 2 with the shortfall (bytes or GPUs) when nothing can fit.
    """
    from planner.solver.baselines import MEGATRON_SCHEDULES
    from planner.commands.report import render_solution, solution_json
    from planner.solver.solve import process_started, run_solve

    # --time-limit counts from the process start (loading Python and the profile included) in a process of its own
    fresh = Path(sys.argv[0]).name in ("mmplan", "cli.py", "__main__.py")
    started = process_started() if fresh else None

    check_writable(output, "--output")
    check_not_input(output, "--output", [profile_path, Path(cluster)])
    given = _given(ctx, "placement", "schedule", "micro_batch", "time_limit", "solver", "memory_tiers", "memory_reserve",
                   "sequence_parallel")
    if from_ is not None:  # the user's configuration as a baseline plan (planner/export/importing.py)
        if baseline not in (None, "homogeneous") or layout is not None:
            raise MmplanError("--from describes your layout: use it with --baseline homogeneous and without --layout")
        if given:
            raise MmplanError(f"--from takes the layout from your configuration: {', '.join(given)} "
                              f"{'does' if len(given) == 1 else 'do'} not apply to it")
        from planner.export.importing import solve_from

        run_solve = functools.partial(solve_from, tuple(from_))  # noqa: F811 (same keywords, the user's plan)
    if "--schedule" in given and (layout is not None or baseline in ("zero3", "gpipe-even")):
        raise MmplanError("--layout fixes the schedule itself: write schedule=... in the layout" if layout is not None else
                          f"--baseline {baseline} has a schedule of its own ({'gpipe' if baseline == 'gpipe-even' else '1f1b'}, "
                          f"{'pp > 1' if baseline == 'gpipe-even' else 'pp = 1'}): drop --schedule")
    megatron_schedules = {"gpipe": ("gpipe",), "1f1b": ("1f1b",), "interleaved": tuple(s for s in MEGATRON_SCHEDULES if s != "gpipe")}[schedule] \
        if "--schedule" in given else MEGATRON_SCHEDULES
    with console.progress("solving", enabled=not quiet and not as_json) as note:
        solution, prof = run_solve(profile_path=profile_path, cluster=cluster, global_batch=global_batch, output=output,
                                   gpus_per_node=gpus_per_node, placement=placement, schedule=schedule, micro_batch=micro_batch,
                                   time_limit=time_limit, solver=solver, memory_tiers=memory_tiers, baseline=baseline,
                                   layout=layout, progress=note, memory_reserve=memory_reserve, started=started,
                                   sequence_parallel=(False, True) if sequence_parallel else (False,),
                                   megatron_schedules=megatron_schedules)
    if as_json:
        print(json.dumps(solution_json(solution, output, prof), allow_nan=False))
    elif not quiet:
        console.out.print(render_solution(solution, prof))
        console.out.print(f"wrote [bold]{console.safe(output)}[/]", soft_wrap=True, markup=True)
    _refuse_unfit(solution.plan, output, allow_unfit)


def _refuse_unfit(plan, output: Path, allow: bool) -> None:
    """A plan that does not fit is written (compare can show it) but exits 2 unless --allow-unfit."""
    from plans.units import format_bytes, format_capacity, short_by

    if allow or plan.predicted is None or plan.predicted.fits:
        return
    peak, cap = max(m.gpu for m in plan.predicted.memory), plan.cluster.device.memory_bytes
    raise MmplanError(f"the plan written to {output} does not fit: {format_bytes(peak)} on its fullest GPU of "
                      f"{format_capacity(cap)} {short_by(peak, cap)}; pass --allow-unfit to accept it")



@app.command()
@user_errors
def export(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan.json from [cyan]mmplan solve[/] (or written by hand).")],
    to: Annotated[str, typer.Option("--to", help="[cyan]megatron[/] (argument list; Megatron-LM core_v0.16.1: one layout), [cyan]megatron-mimo[/] (argument list; Megatron-LM main at commit d98e8a64dd: an encoder and the LLM on their own ranks, its heterogeneous MIMO flags), [cyan]megatron-bridge[/] (Python config; Megatron-Bridge main 0.7.0, commit 067f987df0) or [cyan]torchtitan[/] (Python config; torchtitan 0.3.0), [cyan]deepspeed[/] (ds_config.json; DeepSpeed 0.19.8).")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where to write it (default: print it).")] = None,
    lossy: Annotated[bool, typer.Option(help="Export the nearest plan the target can express and list what was dropped, instead of exit 2.")] = False,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="The plan's profile.json: its model shape (layers, hidden size, heads, ...) goes into the file; without it those values are placeholders the target refuses until filled.")] = None,
) -> None:
    """Write a plan in the configuration of the framework you train with; what the target cannot express is an error (exit 2) unless [cyan]--lossy[/]."""
    from planner.export import run_export

    if output is not None:
        check_writable(output, "--output")
        check_not_input(output, "--output", [plan_path, *([profile] if profile else [])])
    result = run_export(plan_path=plan_path, target=to, output=output, lossy=lossy, profile_path=profile)
    if output is None:
        sys.stdout.write(result.text)
    else:
        console.out.print(f"wrote [bold]{console.safe(output)}[/] ({result.target}"
                          + (f"; dropped: {console.safe('; '.join(result.dropped))}" if result.dropped else "") + ")",
                          soft_wrap=True, markup=True)


def _announce_torchrun(quiet: bool, op_timeout: float) -> None:
    """One line when this process joins a torchrun job (stray torchrun variables are refused by torchrun_job)."""
    from runtime.preflight import torchrun_job

    job = torchrun_job()
    if job is not None and not quiet:
        console.err.print(f"joining {job.describe()}; each collective waits up to --op-timeout {op_timeout:g} s for "
                          "the other ranks", soft_wrap=True, markup=False)


def _check_run_outputs(log: Path | None, trace: Path | None, inputs: list[Path | None]) -> None:
    """run's --log and --trace: writable regular files that are none of its inputs."""
    if log:
        check_writable(log, "--log")
        check_not_input(log, "--log", inputs)
    if trace:
        check_writable(trace, "--trace")
        check_not_input(trace, "--trace", [*inputs, log])


@app.command()
@user_errors
def run(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan.json from [cyan]mmplan solve[/] (or written by hand).")],
    steps: Annotated[int, typer.Option(help="Optimizer steps to train.")] = 20,
    log: Annotated[Optional[Path], typer.Option("--log", "--log-file", help="Write one JSON line per step (loss, step time, per-rank compute/comm/idle, peak memory); appended to when resuming. Under torchrun write [cyan]--log-file[/] (torchrun takes [cyan]--log[/] for its own --log-dir).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the initial weights and the built-in dataset.")] = 0,
    lr: Annotated[float, typer.Option(help="Adam learning rate.")] = 1e-3,
    data: Annotated[str, typer.Option(help="[cyan]builtin[/] (a learnable synthetic multimodal dataset) or [cyan]package.module:factory[/].")] = "builtin",
    model: Annotated[Optional[str], typer.Option(help="Build the model from this spec instead of the one the plan names.")] = None,
    profile_path: Annotated[Optional[Path], typer.Option("--profile", help="Profile to predict with (e.g. one with measured block times); default: the plan's stored predictions.")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="Wall-clock limit of the whole run, seconds (default: none; a hang is caught by [cyan]--op-timeout[/]).")] = None,
    op_timeout: Annotated[float, typer.Option(help="Seconds any rank may wait in one collective or receive before the run fails, naming the rank that stopped responding.")] = 300.0,
    log_every: Annotated[int, typer.Option(help="Print one line (step, loss, samples/s, step time) every N steps on stderr (0: none); on a terminal a progress bar too.")] = 10,
    tensorboard: Annotated[Optional[Path], typer.Option(metavar="DIR", help="Write loss, step time, samples/s and peak memory per step as TensorBoard scalars here (needs tensorboard).")] = None,
    device_budget: Annotated[Optional[float], typer.Option(help="Bytes each rank's device tier may hold; the run fails loudly beyond (on CPU the device tier is an accounted budget).")] = None,
    nvme_dir: Annotated[Optional[Path], typer.Option(help="Directory for the nvme tier's files (needed when the plan uses it; cleaned up at the end).")] = None,
    prefetch: Annotated[bool, typer.Option(help="Bring offloaded activations and parameters back ahead of use.")] = True,
    checkpoint_every: Annotated[int, typer.Option(help="Write a checkpoint every K steps (0: never).")] = 0,
    checkpoint_dir: Annotated[Optional[Path], typer.Option(help="Where checkpoints go (the last two complete ones are kept).")] = None,
    checkpoint_format: Annotated[Literal["dcp", "gather"], typer.Option(help="[cyan]dcp[/]: torch.distributed.checkpoint, every rank writes its own shards; [cyan]gather[/]: one file per block, each gathered to one rank first (the earlier format). [cyan]--resume[/] reads both.")] = "dcp",
    checkpoint_async: Annotated[bool, typer.Option("--checkpoint-async", help="dcp only: write each checkpoint in a background thread while training goes on (completed before the next one and at the end).")] = False,
    resume: Annotated[Optional[Path], typer.Option(help="Resume from the latest complete checkpoint in this directory — written under any plan, in either --checkpoint-format.")] = None,
    trace: Annotated[Optional[Path], typer.Option(metavar="FILE", help="Write the last step's measured timeline as a Perfetto/Chrome trace: one process per rank, the event names of [cyan]mmplan compare --trace[/].")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Let this run replace the checkpoints already in --checkpoint-dir (once its own first one is complete) and an existing --log.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors.")] = False,
) -> None:
    """Train with a plan: one process per rank here (gloo on CPU), or join a torchrun job (multi-node).

    Checks the plan against the model first (fingerprint, every block in one stage, rank count). At the end prints the
    measured step time, busy time and memory beside the cost model's prediction.
    """
    from planner.commands.run import check_files, check_options, measured_summary, prepare_run, run_plan
    from runtime.preflight import torchrun_job

    # every refusal that needs no model first: options, torchrun's variables, files (issue 30)
    check_options(steps=steps, lr=lr, checkpoint_every=checkpoint_every, checkpoint_dir=checkpoint_dir, device_budget=device_budget,
                  timeout_s=timeout, op_timeout_s=op_timeout, checkpoint_format=checkpoint_format, checkpoint_async=checkpoint_async)
    torchrun_job()  # stray torchrun variables refused now; joining a job is announced once the plan is checked
    _check_run_outputs(log, trace, [plan_path, profile_path, Path(model) if model else None, Path(data)])
    from plans.graph import load_profile
    measured_profile = load_profile(profile_path) if profile_path else None
    from planner.commands.monitor import MonitorOptions

    check_files(log=log, resume=resume, checkpoint_dir=checkpoint_dir, overwrite=overwrite)
    prepared = prepare_run(plan_path, model, measured_profile)  # the plan read, checked and evaluated once
    if prepared.actual.warning and not quiet and int(os.environ.get("RANK", "0")) == 0:
        console.err.print(prepared.actual.warning, soft_wrap=True)
    _announce_torchrun(quiet, op_timeout)
    result = run_plan(plan_path, steps=steps, seed=seed, lr=lr, data=data, log=log, timeout_s=timeout,
                      op_timeout_s=op_timeout, monitor=MonitorOptions(show=not quiet, log_every=log_every, tensorboard=tensorboard),
                      device_budget=device_budget, nvme_dir=nvme_dir, prefetch=prefetch, checkpoint_every=checkpoint_every,
                      checkpoint_dir=checkpoint_dir, resume=resume, overwrite=overwrite, trace=trace, prepared=prepared,
                      checkpoint_format=checkpoint_format, checkpoint_async=checkpoint_async)
    if result.rank != 0:
        return
    # the cost model's evaluation with --profile; else the plan's prediction on this cluster, or its own
    evaluation = prepared.predicted
    predicted = getattr(evaluation, "predicted", evaluation)
    summary = measured_summary(result.metrics)
    if as_json:
        print(json.dumps({"plan": str(plan_path), "steps": steps, "log": str(log) if log else None,
                          "losses": [m["loss"] for m in result.metrics], **summary,
                          "predicted_step_time_s": predicted.step_time_s if predicted else None}))
        return
    if not result.metrics:
        if not quiet:
            console.out.print(f"nothing to train: the checkpoint is already at step {steps} or later")
        return
    if not quiet:
        from planner.commands.report import measured_table

        if evaluation is not None:
            console.out.print(measured_table(result.plan, evaluation, result.metrics))
        elif summary["step_time_s"] is not None:
            console.out.print(f"measured step {summary['step_time_s'] * 1e3:.3g} ms (median); the plan holds no prediction "
                              "to compare it with (compare it with --profile PROFILE)")
        console.out.print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over {len(result.metrics)} steps"
                          + (f"; log in [bold]{console.safe(log)}[/]" if log else ""), markup=True)


@app.command()
@user_errors
def compare(
    plans: Annotated[list[Path], typer.Argument(metavar="PLAN...", help="plan.json files (from [cyan]mmplan solve[/] or written by hand).")],
    profile_path: Annotated[Optional[Path], typer.Option("--profile", help="The profile.json the plans are for: evaluate every plan with the current cost model. Without it the figures stored in the plans are shown (a plan without them is an error).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout, one object per plan in argument order.")] = False,
    trace: Annotated[Optional[Path], typer.Option(metavar="DIR", help="Write [cyan]<plan stem>.trace.json[/] per plan into DIR (open in ui.perfetto.dev); needs --profile.")] = None,
    measured: Annotated[Optional[Path], typer.Option(metavar="RUN.jsonl", help="A run's metrics log ([cyan]mmplan run --log[/]): show the plan's prediction beside it (one plan only).")] = None,
    memory_model: Annotated[str, typer.Option(help="How GPU memory is counted (needs --profile): [cyan]tensors[/] as mmplan's runtime holds them; [cyan]megatron[/] as a Megatron-LM run uses the GPU (fp32 gradient buffer, cuBLAS / NCCL / CUDA context, allocator fragmentation).")] = "tensors",
) -> None:
    """Compare plans offline: step time, throughput, MFU, memory per tier, bubble, communication; best highlighted.

    The best plan is the fastest one that fits in memory. With [cyan]--measured[/] also predicted vs measured
    step time, per-rank busy time and memory (medians over the steps after the first).
    """
    from planner.commands.compare import run_compare
    from planner.commands.report import breakdown_table, compare_table, comparison_json, measured_table, why_texts

    result = run_compare(plans, profile_path=profile_path, trace_dir=trace, measured_path=measured,
                         memory_model=memory_model)
    if as_json:
        print(json.dumps(comparison_json(result), allow_nan=False))
        return
    console.out.print(compare_table(result.items))
    steps = breakdown_table(result.items)
    if steps is not None:
        console.out.print(steps)
    for text in why_texts(result.items).values():
        console.out.print(text, soft_wrap=True, markup=False)
    if result.measured is not None:
        c = result.items[0]
        console.out.print(measured_table(c.plan, c.evaluation or c.predicted, result.measured))
    for path in result.traces:
        console.out.print(f"wrote [bold]{console.safe(path)}[/]", soft_wrap=True, markup=True)


@app.command()
@user_errors
def calibrate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the cluster TOML (give it to [cyan]--cluster[/]).")] = Path("cluster.toml"),
    ranks: Annotated[int, typer.Option(help="gloo ranks to launch for the collectives (one thread each).")] = 2,
    quick: Annotated[bool, typer.Option(help="Fewer sizes and one round of repetitions (about 25 s on 2 vCPUs).")] = False,
    device: Annotated[Literal["cpu", "cuda"], typer.Option(help="[cyan]cuda[/]: measure a GPU cluster under torchrun (GEMMs by shape, NCCL collectives and p2p within and across nodes, FSDP2's per-block cost).")] = "cpu",
) -> None:
    """Measure this machine (matmul throughput, memory bandwidth, gloo collectives and p2p under load, the
    optimizer step, host<->device, disk, the runtime's fixed costs) and write it as a cluster TOML."""
    if device == "cuda":
        from planner.calibrate.cuda import measure_cluster, require_cuda

        require_cuda()
        check_writable(output, "--output")
        if measure_cluster(output) is not None:
            console.out.print(f"wrote [bold]{console.safe(output)}[/] (use it as [cyan]--cluster {console.safe(output)}[/])",
                              soft_wrap=True, markup=True)
        return
    from cost_models.cluster_toml import cluster_to_toml
    from planner.calibrate.calibrate import measure
    from planner.calibrate.fit import to_cluster
    from plans.serial import write_atomic

    check_writable(output, "--output")
    with console.progress("calibrating") as note:
        cal = measure(ranks=ranks, quick=quick, progress=note)
    cluster = to_cluster(cal)
    write_atomic(output, cluster_to_toml(cluster))
    console.out.print(_calibration_table(cal, cluster))
    console.out.print(f"wrote [bold]{console.safe(output)}[/] (use it as [cyan]--cluster {console.safe(output)}[/])", soft_wrap=True,
                      markup=True)


def _calibration_table(cal, cluster):
    """What calibrate measured, beside the catalog entry of the same kind of device when there is one."""
    from rich.table import Table

    from cost_models.catalog import CATALOG, GBps
    from planner.calibrate.probes import CONV_SHAPE

    name = cal.device_name.lower()
    ref_name = "local-cpu" if cluster.backend == "gloo" else next(
        (k for k, hint in (("h200", "h200"), ("h100-sxm", "h100"), ("a100-80g", "a100-sxm4-80"), ("a100-40g", "a100"))
         if hint in name), None)
    ref = CATALOG.get(ref_name) if ref_name else None
    table = Table(title=f"{cal.device_name}: {cal.ranks} ranks, {cal.wall_s:.0f} s", title_justify="left", header_style="bold")
    table.add_column("measured")
    table.add_column("this machine", justify="right")
    if ref:
        table.add_column(f"catalog {ref_name}", justify="right")

    def link(l) -> str:
        return f"{l.bandwidth / GBps:.3g} GB/s, {l.latency_s * 1e6:.3g} us"

    conv_peak = cluster.backend == "gloo" and "conv" in cal.samples  # a CPU's fp32 peak includes the convolution probe
    rows = [(f"{dtype} peak ({'matmul, 3x3 conv' if dtype == 'fp32' and conv_peak else 'matmul'})",
             f"{cluster.device.peak_flops[dtype] / 1e9:,.1f} GFLOP/s",
             f"{ref.device.peak_flops[dtype] / 1e9:,.1f} GFLOP/s" if ref and dtype in ref.device.peak_flops else "-")
            for dtype in cluster.device.peak_flops]
    rows += [(f"matmul n={n}", f"{rate / 1e9:,.1f} GFLOP/s", "") for n, rate in cal.matmul]
    rows += [(f"3x3 conv {'x'.join(map(str, CONV_SHAPE))}", f"{flops / seconds / 1e9:,.1f} GFLOP/s", "")
             for flops, seconds in cal.samples.get("conv", ())]
    rows += [
        ("memory bandwidth", f"{cluster.device.memory_bandwidth / GBps:.3g} GB/s", f"{ref.device.memory_bandwidth / GBps:.3g} GB/s" if ref else ""),
        ("host <-> device", link(cluster.host_to_device), link(ref.host_to_device) if ref else ""),
        ("all-reduce (per ring hop)", link(cal.all_reduce), ""),
        ("p2p send/recv", link(cal.p2p), ""),
        ("link between ranks", link(cluster.intra_node), link(ref.intra_node) if ref else ""),
        ("fixed cost per collective call", f"{cluster.intra_node.collective_s * 1e6:.3g} us",
         f"{ref.intra_node.collective_s * 1e6:.3g} us" if ref else ""),
        ("disk write", link(cal.disk_write), ""),
        ("disk read", link(cal.disk_read), ""),
        ("nvme (slower of the two)", link(cluster.nvme), link(ref.nvme) if ref else ""),
        ("Adam step, all ranks at once", f"{cluster.optimizer_tensor_s * 1e6:.3g} us per tensor + "
                                         f"{cluster.optimizer_byte_s * 1e9:.3g} ns per parameter byte", ""),
        ("runtime's fixed cost per step", f"{cluster.step_overhead_s * 1e3:.3g} ms", ""),
        ("compute, all ranks busy vs one alone", f"{cluster.compute_slowdown:.3g}x slower", ""),
        ("ZeRO (FSDP2) beyond its collectives", f"{cluster.zero_block_s * 1e6:.3g} us per block and "
                                                 f"{cluster.zero_byte_s * 1e9:.3g} ns per parameter byte and micro-batch + "
                                                 f"{cluster.zero_tensor_s * 1e6:.3g} us per tensor in the step", ""),
        ("host work per op", f"{cluster.forward_op_s * 1e6:.3g} us forward, {cluster.backward_op_s * 1e6:.3g} us backward", ""),
        ("runtime's accounting per saved storage", f"{cluster.saved_tensor_s * 1e6:.3g} us forward, "
                                                   f"{cluster.released_tensor_s * 1e6:.3g} us backward", ""),
    ]
    for row in rows:
        table.add_row(*(row if ref else row[:2]))
    return table



@app.command()
@user_errors
def demo(
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the profile, the plans, run logs and traces.")] = Path("mmplan-demo"),
    case: Annotated[Literal["layouts", "micro-batch"], typer.Option(help="What the demo shows. [cyan]layouts[/] (default): a layout per group -- runtime.models.conv_vlm (a data-parallel convolutional encoder beside a pipelined, parameter-heavy LLM) on planner/commands/demo_cluster.toml (2 ranks, 160 MB each), 8 samples per step. [cyan]micro-batch[/]: a micro-batch count per group -- runtime.models.mb_vlm (a host-bound ViT of 16 narrow layers, whose time hardly grows with its batch, beside an LLM whose logits memory holds to one sample per replica and micro-batch) on planner/commands/micro_batch_cluster.toml (2 ranks, 16 MB each), 16 samples per step: the encoder runs the whole batch in one micro-batch while a one-layout plan repeats its dispatch for every LLM micro-batch.")] = "layouts",
    model: Annotated[Optional[str], typer.Option(help="The model (zoo name, .toml or package.module:factory); default: the --case's.")] = None,
    cluster: Annotated[Optional[str], typer.Option(help="The local ranks to plan for and run on, and their memory cap (a catalog name or a cluster TOML); default: the --case's.")] = None,
    global_batch: Annotated[Optional[int], typer.Option(help="Samples per optimizer step; default: the --case's (layouts 8, micro-batch 16).")] = None,
    steps: Annotated[int, typer.Option(help="Training steps per run.")] = 12,
    runs: Annotated[int, typer.Option(help="Training runs per plan, alternating between the plans; the measured step is the median of their median steps.")] = 3,
    calibrate: Annotated[bool, typer.Option(help="Measure this machine first ([cyan]mmplan calibrate --quick[/]) and plan for the measured figures within --cluster's memory.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
) -> None:
    """The whole loop on this machine: profile -> solve -> train the solved plan and the one-layout baselines the
    solver compared with (homogeneous, megatron) -> compare predicted with measured; the speed-up is over the
    baseline that measured fastest, and the report names the per-group mechanism the solved plan uses. Takes one to
    two minutes on 2 CPU cores (100 s on a 2-vCPU VM)."""
    from planner.commands.demo import run_demo
    from planner.commands.report import demo_json, render_demo

    if output.exists() and not output.is_dir():
        raise MmplanError(f"--output {output} is a file; give a directory")
    with console.progress("mmplan demo", enabled=not as_json) as note:
        result = run_demo(output, case=case, model=model, cluster=cluster, global_batch=global_batch, steps=steps,
                          runs=runs, calibrate=calibrate, progress=note)
    if as_json:
        print(json.dumps(demo_json(result)))
    else:
        console.out.print(render_demo(result))


def main() -> None:  # pragma: no cover - console-script entry
    app()


if __name__ == "__main__":
    app()
