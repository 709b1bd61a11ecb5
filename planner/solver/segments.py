"""The solver's stage figures for every segment [i, j) of a unit at once: cost_models' functions, vectorised."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from cost_models.comm import all_gather_time, dp_link, reduce_scatter_time, zero_collectives
from cost_models.compute import block_time, grad_accumulation_time, tp_shard
from cost_models.fsdp import copy_time, host_floor, overlap_share, segment_gather_exposure, segment_times
from cost_models.memory import (DTYPE_BYTES, activation_residency, activation_transient, kept_activation_bytes, state_residency,
                                zero_divisors)
from cost_models.offload import offload_accounting, overlaps_compute, state_streaming, transfer_time
from cost_models.overhead import optimizer_tensor_time, zero_block_time, zero_optimizer_time
from cost_models.tail import BUCKET_BYTES, hidden_exposure, tail_over
from planner.solver.space import Policy, Setting, Unit
from plans.cluster import Link
from plans.graph import Block

# A stage of blocks [i, j) of a unit costs what cost_models/ says of those blocks: op times (the simulator's
# chunk costs), its tail (tail.tail_over) and its bytes per tier (memory.stage_memory's terms). Here they are
# computed for every (i, j) at once: per-block figures summed with prefix sums (_span), largest blocks with
# range maxima (_range_max), and every alpha-beta cost -- affine in bytes for bytes > 0 and 0 at 0 -- applied
# through its affine form (_affine), so the functions of cost_models/ are called, never rewritten.
# tests/planner/test_candidates.py checks the result equals evaluate() on random built plans.

_BIG = 2.0**31  # bytes at which the affine fits of alpha-beta costs are taken (well-conditioned)


def _affine(fn: Callable[[float], float], x: np.ndarray, cache: dict | None = None, key: tuple = ()) -> np.ndarray | float:
    """fn (an alpha-beta cost, affine in bytes for bytes > 0 and 0 at 0) applied to an array; its two
    coefficients are kept in `cache` under `key` when given (they depend on the link and options, not on bytes)."""
    if cache is not None and key in cache:
        a, b = cache[key]
    else:
        b = (fn(2 * _BIG) - fn(_BIG)) / _BIG
        a = fn(_BIG) - b * _BIG
        if cache is not None:
            cache[key] = (a, b)
    if a == 0.0 and b == 0.0:
        return 0.0  # a cost these options never pay (no ZeRO gather, GPU-resident state ...)
    return np.where(x > 0, a + b * x, 0.0)


def _per_copy(tier: str, cluster) -> float:
    """The latency one more copy to or from `tier` adds (offload.transfer_time's alpha per copy; 0 on the GPU)."""
    return transfer_time(_BIG, tier, cluster, copies=2) - transfer_time(_BIG, tier, cluster, copies=1)


def _more_copies(nbytes: np.ndarray, copies: np.ndarray, alpha: float) -> np.ndarray | float:
    """The latency of every copy beyond the first (the affine cost holds one) of segments moving `nbytes` > 0."""
    if alpha == 0.0:
        return 0.0
    return np.where(nbytes > 0, alpha * (np.maximum(1.0, copies) - 1.0), 0.0)


# A unit of more blocks than this is cut only at this many evenly spaced positions (block indices): the segment
# figures are (positions x positions) matrices and the DP's time is quadratic in them, so a profile of 10,000 blocks
# costs what one of 256 does (issue 30: 3,000 blocks ran out of memory). Figures stay exact sums over the blocks
# between two positions; only where a stage may start is coarser. Units of up to this many blocks are unchanged.
MAX_CUT_POSITIONS = 256


def cut_positions(n: int, limit: int = MAX_CUT_POSITIONS) -> np.ndarray:
    """The block indices 0 = p_0 < ... < p_K = n where a unit of n blocks may be cut (every index when n <= limit)."""
    if n <= limit:
        return np.arange(n + 1)
    return np.unique(np.round(np.linspace(0, n, limit + 1)).astype(np.int64))


def _span(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """S[a, b] = sum of values[positions[a]:positions[b]] (b > a)."""
    c = np.concatenate(([0.0], np.cumsum(values)))[positions]
    return c[None, :] - c[:, None]


def _range_max(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """R[a, b] = max of values[positions[a]:positions[b]] (0 for b <= a)."""
    pieces = np.maximum.reduceat(np.asarray(values, dtype=float), positions[:-1]) if len(values) else np.zeros(0)
    k = len(pieces)
    out = np.zeros((k + 1, k + 1))
    for i in range(k):
        out[i, i + 1:] = np.maximum.accumulate(pieces[i:])
    return out


def _tie_copies(unit: Unit, tp: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """C[a, b]: elements on one tp rank of the tied copies a stage of blocks [pos[a], pos[b]) holds (a tie's other block
    but not its owner: cost_models/ties.with_copies), and T[a, b] their trained tensors. The tie's gradient all-reduce
    between the holders is left to the full simulation (it needs the other holder's ranks): a lower bound here."""
    k = len(pos)
    copies, tensors = np.zeros((k, k)), np.zeros((k, k))
    for owner, others, params in unit.ties:
        def holds(i: int) -> np.ndarray:
            return (pos[:, None] <= i) & (i < pos[None, :])
        other = np.zeros((k, k), dtype=bool)
        for i in others:
            other |= holds(i)
        held = other & ~holds(owner)
        first = unit.blocks[others[0]]
        copies += np.where(held, params / tp_shard(first, tp), 0.0)
        tensors += np.where(held & (not first.frozen), 1.0, 0.0)
    return copies, tensors


class BlockTimes:
    """Per-block op times of a unit at (tp, samples), cached for one search (block_time is the costly call)."""

    def __init__(self, setting: Setting):
        self.setting = setting
        self._cache: dict[tuple, list] = {}
        self._arrays: dict[tuple, dict] = {}
        self._blocks: dict[tuple, object] = {}
        self._kinds: dict[str, int] = {}  # block name -> the number of its content (equal blocks, equal number)
        self._contents: dict[Block, int] = {}
        self.coefficients: dict[tuple, tuple[float, float]] = {}  # _affine's, shared by every Segments of a search

    def arrays(self, unit: Unit, tp: int, samples: float, sp: bool = False) -> dict:
        """The per-segment sums and maxima of a unit at (tp, samples, sequence parallelism) that every (dp, ZeRO, m)
        giving these samples shares (see Segments)."""
        key = (unit.name, tp, samples, sp)
        if key not in self._arrays:
            blocks = unit.blocks
            ops = self.of(unit, tp, samples, sp)
            shard = np.array([tp_shard(b, tp) for b in blocks], dtype=float)
            params = np.array([b.params for b in blocks], dtype=float) / shard
            act = np.array([kept_activation_bytes(b, tp, sequence_parallel=sp) for b in blocks], dtype=float) * samples
            # selective recompute (only blocks with an attention core take the tier, planner/solver/space.Policy.memory):
            # the core leaves the saved activations, its forward is rerun in the backward, and one block's core is
            # rebuilt at a time (memory.stage_memory's transient)
            cores = np.array([b.attention_core_bytes > 0 for b in blocks])
            act_sel = np.where(cores, [kept_activation_bytes(b, tp, sequence_parallel=sp, tier="selective") for b in blocks],
                               act / samples) * samples
            core_bytes = np.where(cores, [b.attention_core_bytes / tp_shard(b, tp) for b in blocks], 0.0) * samples
            core_time = np.array([self.block(b, tp, samples, sp, "selective").bwd - o.bwd if c else 0.0
                                  for b, o, c in zip(blocks, ops, cores)])
            # checkpoints: whole without sequence parallelism, split over the tp ranks with it
            inp = np.array(unit.input_bytes, dtype=float) * samples / (shard if sp else 1.0)
            trained = params * np.array([not b.frozen for b in blocks], dtype=float)  # frozen: no grads / optimizer / sync
            pos = cut_positions(len(blocks))
            k = len(pos)
            copies, copy_tensors = _tie_copies(unit, tp, pos)

            def span(values: np.ndarray) -> np.ndarray:
                return _span(values, pos)

            def largest(values: np.ndarray) -> np.ndarray:
                return _range_max(values, pos)

            self._arrays[key] = dict(
                fwd=span(np.array([o.fwd for o in ops])), fwd_comm=span(np.array([o.fwd_comm for o in ops])),
                bwd=span(np.array([o.bwd for o in ops])), bwd_comm=span(np.array([o.bwd_comm for o in ops])),
                core=span(core_time), act_sel=span(act_sel), core_max=largest(core_bytes),
                params=span(params) + copies, trained=span(trained) + copies * (copy_tensors > 0), largest=largest(params),
                act=span(act), act_max=largest(act),
                # trained parameter tensors (the optimizer's per-tensor cost) and blocks with parameters (ZeRO's
                # fully_shard units): cost_models/overhead.py's measured terms, as the simulator applies them
                tensors=span(np.array([0 if b.frozen else b.param_tensors for b in blocks], dtype=float)) + copy_tensors,
                # every parameter tensor (streamed tensor by tensor from an off-GPU tier) and the activation storages
                # (offloaded storage by storage): offload.transfer_time's copies, as pipeline._cost_chunk counts them
                all_tensors=span(np.array([b.param_tensors for b in blocks], dtype=float)) + copy_tensors,
                storages=span(np.array([b.saved_tensors for b in blocks], dtype=float)),
                sharded=span(np.array([1.0 if b.params else 0.0 for b in blocks])),
                # per block (not per segment): cost_models/fsdp.py's ZeRO timing per block
                block_fwd=np.array([o.fwd for o in ops]), block_bwd=np.array([o.bwd for o in ops]), block_core=core_time,
                block_params=params, block_trained=trained,
                checkpoint=span(inp), valid=np.arange(k)[:, None] < np.arange(k)[None, :], positions=pos)
        return self._arrays[key]

    def of(self, unit: Unit, tp: int, samples: float, sp: bool = False) -> list:
        key = (unit.name, tp, samples, sp)
        if key not in self._cache:
            self._cache[key] = [self.block(b, tp, samples, sp) for b in unit.blocks]
        return self._cache[key]

    def kind(self, b: Block) -> int:
        """A number equal for blocks of equal content but their name and group (a model's identical layers cost the
        same), so per-block cost calls are made once per distinct block."""
        k = self._kinds.get(b.name)
        if k is None:
            k = self._kinds[b.name] = self._contents.setdefault(replace(b, name="", group=""), len(self._contents))
        return k

    def block(self, b: Block, tp: int, samples: float, sp: bool = False, recompute: bool | str = False):
        """block_time of one block, shared by the blocks of equal content (a model's identical layers)."""
        key = (self.kind(b), tp, samples, sp, recompute)
        if key not in self._blocks:
            st = self.setting
            self._blocks[key] = block_time(b, samples, tp, st.cluster, dtype=st.dtype, measured_micro_batch=st.measured_micro_batch,
                                           sequence_parallel=sp, recompute=recompute)
        return self._blocks[key]

    def work(self, unit: Unit, tp: int, samples: float, sp: bool = False) -> float:
        """Seconds of one micro-batch's forward and backward through every block (no recompute, no transfers)."""
        return sum(o.fwd + o.fwd_comm + o.bwd + o.bwd_comm for o in self.of(unit, tp, samples, sp))

    def sp_dominates(self, unit: Unit, tp: int, samples: float) -> bool:
        """Whether sequence parallelism at (tp, samples) costs no more than without it in every figure a stage is
        timed and sized by (op times, recomputed core, saved activations, checkpoints, transients): then every layout
        without it is matched by the same layout with it, which the cost model never times slower (op durations
        and bytes only shrink; the exposed gradient sync grows by at most what the last backward shrinks) -- the
        search tries sequence parallelism alone there. tests/planner/test_solve.py checks this against a brute
        force over both."""
        key = ("dominates", unit.name, tp, samples)
        if key not in self._cache:
            on, off = self.arrays(unit, tp, samples, True), self.arrays(unit, tp, samples, False)
            ops_on, ops_off = self.of(unit, tp, samples, True), self.of(unit, tp, samples, False)
            ok = all(a.fwd <= b.fwd and a.bwd <= b.bwd and a.fwd_comm <= b.fwd_comm and a.bwd_comm <= b.bwd_comm
                     for a, b in zip(ops_on, ops_off))
            valid = on["valid"]  # segments [i, j) with i < j (the spans' other entries are differences of no segment)
            ok = ok and all(bool(np.all(on[k][valid] <= off[k][valid] * (1 + 1e-12) + 1e-300))
                            for k in ("core", "act", "act_sel", "act_max", "core_max", "checkpoint"))
            self._cache[key] = ok
        return self._cache[key]


@dataclass
class Segments:
    """Op durations, tails and memory of a stage of blocks [i, j) of a unit, for every (i, j) of cut positions, at one
    (tp, dp, ZeRO stage, micro-batch count), for each policy; figures are cached per policy."""

    unit: Unit
    setting: Setting
    tp: int
    dp: int
    zero: int
    micro_batches: int
    times: BlockTimes | None = None
    sequence_parallel: bool = False  # tp > 1: the layout's norm / residual regions sharded along the sequence
    reshard_after_forward: bool = True  # ZeRO-3: FSDP2 gathers again for the backward (plans.plan.Group)
    _cache: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        st = self.setting
        self.samples = st.global_batch / self.micro_batches / self.dp  # per replica and micro-batch
        if self.times is None:
            self.times = BlockTimes(st)
        sp = self.sequence_parallel
        arrays = self.times.arrays(self.unit, self.tp, self.samples, sp)  # shared with every Segments of these samples
        # segment [a, b) of the arrays is blocks positions[a]:positions[b]; n counts the pieces between positions
        # (the blocks themselves unless the unit has more than MAX_CUT_POSITIONS)
        self.positions = arrays["positions"]
        self.n = len(self.positions) - 1
        self.fwd, self.fwd_comm, self.bwd, self.bwd_comm = (arrays[k] for k in ("fwd", "fwd_comm", "bwd", "bwd_comm"))
        self.width = DTYPE_BYTES[st.dtype]
        self.params = arrays["params"]
        self.trained = arrays["trained"]
        self.tensors, self.sharded = arrays["tensors"], arrays["sharded"]
        self.all_tensors, self.storages = arrays["all_tensors"], arrays["storages"]
        self.largest = arrays["largest"]  # parameters of the largest block
        self.act, self.act_max = arrays["act"], arrays["act_max"]
        self.checkpoint = arrays["checkpoint"]
        self.core, self.act_sel, self.core_max = arrays["core"], arrays["act_sel"], arrays["core_max"]
        self.valid = arrays["valid"]
        self.blocks = {k: arrays[k] for k in ("block_fwd", "block_bwd", "block_core", "block_params", "block_trained")}
        self.dp_link = self._dp_link()

    def _dp_link(self) -> Link:
        """The link of a stage's data-parallel group when the unit's ranks start at a node's first rank (or inside
        one node; allocate.assign_ranks places them so)."""
        return dp_link(self.setting.cluster, range(self.dp * self.tp), self.tp)

    def time(self, policy: Policy) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(forward op, backward op, tail, optimizer step, parameter gather) of every segment: the cost_models
        functions the simulator composes (pipeline.py's chunk costs and stage tail), applied to every segment's
        bytes at once through their affine form (_affine)."""
        key = ("time", policy)
        if key in self._cache:
            return self._cache[key]
        st, cl, dp, z = self.setting, self.setting.cluster, self.dp, self.zero
        recompute = policy.activations == "recompute"
        param_bytes = self.params * self.width
        hooks = zero_block_time(self.sharded, z, cl, param_bytes) / 2  # ZeRO's FSDP2 work per block and byte, both ways
        selective = policy.activations == "selective"
        fwd, fwd_comm = self.fwd + hooks, self.fwd_comm
        extra = hooks + grad_accumulation_time(self.trained, micro_batches=self.micro_batches, dp=dp, zero=z,
                                               grads_tier=policy.grads, cluster=cl, dtype=st.dtype)
        bwd = self.bwd + (self.fwd if recompute else self.core if selective else 0.0) + extra
        bwd_comm = self.bwd_comm + (self.fwd_comm if recompute else 0.0)
        act_out = accounting = 0.0
        memo, k = self.times.coefficients, (dp, z, policy, self.tp)  # the link is the one (dp, tp) gives
        if policy.activations.startswith("offload-"):  # one copy per storage, each way
            tier = policy.activations.removeprefix("offload-")
            act_out = _affine(lambda x: transfer_time(x, tier, cl), self.act, memo, ("act", *k)) \
                + _more_copies(self.act, self.storages, _per_copy(tier, cl))
            accounting = offload_accounting(self.storages, cl)
        params_in = _affine(lambda x: state_streaming(x, dp=dp, zero=z, memory=policy, cluster=cl).params_in, param_bytes,
                            memo, ("in", *k)) + _more_copies(param_bytes, self.all_tensors, _per_copy(policy.params, cl))
        grads_out = _affine(lambda x: state_streaming(x, dp=dp, zero=z, memory=policy, cluster=cl).grads_out, param_bytes,
                            memo, ("out", *k)) + _more_copies(param_bytes, self.tensors, _per_copy(policy.grads, cl))
        link = self.dp_link
        t_fwd = act_out + params_in
        t_bwd = act_out + params_in + grads_out + accounting
        if overlaps_compute(cl):  # GPUs: ZeRO's collectives per block (cost_models/fsdp.py), as pipeline._zero_blocks
            b = self.blocks
            block_bwd = b["block_bwd"] + (b["block_fwd"] if recompute else b["block_core"] if selective else 0.0)
            zf, zb, copies = self._zero_blocks(block_bwd, memo, k, link)
            fwd, bwd = fwd + copies[0], bwd + copies[1]
            fwd_op = zf + hooks + copies[0] + fwd_comm + np.maximum(0.0, t_fwd - fwd)
            bwd_op = zb + extra + copies[1] + bwd_comm + np.maximum(0.0, t_bwd - bwd)
        else:  # CPU ranks: nothing hides behind compute (cost_models.offload.overlaps_compute)
            gather = _affine(lambda x: zero_collectives(x, dp=dp, zero=z, link=link).gather, param_bytes, memo, ("gather", *k))
            scatter = _affine(lambda x: zero_collectives(x, dp=dp, zero=z, link=link).scatter, param_bytes, memo, ("scatter", *k))
            back = gather if self.reshard_after_forward else 0.0
            fwd_op = fwd + fwd_comm + t_fwd + gather
            bwd_op = bwd + bwd_comm + t_bwd + back + scatter

        def tail(x: float):
            return tail_over(x, dp=dp, zero=z, memory=policy, link=link, cluster=cl, dtype=st.dtype, optimizer=st.optimizer)

        # the gradient sync hides behind the last backward but for its last bucket and the SMs it takes from it
        # (tail.tail_over's overlap_s, tail.hidden_exposure);
        # frozen parameters are neither synced nor updated
        full = _affine(lambda x: tail(x).grad_sync, self.trained, memo, ("sync", *k))
        bucket = _affine(lambda x: tail(x).grad_sync, np.minimum(self.trained, BUCKET_BYTES / self.width), memo, ("sync", *k))
        sync = hidden_exposure(full, bucket, bwd, overlap_share(cl)) if overlaps_compute(cl) else full
        opt = _affine(lambda x: tail(x).optimizer, self.trained, memo, ("opt", *k)) \
            + (optimizer_tensor_time(policy, cl) + zero_optimizer_time(1, z, cl)) * self.tensors
        gathered = _affine(lambda x: tail(x).param_gather, self.trained, memo, ("gathered", *k))
        if overlaps_compute(cl) and z in (1, 2) and dp > 1:  # GPUs: where FSDP2 gathers, the next first forward
            gathered = self._first_forward_gather(memo, k, link)
        out = tuple(x if isinstance(x, np.ndarray) else np.full_like(self.params, x)
                    for x in (fwd_op, bwd_op, sync + opt + gathered, opt, gathered))
        self._cache[key] = out
        return out

    def _zero_blocks(self, block_bwd: np.ndarray, memo: dict, k: tuple, link: Link) -> tuple[np.ndarray, np.ndarray, tuple]:
        """(forward, backward) of every segment with ZeRO's collectives per block (fsdp.segment_times over the blocks'
        forward and `block_bwd`, their backward with recompute), and FSDP2's (forward, backward) copies
        (fsdp.copy_time) per segment: pipeline._zero_blocks over every segment at once."""
        cl, dp, z = self.setting.cluster, self.dp, self.zero
        share = zero_divisors(z, dp)
        again = z >= 3 and self.reshard_after_forward
        pb, tb = self.blocks["block_params"] * self.width, self.blocks["block_trained"] * self.width
        gathers = _affine(lambda x: all_gather_time(x, share.params, link), pb, memo, ("block gather", *k)) if z >= 3 else 0.0 * pb
        scatters = _affine(lambda x: reduce_scatter_time(x, share.grads, link), tb, memo, ("block scatter", *k)) if z >= 2 else 0.0 * tb
        zf, zb = segment_times(self.blocks["block_fwd"], block_bwd, gathers + 0.0 * pb, scatters + 0.0 * tb,
                               share=overlap_share(cl), backward_gather=again, host_s=host_floor(cl),
                               positions=self.positions)
        copy_in = _span(copy_time(pb, dp, cl), self.positions) if z >= 3 else 0.0
        copy_out = _span(copy_time(tb, dp, cl), self.positions) if z >= 2 else 0.0
        return zf, zb, (copy_in, (copy_in if again else 0.0) + copy_out)

    def _first_forward_gather(self, memo: dict, k: tuple, link: Link) -> np.ndarray:
        """What ZeRO 1-2's parameter all-gather adds to every segment's first forward of a step on a GPU, per block
        beside the previous block's compute (fsdp.first_forward_gather over every segment at once)."""
        cl, dp = self.setting.cluster, self.dp
        tb = self.blocks["block_trained"] * self.width
        gathers = _affine(lambda x: all_gather_time(x, dp, link), tb, memo, ("block gather 1-2", *k)) + 0.0 * tb
        scatters = _affine(lambda x: reduce_scatter_time(x, dp, link), tb, memo, ("block scatter", *k)) + 0.0 * tb \
            if self.zero == 2 else 0.0 * tb
        exposed = segment_gather_exposure(self.blocks["block_fwd"], gathers, scatters, share=overlap_share(cl),
                                          host_s=host_floor(cl), positions=self.positions)
        return np.where(self.valid, exposed + _span(copy_time(tb, dp, cl), self.positions), 0.0)

    def memory(self, policy: Policy) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(gpu, cpu, nvme) bytes per rank of every segment as base + in_flight * per_micro_batch pairs: the
        terms of cost_models/memory.stage_memory (state_residency, activation_residency, activation_transient)
        applied to every segment's sums at once (activation_residency is linear; the transient is that of the
        segment's largest block)."""
        key = ("memory", policy)
        if key in self._cache:
            return self._cache[key]
        st = self.setting
        base = state_residency(self.params, self.largest, dp=self.dp, zero=self.zero, memory=policy, dtype=st.dtype,
                               reshard_after_forward=self.reshard_after_forward,
                               optimizer=st.optimizer, trained=self.trained)
        selective = policy.activations == "selective"
        base = base.put("gpu", self.core_max if selective else activation_transient(policy.activations, self.act_max))
        per_mb = activation_residency(policy.activations, self.act_sel if selective else self.act, self.checkpoint)
        zeros = np.zeros_like(self.params)
        out = tuple(zeros + x for x in (base.gpu, per_mb.gpu, base.cpu, per_mb.cpu, base.nvme, per_mb.nvme))
        self._cache[key] = out
        return out

    def fits(self, policy: Policy, in_flight: float) -> np.ndarray:
        """Segments whose stage fits the GPU and this rank's share of host memory and NVMe."""
        g0, g1, c0, c1, n0, n1 = self.memory(policy)
        st = self.setting
        return (self.valid & (g0 + in_flight * g1 <= st.cluster.device.memory_bytes)
                & (c0 + in_flight * c1 <= st.host_share) & (n0 + in_flight * n1 <= st.nvme_share))

    def room(self, policy: Policy) -> np.ndarray:
        """The most micro-batches in flight each segment's stage holds and still fits (fits(policy, f) is
        room >= f; -inf where it never fits or the segment is empty)."""
        key = ("room", policy)
        if key in self._cache:
            return self._cache[key]
        g0, g1, c0, c1, n0, n1 = self.memory(policy)
        st = self.setting
        room = np.where(self.valid, np.inf, -np.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            for base, per, cap in ((g0, g1, st.cluster.device.memory_bytes), (c0, c1, st.host_share), (n0, n1, st.nvme_share)):
                if cap >= 0 and not base.any() and not per.any():
                    continue  # nothing in this tier
                limit = np.where(per > 0, (cap - base) / np.where(per > 0, per, 1.0), np.where(base <= cap, np.inf, -np.inf))
                limit = np.where(base > cap, -np.inf, limit)
                room = np.minimum(room, limit)
        self._cache[key] = room
        return room

    def binds(self, policy: Policy, low: float, high: float) -> bool:
        """Whether some segment fits at `low` micro-batches in flight but not at `high`."""
        return bool(np.any(self.fits(policy, low) & ~self.fits(policy, high)))
