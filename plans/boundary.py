"""Boundaries between groups: which rank sends which sample slice of each micro-batch to which rank.

Sample convention (the runtime and the cost model rely on it):

- Micro-batch j of a step covers global samples [j*M, (j+1)*M), M = training.micro_batch. Every
  group processes the same micro-batches in the same order, so a transfer is stated once, as
  sample offsets *within* a micro-batch, and repeats for every micro-batch.
- A group with data-parallel degree dp gives replica r the slice [r*M/dp, (r+1)*M/dp) of every
  micro-batch (dp must divide M).
- Inside a stage the ranks are listed tp fastest: replica r's tp shards are ranks[r*tp:(r+1)*tp].
- For a profile edge src_block -> dst_block whose blocks lie in different groups, the sender of a
  source replica is its tp-rank-0 rank in the stage holding src_block (tp shards hold the same
  output after their all-reduce). Every rank of every destination replica in the stage holding
  dst_block (all its tp shards need the full input) receives, from each source replica, the
  overlap of the two slices: one Transfer(src_rank, dst_rank, start, stop) per non-empty overlap.
  Fan-in (source dp > destination dp), fan-out, equal dp and colocated groups (src_rank ==
  dst_rank: a local hand-over) all follow from this one rule; gradients travel the same
  transfers backwards.
- An encoder feeding several blocks (cross-attention into many LLM layers) gives one boundary per
  edge. Boundaries are ordered by the execution index of (src_block, dst_block) in the profile,
  transfers by (dst_rank, start).
"""
from __future__ import annotations

from plans.errors import FormatError
from plans.graph import Edge, Profile
from plans.plan import Boundary, Group, Stage, Training, Transfer


def derive_boundaries(groups: tuple[Group, ...], profile: Profile, training: Training) -> tuple[Boundary, ...]:
    """One Boundary per profile edge whose src and dst blocks are in different groups."""
    where = _placement(groups)
    order = {b.name: i for i, b in enumerate(profile.blocks)}
    edges = sorted(profile.edges, key=lambda e: (order.get(e.src, -1), order.get(e.dst, -1)))
    return tuple(
        _boundary(e, where, training.micro_batch)
        for e in edges
        if _locate(where, e.src)[0].name != _locate(where, e.dst)[0].name
    )


def slice_of(replica: int, dp: int, micro_batch: int) -> tuple[int, int]:
    """Samples [start, stop) of each micro-batch that data-parallel replica `replica` of `dp` processes."""
    if micro_batch % dp:
        raise FormatError(f"a micro-batch of {micro_batch} samples cannot be split over dp={dp} replicas; make dp divide it")
    share = micro_batch // dp
    return replica * share, (replica + 1) * share


def _boundary(edge: Edge, where: dict[str, tuple[Group, Stage]], micro_batch: int) -> Boundary:
    src_group, src_stage = _locate(where, edge.src)
    dst_group, dst_stage = _locate(where, edge.dst)
    return Boundary(
        src_group=src_group.name,
        dst_group=dst_group.name,
        src_block=edge.src,
        dst_block=edge.dst,
        bytes_per_sample=edge.bytes,
        transfers=_transfers(src_group, src_stage, dst_group, dst_stage, micro_batch),
    )


def _transfers(src: Group, src_stage: Stage, dst: Group, dst_stage: Stage, micro_batch: int) -> tuple[Transfer, ...]:
    """Every dst rank gets the overlap of its replica's slice with each src replica's slice."""
    out = []
    for d in range(dst.dp):
        d_start, d_stop = slice_of(d, dst.dp, micro_batch)
        for s in range(src.dp):
            s_start, s_stop = slice_of(s, src.dp, micro_batch)
            start, stop = max(d_start, s_start), min(d_stop, s_stop)
            if start < stop:
                src_rank = src_stage.ranks[s * src.tp]  # tp rank 0 of source replica s
                out += [Transfer(src_rank, dst_rank, start, stop) for dst_rank in dst_stage.ranks[d * dst.tp : (d + 1) * dst.tp]]
    return tuple(sorted(out, key=lambda t: (t.dst_rank, t.start, t.src_rank)))


def _placement(groups: tuple[Group, ...]) -> dict[str, tuple[Group, Stage]]:
    return {b: (g, s) for g in groups for s in g.stages for b in s.blocks}


def _locate(where: dict[str, tuple[Group, Stage]], block: str) -> tuple[Group, Stage]:
    try:
        return where[block]
    except KeyError:
        raise FormatError(f"block {block!r} of the profile is in no stage of the plan; place it in one group's stage") from None
