"""A homogeneous layout as `--layout` writes it: LayoutSpec, its parser, and its check against a model and cluster."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from planner.solver.candidates import sp_divides
from plans.cluster import Cluster
from plans.errors import MmplanError
from plans.graph import Block, Profile

Schedule = Literal["1f1b", "gpipe", "interleaved"]
Recompute = Literal["none", "selective", "layers", "full"]
# How a layout's blocks are cut into pipeline stages (planner/solver/megatron_split.split_blocks): layers -- every
# transformer layer counts one (a ViT-22B layer as much as a GPT-175B one); flops -- contiguous stages of balanced
# forward + backward FLOPs; encoders-first -- Megatron-LM's multimodal recipe: encoders and projectors on the first
# stage with the LLM's embedding, the LLM's layers split evenly by count.
Split = Literal["layers", "flops", "encoders-first"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
RECOMPUTES: tuple[str, ...] = get_args(Recompute)
SPLITS: tuple[str, ...] = get_args(Split)

_KEYS = ("tp", "pp", "dp", "micro-batch", "schedule", "recompute", "zero", "sequence-parallel", "split")
_ALIASES = {"micro_batch": "micro-batch", "mb": "micro-batch", "sp": "sequence-parallel", "sequence_parallel": "sequence-parallel",
            "colocated_with": "colocated-with"}
_EXAMPLE = ("tp=8,pp=2,dp=32[,micro-batch=1][,schedule=1f1b|gpipe|interleaved:2][,recompute=none|selective|layers|full]"
            "[,zero=1][,sequence-parallel=true][,split=layers|flops|encoders-first]")


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """One layout for every module: degrees, per-replica micro-batch size, schedule, recomputation, ZeRO stage."""

    tp: int
    pp: int
    dp: int
    micro_batch: int = 1  # samples per micro-batch on one data-parallel replica
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1  # model chunks per rank; > 1 only with the interleaved schedule
    recompute: Recompute = "none"
    zero: int = 0
    split: Split = "layers"  # how the stages are cut (Split above)
    sequence_parallel: bool = False  # tp > 1: norm / residual regions sharded along the sequence

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp", "micro_batch", "virtual_stages"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MmplanError(f"layout: {key.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise MmplanError(f"layout: schedule must be one of 1f1b, gpipe, interleaved:V, got {self.schedule!r}")
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise MmplanError(f"layout: the interleaved schedule needs virtual_stages >= 2 and the others 1, got "
                              f"{self.schedule} with virtual_stages={self.virtual_stages}")
        if self.recompute not in RECOMPUTES:
            raise MmplanError(f"layout: recompute must be one of {', '.join(RECOMPUTES)}, got {self.recompute!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise MmplanError(f"layout: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.split not in SPLITS:
            raise MmplanError(f"layout: split must be one of {', '.join(SPLITS)}, got {self.split!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self) -> str:
        """Canonical text that parse_layout reads back to an equal spec."""
        schedule = f"interleaved:{self.virtual_stages}" if self.schedule == "interleaved" else self.schedule
        return (f"tp={self.tp},pp={self.pp},dp={self.dp},micro-batch={self.micro_batch},schedule={schedule},"
                f"recompute={self.recompute},zero={self.zero}" + (",sequence-parallel=true" if self.sequence_parallel else "")
                + f",split={self.split}")


def parse_layout(text: str, default_split: Split = "layers") -> LayoutSpec:
    """`tp=8,pp=2,dp=32[,micro-batch=1][,schedule=1f1b|gpipe|interleaved:2][,recompute=none|selective|layers|full][,zero=1]
    [,sequence-parallel=true][,split=layers|flops|encoders-first]`; `default_split` where no split is written.

    Bare `interleaved` means 2 model chunks per rank. Every problem is one MmplanError naming the item."""
    values = layout_items(text)
    missing = [k for k in ("tp", "pp", "dp") if k not in values]
    if missing:
        raise MmplanError(f"layout {text.strip()!r} lacks {', '.join(missing)}; tp, pp and dp are required ({_EXAMPLE})")
    schedule, chunks = parse_schedule(values.get("schedule", "1f1b"))
    recompute = values.get("recompute", "none").lower()
    if recompute not in RECOMPUTES:
        raise MmplanError(f"recompute must be one of {', '.join(RECOMPUTES)}, got {values['recompute']!r}")
    zero = _positive_int(values.get("zero", "0"), "zero", allow_zero=True)
    if zero > 3:
        raise MmplanError(f"zero must be 0, 1, 2 or 3, got {values['zero']!r}")
    sp = values.get("sequence-parallel", "false").lower()
    if sp not in ("true", "false", "on", "off", "1", "0"):
        raise MmplanError(f"sequence-parallel must be true or false, got {values['sequence-parallel']!r}")
    split = parse_split(values.get("split", default_split))
    return LayoutSpec(tp=_positive_int(values["tp"], "tp"), pp=_positive_int(values["pp"], "pp"),
                      dp=_positive_int(values["dp"], "dp"), micro_batch=_positive_int(values.get("micro-batch", "1"), "micro-batch"),
                      schedule=schedule, virtual_stages=chunks, recompute=recompute, zero=zero,  # type: ignore[arg-type]
                      split=split, sequence_parallel=sp in ("true", "on", "1"))  # type: ignore[arg-type]


def parse_split(value: str, where: str = "") -> Split:
    """A `split=` value (layout_spec.Split), or one line naming the ones there are."""
    split = value.lower()
    if split not in SPLITS:
        raise MmplanError(f"{where}split must be one of {', '.join(SPLITS)}, got {value!r}")
    return split  # type: ignore[return-value]


def layout_items(text: str, keys: Sequence[str] = _KEYS) -> dict[str, str]:
    """The `key=value` items of a layout by canonical key (aliases resolved), each checked to be one of `keys` and
    given once."""
    if not isinstance(text, str) or not text.strip():
        raise MmplanError(f"empty layout; write it as {_EXAMPLE}")
    values: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        key = _ALIASES.get(key, key)
        if not item or not eq or not key or not value:
            raise MmplanError(f"layout item {item!r} is not key=value; write the layout as {_EXAMPLE}")
        if key not in keys:
            raise MmplanError(f"unknown layout key {key!r} in {item!r}; known keys: {', '.join(keys)}")
        if key in values:
            raise MmplanError(f"layout key {key!r} is given twice ({key}={values[key]} and {item})")
        values[key] = value
    return values


def _positive_int(value: str, key: str, *, allow_zero: bool = False) -> int:
    if not value.isdigit() or (int(value) == 0 and not allow_zero):
        kind = "a non-negative integer" if allow_zero else "a positive integer"
        raise MmplanError(f"{key} must be {kind}, got {value!r}")
    return int(value)


def parse_schedule(value: str) -> tuple[Schedule, int]:
    name, colon, v = value.lower().partition(":")
    if name == "interleaved":
        if not colon:
            return "interleaved", 2
        if not v.isdigit() or int(v) < 2:
            raise MmplanError(f"schedule interleaved:V needs V >= 2 model chunks per rank, got {value!r}")
        return "interleaved", int(v)
    if name in ("1f1b", "gpipe") and not colon:
        return name, 1  # type: ignore[return-value]
    raise MmplanError(f"schedule must be 1f1b, gpipe or interleaved:V, got {value!r}")


def check_layout(profile: Profile, cluster: Cluster, global_batch: int, spec: LayoutSpec) -> None:
    """Raise MmplanError when `spec` cannot be laid out on `cluster` for `profile` at `global_batch`."""
    check_batch(global_batch)
    if spec.world_size != cluster.world_size:
        raise MmplanError(f"layout {spec} uses tp*pp*dp = {spec.tp}*{spec.pp}*{spec.dp} = {spec.world_size} GPUs but "
                          f"cluster {cluster.name} has {cluster.world_size}; make tp*pp*dp equal {cluster.world_size}")
    if cluster.gpus_per_node % spec.tp:
        raise MmplanError(f"tp={spec.tp} does not divide the {cluster.gpus_per_node} GPUs per node of cluster "
                          f"{cluster.name}; a tensor-parallel group must fill whole slots of one node")
    check_tp(profile.blocks, spec.tp)
    if global_batch % (spec.dp * spec.micro_batch):
        raise MmplanError(f"global batch {global_batch} is not divisible by dp*micro-batch = {spec.dp}*{spec.micro_batch} "
                          f"= {spec.dp * spec.micro_batch}; choose a global batch that is a multiple of it")
    if spec.schedule == "interleaved" and spec.pp < 2:
        raise MmplanError(f"the interleaved schedule needs pp >= 2, got pp={spec.pp}")
    if spec.sequence_parallel and spec.tp > 1 and not sp_divides(profile.blocks, spec.tp):
        b = next(b for b in profile.blocks if b.supports_tp and b.sequence and b.sequence % spec.tp)
        raise MmplanError(f"sequence parallelism shards each layer's sequence over tp={spec.tp}, but block {b.name} reads "
                          f"a sequence of {b.sequence} and the runtime does not pad it; drop sequence-parallel=true, use a tp "
                          f"that divides it, or solve without --baseline (sequence parallelism per group, where tp divides)")
    parts = spec.pp * spec.virtual_stages
    if parts > len(profile.blocks):
        raise MmplanError(f"pp*virtual stages = {parts} exceeds the {len(profile.blocks)} blocks of {profile.model!r}; "
                          f"every pipeline chunk needs a block")
    sink = profile.blocks[-1].group
    llm = len(profile.blocks) - next(i for i, b in enumerate(profile.blocks) if b.group == sink)
    if spec.split == "encoders-first" and parts > llm:
        raise MmplanError(f"split=encoders-first puts every encoder on the first stage and cuts only the {llm} blocks of "
                          f"group {sink!r} into pp*virtual stages = {parts} chunks; use at most {llm}, or split=flops")


def check_tp(blocks: Sequence[Block], tp: int, where: str = "") -> None:
    """tp must divide each sharded block's heads, kv heads and widths (plans/capabilities.py: tp shards exactly; the
    profile records their gcd, Block.tp_divisor): one line naming the first block that it does not and the tps that would."""
    bad = next((b for b in blocks if not b.takes_tp(tp)), None)
    if bad is not None:
        fits = [d for d in range(1, bad.tp_divisor + 1) if bad.tp_divisor % d == 0]
        shown = ", ".join(map(str, fits[:8])) + (", ..." if len(fits) > 8 else "")
        raise MmplanError(f"{where}tp={tp} does not divide the heads and widths of block {bad.name} (tensor parallelism "
                          f"shards each exactly; their greatest common divisor is {bad.tp_divisor}): use a tp among its "
                          f"divisors {shown}")


def check_batch(global_batch: int) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise MmplanError(f"global batch must be a positive integer, got {global_batch!r}")
