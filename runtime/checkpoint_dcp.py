"""Checkpoints on torch.distributed.checkpoint (DCP): every rank writes its own shards, a load reshards to any plan.

Format `mmplan.checkpoint/2` (runtime/checkpoint.py keeps the directory, manifest, lineage and rotation rules):
    D/step-000040/manifest.json     written last by rank 0; names every file below with its sha256 and size
    D/step-000040/.metadata         DCP's index: every key's global shape, dtype and the chunks each file holds
    D/step-000040/__R_0.distcp      what rank R wrote: its own shards (DCP's FileSystemWriter, one file per rank)
Keys are layout-independent: `model.<block>.<param>` (the full parameter) and `optim.<block>.<param>.<state>`
(`step`, `exp_avg`, `exp_avg_sq`, `master`), the names of format /1's block files. Each rank offers only its local
values, wrapped as DTensors that say where they sit in the full tensor: a tensor-parallel shard (Shard(dim) on the
stage's tp ranks), a ZeRO shard (Shard(0) on its data-parallel ranks, FSDP2's torch.chunk split), or both (a 2-D
mesh, tp outer, as apply_zero shards the tp-local tensor). A value several ranks hold whole (dp replicas) is a plain
tensor: DCP's planner has one of them write it. Nothing is gathered: no rank holds more than its own shards, on save
or on load, and DCP reads, for each destination shard, the overlapping chunks of whatever plan wrote them (dp <-> pp
<-> ZeRO-3, colocated <-> non-colocated, other tp). The meshes are built with `_init_backend=False`: they only place
shards (DCP plans over its own process group), so building them costs no collective.

Save protocol (collective over every rank): prepare_step (rank 0 clears the step directory), barrier, dcp.save or
dcp.async_save (a snapshot staged in host memory, written by a thread over a separate gloo group while training
goes on), then complete: each rank hashes the files it wrote, rank 0 hashes .metadata and writes the manifest.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from plans.errors import MmplanError
from runtime.checkpoint import FORMAT_DCP, MANIFEST, BlockFile, Manifest, step_dir, verified_file
from runtime.tp_shards import full_parameter_names

METADATA = ".metadata"


@dataclass(frozen=True)
class Placed:
    """Where a rank's local value of a parameter-shaped tensor sits in the full one (mesh None: it is whole)."""

    mesh: DeviceMesh | None
    placements: tuple[Any, ...]
    shape: torch.Size  # the full tensor's shape

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        if self.mesh is None or local.dim() == 0:
            return local
        stride = torch.empty(self.shape, device="meta").stride()
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=stride)


def placements(stages: Iterable[Any], modules: Mapping[str, nn.Module], rank: int) -> dict[str, tuple[nn.Parameter, Placed]]:
    """Full parameter name -> (parameter, its Placed) for every parameter of this rank's stages' blocks."""
    out: dict[str, tuple[nn.Parameter, Placed]] = {}
    for st in stages:
        for b in st.blocks:
            infos = full_parameter_names(modules[b])
            for n, p in modules[b].named_parameters():
                out[f"{b}.{n}"] = (p, _placed(st, infos[n], p, rank, f"{b}.{n}"))
    return out


def _placed(st: Any, info: Any, p: torch.Tensor, rank: int, name: str) -> Placed:
    tp_sharded = info.dim is not None and info.parts > 1
    zero = isinstance(p, DTensor)
    shape = torch.Size(info.full_shape if tp_sharded else p.shape)
    if not (tp_sharded or zero):
        return Placed(None, (), shape)
    rows = [sorted(st.ranks[r * st.tp + k] for r in range(st.dp)) for k in range(st.tp)]  # new_group sorts its ranks
    mine = next(k for k, row in enumerate(rows) if rank in row)
    if zero and p.device_mesh.mesh.flatten().tolist() != rows[mine]:
        raise MmplanError(f"checkpoint: parameter {name} is ZeRO-sharded over ranks {p.device_mesh.mesh.tolist()}, "
                          f"not its stage's data-parallel ranks {rows[mine]}")
    device = p.device.type
    if tp_sharded and info.index != mine:
        raise MmplanError(f"checkpoint: parameter {name} is tp shard {info.index} on rank {rank}, tp index {mine}")
    if tp_sharded and zero:
        return Placed(DeviceMesh(device, torch.tensor(rows), _init_backend=False), (Shard(info.dim), Shard(0)), shape)
    if tp_sharded:
        column = rows[mine].index(rank)
        mesh = DeviceMesh(device, torch.tensor([row[column] for row in rows]), _init_backend=False)
        return Placed(mesh, (Shard(info.dim),), shape)
    return Placed(DeviceMesh(device, torch.tensor(rows[mine]), _init_backend=False), (Shard(0),), shape)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(state: torch.Tensor, p: torch.Tensor) -> bool:
    """An optimizer state tensor placed as its parameter (same local shape), not a scalar like `step`."""
    return state.dim() > 0 and tuple(state.shape) == tuple(_local(p).shape)


def rank_state(stages: Iterable[Any], modules: Mapping[str, nn.Module], tiers: Any, rank: int,
               copies: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """This rank's DCP state dict: its blocks' parameters and their optimizer state, each as its local shard.
    `copies`: this rank's copies of parameters tied across stages -> the tie's name (Rank.tie_names); a copy's
    optimizer state is its owner's (identical: the copies' gradients are summed, runtime/ties.py), saved once, by the
    owner's stage, under the owner's name, as a single-stage run saves it."""
    stages, copies = list(stages), copies or {}
    placed = placements(stages, modules, rank)
    optimizer = tiers.state_by_name()
    out: dict[str, torch.Tensor] = {}
    for st in stages:
        for b in st.blocks:
            for n, value in tiers.block_params(b, modules[b]).items():
                p, where = placed[n]
                out[f"model.{n}"] = where.wrap(_local(value).detach())
                for k, s in ({} if n in copies else optimizer.get(n, {})).items():
                    out[f"optim.{n}.{k}"] = where.wrap(s) if _like(s, p) else s
    return out


# --- saving --------------------------------------------------------------------------------------


def prepare_step(root: str | os.PathLike, step: int, rank: int) -> Path:
    """Rank 0 empties the step's directory (a stale or abandoned write of the same step); call a barrier after."""
    d = step_dir(root, step)
    if rank == 0:
        try:
            if d.exists():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(d / MANIFEST)  # first: a removal cut short leaves an incomplete step, never a corrupt one
                shutil.rmtree(d)
            d.mkdir(parents=True)
        except OSError as e:
            raise MmplanError(f"cannot write checkpoint directory {d}: {e.strerror or e}") from None
    return d


def save(state: Mapping[str, torch.Tensor], d: Path, *, group: Any = None, asynchronous: bool = False) -> Any:
    """dcp.save (returns None) or dcp.async_save (returns its Future: wait with `wait`) of `state` into `d`."""
    writer = dcp.FileSystemWriter(str(d), single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        if asynchronous:
            return dcp.async_save(dict(state), storage_writer=writer, process_group=group)
        dcp.save(dict(state), storage_writer=writer, process_group=group)
    except (OSError, CheckpointException) as e:
        raise write_error(e, d) from None
    return None


def wait(future: Any, d: Path) -> None:
    """The end of an asynchronous save; its failure as write_error."""
    try:
        future.result()
    except (OSError, CheckpointException) as e:
        raise write_error(e, d) from None


def write_error(e: BaseException, d: Path) -> MmplanError:
    """One line for a failed DCP write (a full disk, a file size limit): the file and the reason. DCP reports every
    rank's failure on every rank as a CheckpointException (a BaseException: it must not escape as one)."""
    rank, cause = next(iter(e.failures.items())) if isinstance(e, CheckpointException) and e.failures else (None, (e, None))
    cause = cause[0]
    if isinstance(cause, CheckpointException) and cause.failures:
        rank, (cause, _) = next(iter(cause.failures.items()))
    name = getattr(cause, "filename", None) or (d / f"__{rank}_0.distcp" if rank is not None else d)
    reason = getattr(cause, "strerror", None) or " ".join(str(cause).split())[:200]
    return MmplanError(f"cannot write checkpoint file {name}: {reason} (checkpoint directory {d.parent}); free space "
                       "there or choose another --checkpoint-dir")


def own_files(d: Path, rank: int) -> dict[str, BlockFile]:
    """sha256 and size of the files this rank wrote into step directory `d` (rank 0 also DCP's .metadata)."""
    names = sorted(p.name for p in d.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        names.append(METADATA)
    out = {}
    for name in names:
        h, size = hashlib.sha256(), 0
        try:
            with open(d / name, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
                    size += len(chunk)
        except OSError as e:
            raise MmplanError(f"cannot complete checkpoint {d}: {name}: {e.strerror or e}") from None
        out[name] = BlockFile(name, name, h.hexdigest(), size)
    return out


# --- loading -------------------------------------------------------------------------------------


def verify_share(manifest: Manifest, rank: int, world: int) -> str:
    """Check the sha256 of every world-th file of the checkpoint (this rank's share); '' or the refusal."""
    for i, name in enumerate(sorted(manifest.files)):
        if i % world == rank:
            try:
                verified_file(manifest, name)
            except MmplanError as e:
                return str(e)
    return ""


def load(manifest: Manifest, stages: Iterable[Any], modules: Mapping[str, nn.Module], tiers: Any, rank: int,
         group: Any = None, copies: Mapping[str, str] | None = None) -> None:
    """Read this rank's shards of every parameter and its optimizer state from a DCP checkpoint (any plan wrote it)
    and install them. Collective over every rank. A tie's copy (`copies`, as rank_state's) takes its owner's
    optimizer state."""
    stages, copies = list(stages), copies or {}
    placed = placements(stages, modules, rank)
    known = dcp.FileSystemReader(manifest.path).read_metadata().state_dict_metadata
    template = tiers.state_by_name()  # this rank's optimizer state (zeros before any step), its local shapes
    wanted: dict[str, torch.Tensor] = {}
    states: dict[str, tuple[str, str]] = {}  # key in the checkpoint -> (this rank's parameter, state name)
    for n, (p, where) in placed.items():
        _check_key(manifest, known, f"model.{n}", where.shape)
        wanted[f"model.{n}"] = where.wrap(torch.empty_like(_local(p).detach(), device="cpu"))
        if n not in template:
            continue
        src = copies.get(n, n)  # the key the state was saved under
        for k in sorted(key[len(f"optim.{src}."):] for key in known if key.startswith(f"optim.{src}.")):
            meta = known[f"optim.{src}.{k}"]
            like = template[n].get(k)
            shape = torch.Size(meta.size)
            states[f"optim.{src}.{k}"] = (n, k)
            if shape == where.shape and shape:
                local = torch.empty(_local(p).shape, dtype=meta.properties.dtype)
                wanted[f"optim.{src}.{k}"] = where.wrap(local)
            elif like is not None and like.dim() == 0 and not shape:
                wanted[f"optim.{src}.{k}"] = torch.empty((), dtype=meta.properties.dtype)
            else:
                raise MmplanError(f"checkpoint {manifest.path}: optimizer state {k} of {n} has shape {list(shape)}, "
                                  f"the parameter {list(where.shape)}; refusing to resume")
    try:
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(manifest.path), process_group=group)
    except (OSError, CheckpointException) as e:
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        raise MmplanError(f"cannot read checkpoint {manifest.path}: {' '.join(str(cause).split())[:200]}; refusing "
                          "to resume") from None
    for st in stages:
        for b in st.blocks:
            values = {f"{b}.{n}": _local(wanted[f"model.{b}.{n}"]) for n, _ in modules[b].named_parameters()}
            _install_params(tiers, b, modules[b], values)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, (n, k) in states.items():
        state.setdefault(n, {})[k] = _local(wanted[key])
    tiers.load_state_by_name(state)


def _check_key(manifest: Manifest, known: Mapping[str, Any], key: str, shape: torch.Size) -> None:
    if key not in known:
        raise MmplanError(f"checkpoint {manifest.path} has no parameter {key[len('model.'):]!r}; was it written for "
                          "another model?")
    if torch.Size(known[key].size) != shape:
        raise MmplanError(f"checkpoint {manifest.path}: parameter {key[len('model.'):]} has shape {list(known[key].size)}, "
                          f"the model's {list(shape)}; refusing to resume")


def _install_params(tiers: Any, block: str, module: nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """Copy a block's loaded local values into its parameters: a ZeRO-sharded block's straight into the local shards
    (RankTiers.load_block_params would shard them again), any other through its tier."""
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        tiers.load_block_params(block, module, values)
        return
    with torch.no_grad():
        for n, p in module.named_parameters():
            (p.to_local() if isinstance(p, DTensor) else p).copy_(values[f"{block}.{n}"])


def read_full(manifest: Manifest, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every key starting with `prefix` as its full tensor, read in this one process (inspection, tests, converting
    to another tool's format; a training rank reads only its shards, `load`)."""
    known = dcp.FileSystemReader(manifest.path).read_metadata().state_dict_metadata
    wanted = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in known.items()
              if k.startswith(prefix) and hasattr(m, "size")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(wanted, storage_reader=dcp.FileSystemReader(manifest.path), no_dist=True)
    return wanted


def read_blocks(manifest: Manifest) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]]:
    """block -> (params, optimizer state), both keyed by full parameter names, of a checkpoint in either format,
    read in one process (format /1's load_block per block; a DCP checkpoint's blocks are listed in its manifest).
    A parameter without optimizer state (frozen, or the second name of a tied weight) maps to {}."""
    from runtime.checkpoint import load_block

    if manifest.format != FORMAT_DCP:
        return {b: load_block(manifest, b) for b in manifest.files}
    blocks = sorted(manifest.extra.get("blocks", []), key=len, reverse=True)  # longest first: "llm.layers.1" before "llm"
    full = read_full(manifest)
    out: dict[str, tuple[dict, dict]] = {}
    for key, t in full.items():
        if key.startswith("model."):
            name = key[len("model."):]
            block = next((b for b in blocks if name.startswith(b + ".")), None)
            if block is None:
                raise MmplanError(f"checkpoint {manifest.path}: parameter {name} is in none of its blocks")
            params, optimizer = out.setdefault(block, ({}, {}))
            params[name] = t
            optimizer.setdefault(name, {})
    for key, t in full.items():
        if key.startswith("optim."):
            name, k = key[len("optim."):].rsplit(".", 1)
            block = next(b for b in blocks if name.startswith(b + "."))
            out[block][1][name][k] = t
    return out

