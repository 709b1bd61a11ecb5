"""A stage's tensor parallelism in one call: shard its blocks (tensor_parallel.py), its token embedding, LM head
and loss over the vocabulary (vocab_parallel.py), and mark its runs of sequence-parallel blocks
(sequence_parallel.py). Order: vocabulary first (it may share a tied weight between embedding and head),
then the transformer blocks, then the runs, which wrap the sharded blocks' forwards."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from plans.errors import MmplanError

from .sequence_parallel import SequenceRun, sequence_parallel_params, sequence_runs, set_sequence_ends
from .tensor_parallel import apply_tp, check_tp, supports_sequence_parallel, supports_tp
from .vocab_parallel import shard_embedding, shard_head


@dataclass
class StageTP:
    """What parallelize_stage did: the vocabulary-parallel blocks and the parameters whose gradients are
    partial under sequence parallelism (to all-reduce over the tp group before the optimizer)."""

    vocab_blocks: list[str] = field(default_factory=list)
    sequence_blocks: list[str] = field(default_factory=list)
    partial_params: list[nn.Parameter] = field(default_factory=list)


def parallelize_stage(program: Any, blocks: tuple[str, ...], local: dict[str, nn.Module], group: Any,
                      tp_rank: int, tp: int, *, vocab: int, leaving: set[str],
                      sequence_parallel: bool = False) -> StageTP:
    """Shard one stage's blocks over its replica's tp group (this process is tp_rank of tp).

    leaving: the stage's blocks whose outputs routes carry to other stages (they stay replicated).
    """
    done = StageTP()
    shared: dict[int, nn.Parameter] = {}
    originals = {id(p): p for b in blocks for p in local[b].parameters()}  # held: ids stay unique
    for b in blocks:
        block = local[b]
        if shard_embedding(block, group, tp_rank, tp, vocab, shared) or \
                shard_head(program, b, block, group, tp_rank, tp, vocab, leaving, shared):
            done.vocab_blocks.append(b)
    for b in blocks:
        for n, p in local[b].named_parameters():
            if id(p) in shared and id(p) in originals:
                raise MmplanError(f"{b}.{n} is tied to a vocabulary-parallel weight but cannot be sharded with it "
                                  f"(its output leaves the stage or it is not an LM head); untie it or use tp=1")
    sp = {b for b in blocks if sequence_parallel and supports_sequence_parallel(local[b])}
    for b in blocks:
        if supports_tp(local[b]):
            check_tp(local[b], tp)
            apply_tp(local[b], group, tp_rank, tp, sequence_parallel=b in sp)
    for b, (scatter_in, gather_out, run) in _with_runs(program, sequence_runs(program, blocks, sp, leaving)).items():
        set_sequence_ends(local[b], group, scatter_in=scatter_in, gather_out=gather_out, run=run)
        done.sequence_blocks.append(b)
        done.partial_params.extend(sequence_parallel_params(local[b]))
    return done


def _with_runs(program: Any, ends: dict[str, tuple[bool, bool]]) -> dict[str, tuple[bool, bool, SequenceRun]]:
    """Each sequence-parallel block's ends and its run (one SequenceRun shared by a run's blocks: a new one where a
    block slices its input, else its producer's, the block whose sliced output it reads)."""
    runs: dict[str, SequenceRun] = {}
    producer = {}
    for b, (_, gather_out) in ends.items():
        if not gather_out:
            (user,) = program.blocks[b].users
            producer[user] = b
    out = {}
    for b, (scatter_in, gather_out) in ends.items():  # program order: a producer comes before its reader
        p = producer.get(program.blocks[b])
        runs[b] = runs[p] if not scatter_in and p in runs else SequenceRun()
        out[b] = (scatter_in, gather_out, runs[b])
    return out
