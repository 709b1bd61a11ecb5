"""The per-rank training loop: data, the rank's tasks in schedule order, gradient reduction, optimizer, metrics.

Loss scaling: the loss stage's replica r computes the model's loss over its samples of micro-batch j
and back-propagates loss / (dp * m), m the loss group's own micro-batch count (Group.micro_batches, else the plan's);
every stage then sums its gradients over its dp replicas. For a loss that is a mean over samples this equals the
single-process step over the global batch with the plan's micro-batches of gradient accumulation (reference.py),
whatever each group's count, which the parity tests check.
"""
from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plans.plan import Plan
from runtime.data import Prefetcher
from runtime.forward_program import bare
from runtime.grad_buckets import all_reduce_grads
from runtime.job import Job
from runtime.launch import RankContext
from runtime.precision import cast_inputs, torch_dtype
from runtime.program import evaluate, tensor_leaves
from runtime.rank import build_rank, chunks_of
from runtime.schedule import Task, has_backward
from runtime.source import model_loss

__all__ = ["Job", "RankTrainer", "StepMetrics", "step_samples", "train_rank"]  # Job: runtime/job.py, given to train_rank


@dataclass
class StepMetrics:
    step: int
    loss: float
    step_time_s: float
    compute_s: list[float] = field(default_factory=list)
    comm_s: list[float] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)
    peak_memory_bytes: list[float] = field(default_factory=list)


def step_samples(step: int, plan: Plan, mb: int, start: int, stop: int, micro_batch: int | None = None) -> range:
    """Global sample indices [start, stop) of micro-batch mb of a step, micro-batches of `micro_batch` samples (a group's
    own size, Plan.micro_batch_of; default the plan's)."""
    base = step * plan.training.global_batch + mb * (plan.training.micro_batch if micro_batch is None else micro_batch)
    return range(base + start, base + stop)


class RankTrainer:
    """One rank's state for a whole run."""

    def __init__(self, ctx: RankContext, job: Job):
        self.ctx, self.job, self.plan = ctx, job, job.plan
        self.dtype = torch_dtype(job.plan.training.dtype)
        self.rank = rank = build_rank(ctx, job)  # runtime/rank.py: the one composition of the techniques
        self.stage_map, self.rm, self.dataset, self.stage_inputs = rank.stage_map, rank.rm, rank.dataset, rank.stage_inputs
        self.tasks, self.exchange, self.route_index = rank.tasks, rank.exchange, rank.route_index
        self.dp_groups, self.tp_groups, self.stage_tp = rank.dp_groups, rank.tp_groups, rank.stage_tp
        self.zero_blocks, self.zero_replicated, self.last_backward = rank.zero_blocks, rank.zero_replicated, rank.last_backward
        self.tiers, self.buckets = rank.tiers, rank.buckets
        self._pending_checkpoint: tuple | None = None  # a DCP save still to complete (runtime/checkpoint_dcp.py)
        self.checkpoint_group = dist.new_group(backend="gloo") if job.checkpoint_async else None  # collective
        self.start_step = self._resume(job.resume) if job.resume else 0
        self.events: list[tuple[str, str, float, float]] = []  # the last step's (lane, name, start, end)

    def _batches(self, step: int) -> dict[tuple, dict[str, torch.Tensor]]:
        """This rank's input slices for a step: (stage, replica, micro-batch) -> batch."""
        out = {}
        for key in self.stage_map.keys_on(self.ctx.rank):
            keys = self.stage_inputs[key]
            if not keys:
                continue
            r = self.stage_map.stages[key].replica_of(self.ctx.rank)
            s0, s1 = self.stage_map.slice(key, r)
            st = self.stage_map.stages[key]
            for j in range(st.micro_batches):  # the group's own micro-batches (Group.micro_batches)
                batch = cast_inputs(self.dataset.sample_batch(step_samples(step, self.plan, j, s0, s1, st.micro_batch)),
                                    self.dtype)
                out[(key, r, j)] = {k: batch[k].to(self.ctx.device) for k in keys}
        return out

    def run(self) -> dict[str, Any]:
        """Train the job's steps. Rank 0 writes the log, opened at its first row (a run failing before it leaves
        none): appended to when resuming, else truncated (the launcher refused to replace a log without
        --overwrite); never through a symbolic link. A non-finite loss stops every rank before that step is
        logged or checkpointed, and removes the checkpoint whose weights produced it."""
        results: dict[str, Any] = {"metrics": [], "grads": {}}
        log = None
        try:
            steps = range(self.start_step, self.job.steps)
            with Prefetcher(self._batches(s) for s in steps) as batches:
                for step in steps:
                    metrics = self.step(step, next(batches), results)
                    if not math.isfinite(metrics.loss):  # the same gathered loss on every rank: all stop together
                        raise _diverged(self.job, step, metrics.loss, self.start_step, self.ctx.rank == 0)
                    if self.job.checkpoint_every and (step + 1) % self.job.checkpoint_every == 0:
                        self.save_checkpoint(step + 1)
                    if self.ctx.rank == 0:
                        results["metrics"].append(metrics.__dict__)
                        if self.job.progress:
                            _append_line(self.job.progress, metrics.__dict__)
                        if self.job.log:
                            if log is None:
                                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if self.job.resume else os.O_TRUNC)
                                log = os.fdopen(os.open(self.job.log, flags, 0o666), "w")
                            log.write(json.dumps(metrics.__dict__, allow_nan=False) + "\n")
                            log.flush()
            self.finish_checkpoint()
        finally:
            if log:
                log.close()
        if self.job.trace:
            timelines: list = [None] * self.ctx.world_size
            dist.all_gather_object(timelines, self.events)
            results["trace"] = {r: events for r, events in enumerate(timelines) if events}
        return results

    def step(self, step: int, batches: dict, results: dict) -> StepMetrics:
        if self.job.fail_at == (self.ctx.rank, step):
            raise RuntimeError(f"injected failure at step {step}")
        t0 = time.perf_counter()
        self.exchange.wait_s = 0.0
        self.exchange.note_batches(batches)  # packed outputs of images of different sizes: rows per sample
        self.tiers.budget.reset_peak()
        state: dict[tuple, Any] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        compute = 0.0
        events: list[tuple[str, str, float, float]] = []
        for i, task in enumerate(self.tasks):
            w0, c0 = self.exchange.wait_s, time.perf_counter()
            if task.kind == "F":
                loss_sum += self.forward(task, batches, state)
            else:
                if task.stage in self.buckets and self.last_backward[task.stage] == i:
                    self.buckets[task.stage].arm()
                self.backward(task, state)
            c1 = time.perf_counter()
            compute += c1 - c0 - (self.exchange.wait_s - w0)
            events.append(("compute", task.name, c0 - t0, c1 - t0))
        self.exchange.finish()
        self.tiers.before_reduce()
        c0 = time.perf_counter()
        self.reduce_gradients(events, t0)
        self.sync_sequence_parallel()  # after: a bucket's write-back would overwrite it (sums commute)
        self.sync_ties(events, t0)  # after each stage's dp sync: the copies of a tie summed (runtime/ties.py)
        comm = self.exchange.wait_s + time.perf_counter() - c0
        if step == 0 and self.job.probe_grads:
            results["grads"] = self.full_tensors(lambda p: p.grad)
        c0 = time.perf_counter()
        self.tiers.step()
        c1 = time.perf_counter()
        compute += c1 - c0
        events.append(("compute", "optimizer", c0 - t0, c1 - t0))
        self.events = events
        step_time = time.perf_counter() - t0
        peak = float(self.tiers.budget.measured_peak())  # device tier: accounted on CPU, allocated on CUDA
        row = torch.tensor([float(loss_sum), step_time, compute, comm, peak], dtype=torch.float64)
        gathered = [torch.zeros_like(row) for _ in range(self.ctx.world_size)]
        dist.all_gather(gathered, row)
        rows = torch.stack(gathered).tolist()
        return StepMetrics(
            step=step, loss=sum(r[0] for r in rows), step_time_s=max(r[1] for r in rows),
            compute_s=[r[2] for r in rows], comm_s=[r[3] for r in rows],
            idle_s=[max(0.0, r[1] - r[2] - r[3]) for r in rows], peak_memory_bytes=[r[4] for r in rows],
        )

    def forward(self, task: Task, batches: dict, state: dict) -> float:
        lay, rm = self.stage_map, self.rm
        st = lay.stages[task.stage]
        batch = batches.get((task.stage, task.replica, task.mb), {})
        received: dict[str, Any] = {}
        leaves_in: dict[int, list[torch.Tensor]] = {}
        for route in lay.routes_into(task.stage):
            i = self.route_index[id(route)]
            trains = has_backward(lay, route.src)  # else no gradient goes back to it (nothing before it trains)
            received[route.block], leaves = self.exchange.recv_forward(i, task.replica, task.mb, needs_grad=trains)
            if trains:
                leaves_in[i] = leaves

        def fetch(node):
            if node.op == "placeholder":
                return batch[str(node.target)]
            if node.op == "get_attr":
                return rm.model.get_submodule("").get_parameter(str(node.target))
            return received[str(node.target)]

        env: dict = {}
        # this stage's blocks (with their memory tiers); blocks of other stages arrive through routes
        own = hasattr(rm.program, "run_stage")  # the model's own forward with proxies (runtime/forward_program.py)
        mine = self.tiers.blocks(st.blocks, bare(rm.local) if own else rm.local)
        grad = has_backward(lay, task.stage)
        with torch.set_grad_enabled(grad), self.tiers.glue():
            if own:
                values, loss = rm.program.run_stage(rm.model, st.blocks, batch, received, mine, task.stage == lay.loss_stage)
                env = {rm.program.blocks[b]: v for b, v in values.items()}
            else:
                for b in st.blocks:
                    evaluate(rm.program.blocks[b], env, fetch, mine)
                loss = evaluate(rm.program.output, env, fetch, mine) if task.stage == lay.loss_stage else None
            if loss is not None:
                loss = model_loss(loss) / (st.dp * st.micro_batches)
        outputs = {}
        for route in lay.routes_out_of(task.stage):
            value = env[rm.program.blocks[route.block]]
            self.exchange.send_forward(self.route_index[id(route)], task.replica, task.mb, value)
            outputs[route.block] = value
        if grad:
            state[(task.stage, task.replica, task.mb)] = (outputs, leaves_in, loss, mine)
        counts = loss is not None and st.leader(task.replica) == self.ctx.rank  # once per replica, not per tp rank
        return float(loss.detach()) if counts else 0.0

    def backward(self, task: Task, state: dict) -> None:
        outputs, leaves_in, loss, mine = state.pop((task.stage, task.replica, task.mb))
        mine.prefetch_backward()  # offloaded activations / parameters start coming back while we wait
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if loss is not None:
            roots.append(loss)
            grads.append(None)
        by_block: dict[str, list[torch.Tensor | None]] = {}
        for route in self.stage_map.routes_out_of(task.stage):
            if not has_backward(self.stage_map, route.dst):
                continue
            g = by_block.setdefault(route.block, [None] * len(self.rm.specs[route.block].leaves))
            self.exchange.recv_backward(self.route_index[id(route)], task.replica, task.mb, g)
        for block, g in by_block.items():
            for t, gt in zip(tensor_leaves(outputs[block]), g):
                if gt is not None and t.requires_grad:
                    roots.append(t)
                    grads.append(gt)
        if task.stage in self.zero_blocks:
            from runtime.zero import before_backward

            last = self.tasks[self.last_backward[task.stage]] is task
            before_backward(self.zero_blocks[task.stage], self.plan.group(self.stage_map.stages[task.stage].group).zero, last)
        if roots:
            torch.autograd.backward(roots, grads)
        self.tiers.after_backward()
        for i, leaves in leaves_in.items():
            self.exchange.send_backward(i, task.replica, task.mb, leaves)

    def _shards(self, st) -> dict[str, Any]:
        """'block.param' -> ShardInfo for this stage's tensor-parallel parameters (empty without tp)."""
        if st.key not in self.tp_groups:
            return {}
        from runtime.tensor_parallel import full_parameter_names

        return {f"{b}.{n}": info for b in st.blocks for n, info in full_parameter_names(self.rm.local[b]).items()}

    def _unshard(self, st, shards: dict, name: str, value: torch.Tensor) -> torch.Tensor:
        """The full tensor of a tp-sharded parameter-shaped value (collective over the stage's tp group)."""
        info = shards.get(name)
        if info is None or info.dim is None or value.dim() == 0:
            return value
        parts = [torch.empty_like(value) for _ in range(info.parts)]
        dist.all_gather(parts, value.detach().contiguous(), group=self.tp_groups[st.key])
        return torch.cat(parts, dim=info.dim)

    def _reshard(self, shards: dict, name: str, full: torch.Tensor) -> torch.Tensor:
        info = shards.get(name)
        if info is None or info.dim is None or full.dim() == 0:
            return full
        return full[info.full_slice()]

    def full_tensors(self, get) -> dict[str, torch.Tensor]:
        """`get(param)` for every local parameter, unsharded (tensor-parallel shards gathered), by its name in
        the model — the layout-independent view. Returned by each stage's tp-rank 0; collective over tp groups
        (and over dp groups for ZeRO-sharded parameters)."""
        from runtime import zero

        out: dict[str, torch.Tensor] = {}
        for st in self.stage_map.stages_on(self.ctx.rank):
            shards = self._shards(st)
            for b in st.blocks:
                for name, p in self.rm.local[b].named_parameters():
                    value = get(p)
                    if value is not None:
                        full = self._unshard(st, shards, f"{b}.{name}", zero.full(value))
                        if st.tp_index(self.ctx.rank) == 0:
                            out[self.rm.aliases.get(f"{b}.{name}", f"{b}.{name}")] = full.detach().clone()
        return out

    def save_checkpoint(self, done: int) -> None:
        """Save the state after `done` steps: in DCP's format (every rank its own shards; asynchronously with
        checkpoint_async, completed at the next save or the run's end) or gathered, one file per block."""
        if self.job.checkpoint_format == "gather":
            self._save_gathered(done)
            return
        from runtime import checkpoint_dcp
        from runtime.checkpoint import rng_state

        self.finish_checkpoint()  # one save in flight at most
        d = checkpoint_dcp.prepare_step(self.job.checkpoint_dir, done, self.ctx.rank)
        dist.barrier()
        state = checkpoint_dcp.rank_state(self.stage_map.stages_on(self.ctx.rank), self.rm.local, self.tiers, self.ctx.rank,
                                           self.rank.tie_names())
        future = checkpoint_dcp.save(state, d, group=self.checkpoint_group, asynchronous=self.job.checkpoint_async)
        self._pending_checkpoint = (done, d, future, rng_state())
        if future is None:
            self.finish_checkpoint()

    def finish_checkpoint(self) -> None:
        """Complete the DCP save in flight: wait for its writes, hash each rank's files, rank 0 writes the manifest."""
        if self._pending_checkpoint is None:
            return
        from runtime import checkpoint_dcp
        from runtime.checkpoint import FORMAT_DCP, write_manifest

        done, d, future, rng = self._pending_checkpoint
        self._pending_checkpoint = None
        if future is not None:
            checkpoint_dcp.wait(future, d)
        gathered: list = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, (checkpoint_dcp.own_files(d, self.ctx.rank), rng))  # also the barrier before the manifest
        if self.ctx.rank == 0:
            write_manifest(self.job.checkpoint_dir, done, {n: f for fs, _ in gathered for n, f in fs.items()},
                           rng={r: state for r, (_, state) in enumerate(gathered)}, data_position=done,
                           model=self.plan.profile.model, fingerprint=self.plan.profile.fingerprint,
                           lineage=self.job.lineage, format=FORMAT_DCP,
                           extra={"blocks": [b for st in self.stage_map.stages.values() for b in st.blocks]})
        dist.barrier()

    def _save_gathered(self, done: int) -> None:
        """Format /1: every block once (dp replica 0, tp rank 0), unsharded and keyed by full names; rank 0 writes the
        manifest last, after everyone's files are on disk."""
        from runtime.checkpoint import rng_state, write_block_files, write_manifest
        from runtime.zero import full, full_from_local

        optimizer = self.tiers.state_by_name()
        sharded = self.tiers.sharded  # ZeRO: parameters gathered, optimizer state gathered from the local shards
        copies = self.rank.tie_names()  # a tie's copy: its state is the owner's (saved by the owner's stage)
        blocks, states = {}, {}
        for st in self.stage_map.stages_on(self.ctx.rank):
            shards = self._shards(st)
            writes = st.replica_of(self.ctx.rank) == 0 and st.tp_index(self.ctx.rank) == 0
            for b in st.blocks:
                params = {n: self._unshard(st, shards, n, full(t)) for n, t in self.tiers.block_params(b, self.rm.local[b]).items()}
                opt = {n: {k: self._unshard(st, shards, n, full_from_local(t, sharded[n]) if n in sharded else t)
                           for k, t in optimizer.get(n, {}).items()} if n not in copies else {} for n in params}
                if writes:
                    blocks[b] = params
                    states.update(opt)
        files = write_block_files(self.job.checkpoint_dir, done, blocks, states) if blocks else {}
        gathered: list = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, (files, rng_state()))  # also the barrier before the manifest
        if self.ctx.rank == 0:
            write_manifest(self.job.checkpoint_dir, done, {b: f for fs, _ in gathered for b, f in fs.items()},
                           rng={r: state for r, (_, state) in enumerate(gathered)}, data_position=done,
                           model=self.plan.profile.model, fingerprint=self.plan.profile.fingerprint, lineage=self.job.lineage)
        dist.barrier()

    def _resume(self, directory: str) -> int:
        """Load the latest complete checkpoint into this rank's blocks, whatever plan wrote it; returns its step."""
        from plans.errors import MmplanError
        from runtime.checkpoint import FORMAT_DCP, latest_checkpoint, load_block, set_rng_state, verified_file
        from runtime.zero import local_of

        manifest = latest_checkpoint(directory, verify=False)
        if manifest is None:
            raise MmplanError(f"no complete checkpoint in {directory} to resume from")
        if manifest.format == FORMAT_DCP:
            from runtime import checkpoint_dcp

            refusals: list = [None] * self.ctx.world_size  # each rank checks a share of the files' checksums
            dist.all_gather_object(refusals, checkpoint_dcp.verify_share(manifest, self.ctx.rank, self.ctx.world_size))
            if any(refusals):
                raise MmplanError(next(r for r in refusals if r))
            checkpoint_dcp.load(manifest, self.stage_map.stages_on(self.ctx.rank), self.rm.local, self.tiers, self.ctx.rank,
                                copies=self.rank.tie_names())
            set_rng_state(manifest.rng_for(self.ctx.rank))
            return manifest.step
        for block in manifest.files:
            verified_file(manifest, block)
        state: dict[str, dict[str, torch.Tensor]] = {}
        copies = [c for c in self.rank.tied if c.block != c.owner]
        for st in self.stage_map.stages_on(self.ctx.rank):
            shards = self._shards(st)
            for b in st.blocks:
                params, opt = load_block(manifest, b)
                for c in copies:  # a tie's copy starts from its owner's state (runtime/ties.py)
                    if c.block == b:
                        opt[f"{b}.{c.local}"] = load_block(manifest, c.owner)[1].get(c.parameter, {})
                self.tiers.load_block_params(b, self.rm.local[b], {n: self._reshard(shards, n, t) for n, t in params.items()})
                state.update({n: {k: local_of(self._reshard(shards, n, t), self.tiers.sharded[n]) if n in self.tiers.sharded
                                  else self._reshard(shards, n, t) for k, t in s.items()} for n, s in opt.items()})
        self.tiers.load_state_by_name(state)
        set_rng_state(manifest.rng_for(self.ctx.rank))
        return manifest.step

    def sync_sequence_parallel(self) -> None:
        """Sum the partial gradients of sequence-parallel replicated parameters over each stage's tp group."""
        from runtime.sequence_parallel import sync_sequence_parallel_grads

        for key, done in self.stage_tp.items():
            sync_sequence_parallel_grads(done.partial_params, self.tp_groups[key])

    def sync_ties(self, events: list, t0: float) -> None:
        """All-reduce the gradients of this rank's copies of parameters tied across stages over their holders."""
        if self.rank.tied:
            from runtime.ties import sync_tied_grads

            c0 = time.perf_counter()
            sync_tied_grads(self.rank.tied, self.rm.local)
            events.append(("comm", "sync tied", c0 - t0, time.perf_counter() - t0))

    def reduce_gradients(self, events: list, t0: float) -> None:
        """Sum each stage's gradients over its data-parallel replicas (one flat all-reduce per stage, in stage
        order, as the simulator's tail ops, or the wait for its buckets launched during the backward); each is a
        'sync group sN' event of the timeline."""
        for key, group in self.dp_groups.items():
            st = self.rank.stage(key)
            if st.dp == 1:
                continue
            if self.plan.group(st.group).zero:  # FSDP2 reduce-scattered them in the backward, except those it left whole
                replicated = [p for p in self.zero_replicated.get(key, []) if p.grad is not None]
                if replicated:
                    c0 = time.perf_counter()
                    all_reduce_grads(replicated, group)
                    events.append(("comm", f"sync {st.group} s{st.stage}", c0 - t0, time.perf_counter() - t0))
                continue
            c0 = time.perf_counter()
            chunks = [ck for ck in chunks_of(self.stage_map, key, self.ctx.rank) if ck in self.buckets]
            if chunks:
                for ck in chunks:
                    self.buckets[ck].finish()
                events.append(("comm", f"sync {st.group} s{st.stage}", c0 - t0, time.perf_counter() - t0))
                continue
            params = [p for b in self.stage_map.stage_blocks(key) for p in self.rm.local[b].parameters() if p.requires_grad]
            params = list({id(p): p for p in params}.values())
            if not params:
                continue
            all_reduce_grads(params, group)
            events.append(("comm", f"sync {st.group} s{st.stage}", c0 - t0, time.perf_counter() - t0))

    def close(self) -> None:
        for buckets in self.buckets.values():
            buckets.close()
        self.tiers.close()  # removes the nvme tier's files
        self.rm = self.rank = None  # the model goes with them
        gc.collect()


def _append_line(path: str, row: dict[str, Any]) -> None:
    """One JSON line appended whole (a reader polling the file never sees half a row followed by more)."""
    with open(path, "a") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")


def _diverged(job: Job, step: int, loss: float, start_step: int, removes: bool) -> Exception:
    """The error every rank raises when the loss of `step` is NaN or infinite. The checkpoint taken just before
    that step (this run's, at data position `step`) holds the weights that diverged: rank 0 removes it."""
    from plans.errors import MmplanError
    from runtime.checkpoint import discard

    bad = bool(job.checkpoint_dir and job.checkpoint_every and step > start_step and step % job.checkpoint_every == 0)
    if bad and removes:
        discard(job.checkpoint_dir, step)
    kept = (f"; removed checkpoint step-{step:06d} (its weights gave that loss), the older ones in {job.checkpoint_dir} are kept"
            if bad else f"; the checkpoints in {job.checkpoint_dir} are from before it" if job.checkpoint_dir else "")
    return MmplanError(f"training diverged at step {step}: the loss is {loss} (try a lower --lr); stopped without "
                       f"logging that step or saving its weights{kept}")


def train_rank(ctx: RankContext, job: Job) -> dict[str, Any]:
    """Worker entry for runtime.launch: train, and return rank 0's metrics (and probed gradients)."""
    torch.manual_seed(job.seed)
    trainer = RankTrainer(ctx, job)
    try:
        return trainer.run()
    finally:
        trainer.close()
