"""Checkpoints: one file per block in a layout-independent form, written atomically, a checksummed manifest written last.

Layout of a checkpoint directory D:
    D/step-000040/manifest.json        written last (atomically); without it the step does not exist
    D/step-000040/llm.layers.3.pt      {"format", "block", "params": {full name: tensor},
                                        "optimizer": {full name: {"step", "exp_avg", "exp_avg_sq"}}}
A block file holds the block's full, unsharded parameters and their optimizer state keyed by full
parameter names (as model.named_parameters() names them), so a run can resume under another plan:
other cut points, degrees or tiers. Every file is written to a temporary name, fsynced and renamed.

Multi-rank protocol: every rank calls write_block_files() for the blocks it owns (one replica of each
stage: dp replica 0), all ranks meet at a barrier, then one rank calls write_manifest(), which also
deletes all but the newest `keep` checkpoints of the same lineage (one training run and its resumptions).

The manifest names the model (`model`, `fingerprint`: the plan's ProfileRef) so a resume under another model is
refused, and its fields are checked when read (step, data position, RNG states). A write that fails (a full
disk) removes its temporary file and raises MmplanError naming the path; the caller removes the incomplete
step directory (remove_incomplete) so the disk space comes back.

Two formats share this directory layout, manifest, lineage and rotation: `mmplan.checkpoint/1` (above: one file per
block, written after gathering each block's shards; `run --checkpoint-format gather`) and `mmplan.checkpoint/2`
(runtime/checkpoint_dcp.py: torch.distributed.checkpoint, every rank writing its own shards; the default). Its
manifest's `files` name DCP's files (`.metadata`, `__R_0.distcp`) instead of blocks. Either resumes under any plan.
"""
from __future__ import annotations

import base64
import hashlib
import io
import contextlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from plans.errors import MmplanError
from plans.serial import read_bounded, write_atomic

FORMAT = "mmplan.checkpoint/1"  # one file per block (gathered)
FORMAT_DCP = "mmplan.checkpoint/2"  # torch.distributed.checkpoint shards (runtime/checkpoint_dcp.py)
FORMATS = (FORMAT, FORMAT_DCP)
MANIFEST = "manifest.json"
KEEP = 2  # complete checkpoints kept
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_BLOCK_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True, slots=True)
class BlockFile:
    """One block's file in a step directory."""

    block: str
    file: str  # file name inside the step directory
    sha256: str
    bytes: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """A complete checkpoint: what manifest.json says, and where it lies."""

    path: str  # the step directory
    step: int
    files: dict[str, BlockFile]  # block -> its file (format /2: DCP's file name -> that file)
    rng: dict[str, Any]  # rank (as a string) -> rng_state() of that rank
    data_position: int  # where the data stream resumes (the caller's unit, e.g. the next step's first sample)
    format: str = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)  # informative only
    model: str = ""  # the model spec of the plan that wrote it ("" in checkpoints of older versions)
    fingerprint: str = ""  # that model's structural fingerprint (the plan's profile.fingerprint)
    lineage: str = ""  # the training run (kept across its resumptions): rotation only deletes its own checkpoints

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(self.files)

    def rng_for(self, rank: int) -> dict[str, Any]:
        """This rank's RNG state, or rank 0's when the checkpoint was written with fewer ranks."""
        return self.rng.get(str(rank), self.rng.get("0", {}))


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def block_params(modules: Mapping[str, nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """{block: {full parameter name: parameter}} for a rank's local blocks."""
    return {b: {f"{b}.{n}": p for n, p in m.named_parameters()} for b, m in modules.items()}


# --- writing -------------------------------------------------------------------------------------


def write_block_files(root: str | os.PathLike, step: int, blocks: Mapping[str, Mapping[str, torch.Tensor]],
                      optimizer_state: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, BlockFile]:
    """Write one file per block (params + their optimizer state, keyed by full names), each atomically.

    `blocks`: block -> {full parameter name: tensor}; `optimizer_state`: full parameter name -> its state
    (names of other blocks are ignored; a parameter without state, e.g. before the first step, is saved
    without). Removes a stale manifest of the same step first, so the step counts as incomplete until
    write_manifest runs. Returns what write_manifest needs.
    """
    d = step_dir(root, step)
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.unlink(d / MANIFEST)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise MmplanError(f"cannot write checkpoint directory {d}: {e.strerror or e}") from None
    out = {}
    for block, params in blocks.items():
        if not _BLOCK_NAME.match(block):
            raise MmplanError(f"block name {block!r} cannot name a checkpoint file (letters, digits, '_', '.', '-')")
        payload = {
            "format": FORMAT,
            "block": block,
            "params": {n: _plain(t) for n, t in params.items()},
            "optimizer": {n: {k: _plain(v) for k, v in optimizer_state[n].items()} for n in params if n in optimizer_state},
        }
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        name = f"{block}.pt"
        _write_atomic(d / name, data)
        out[block] = BlockFile(block, name, hashlib.sha256(data).hexdigest(), len(data))
    return out


def write_manifest(root: str | os.PathLike, step: int, files: Mapping[str, BlockFile] | Iterable[str], *,
                   rng: Mapping[int | str, Mapping[str, Any]], data_position: int, extra: Mapping[str, Any] | None = None,
                   keep: int = KEEP, model: str = "", fingerprint: str = "", lineage: str = "",
                   format: str = FORMAT) -> Manifest:
    """Complete step `step`: write its manifest (atomically, last), then keep only the newest `keep` checkpoints
    (of `lineage` when given: checkpoints of other runs in the directory are deleted, never kept in its place).

    `files`: the merged return values of every rank's write_block_files (e.g. gathered with
    dist.all_gather_object), or just the block names, whose files are then hashed from disk here.
    `rng`: rank -> rng_state() of that rank. `model`, `fingerprint`: the plan's profile reference.
    """
    d = step_dir(root, step)
    if not isinstance(files, Mapping):
        files = {b: _hash_file(d, b, f"{b}.pt") for b in files}
    for bf in files.values():
        p = d / bf.file
        if not p.is_file() or p.stat().st_size != bf.bytes:
            raise MmplanError(f"cannot complete checkpoint {d}: block file {p} is missing or has the wrong size; did every rank write its blocks?")
    manifest = Manifest(path=str(d), step=step, files=dict(files), rng={str(k): dict(v) for k, v in rng.items()},
                        data_position=int(data_position), extra=dict(extra or {}), model=model, fingerprint=fingerprint,
                        lineage=lineage, format=format)
    doc = {k: v for k, v in asdict(manifest).items() if k != "path"}
    doc["files"] = {b: asdict(bf) for b, bf in manifest.files.items()}
    for leftover in d.glob(".*.tmp-*"):  # every rank is done writing: temp files are from interrupted writes
        leftover.unlink(missing_ok=True)
    _write_atomic(d / MANIFEST, json.dumps(doc, indent=1, sort_keys=True).encode())
    _keep_newest(Path(root), step, keep, lineage)
    return manifest


def save_checkpoint(root: str | os.PathLike, step: int, blocks: Mapping[str, Mapping[str, torch.Tensor]],
                    optimizer_state: Mapping[str, Mapping[str, torch.Tensor]], *, rng: Mapping[int | str, Mapping[str, Any]] | None = None,
                    data_position: int, extra: Mapping[str, Any] | None = None, keep: int = KEEP,
                    model: str = "", fingerprint: str = "", lineage: str = "") -> Manifest:
    """Single-process checkpoint: write_block_files then write_manifest (rng defaults to this process's)."""
    files = write_block_files(root, step, blocks, optimizer_state)
    return write_manifest(root, step, files, rng=rng if rng is not None else {0: rng_state()},
                          data_position=data_position, extra=extra, keep=keep, model=model, fingerprint=fingerprint,
                          lineage=lineage)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU tensor owning exactly its bytes (torch.save would store a view's whole storage)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _write_atomic(path: Path, data: bytes) -> None:
    """plans.serial.write_atomic (temp file, fsync, rename, directory fsync); a failure (ENOSPC, EFBIG, EIO) leaves
    no temp file and raises one MmplanError naming the path."""
    try:
        write_atomic(path, data)
    except OSError as e:
        raise MmplanError(f"cannot write checkpoint file {path}: {e.strerror or e} (checkpoint directory "
                          f"{path.parent.parent}); free space there or choose another --checkpoint-dir") from None


def _hash_file(d: Path, block: str, name: str) -> BlockFile:
    p = d / name
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise MmplanError(f"cannot complete checkpoint {d}: block file {p} was not written; did every rank write its blocks?") from None
    return BlockFile(block, name, hashlib.sha256(data).hexdigest(), len(data))


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def _keep_newest(root: Path, step: int, keep: int, lineage: str = "") -> None:
    """Keep the newest `keep` complete checkpoints up to `step` (of `lineage` when given); delete every other
    step directory (older ones, incomplete leftovers of interrupted writes, newer ones of an abandoned run, and
    those of other runs, which the caller let it replace)."""
    complete = [s for s, p in _step_dirs(root) if s <= step and (p / MANIFEST).is_file()
                and (not lineage or _lineage_of(p) == lineage)]
    kept = set(complete[-keep:]) | {step}
    for s, p in _step_dirs(root):
        if s not in kept:
            _remove_step_dir(p)


def _lineage_of(d: Path) -> str | None:
    try:
        return json.loads((d / MANIFEST).read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None


def _remove_step_dir(d: Path) -> None:
    """Manifest first, so a removal cut short leaves an incomplete step (ignored), never a corrupt one."""
    with contextlib.suppress(OSError):
        os.unlink(d / MANIFEST)
    shutil.rmtree(d, ignore_errors=True)


# --- the directory as a whole --------------------------------------------------------------------


def complete_steps(root: str | os.PathLike) -> list[Path]:
    """Step directories under `root` that hold a manifest (oldest first)."""
    return [p for _, p in _step_dirs(Path(root)) if (p / MANIFEST).is_file()]


def remove_incomplete(root: str | os.PathLike) -> None:
    """Delete what interrupted or failed writes left: step directories without a manifest and temporary files.

    Call it only while holding the directory (runtime/dirlock.py): another run's save in progress looks the same.
    """
    for _, p in _step_dirs(Path(root)):
        if not (p / MANIFEST).is_file():
            shutil.rmtree(p, ignore_errors=True)
        else:
            for leftover in p.glob(".*.tmp-*"):
                leftover.unlink(missing_ok=True)


def discard(root: str | os.PathLike, step: int) -> bool:
    """Delete the checkpoint of `step` (e.g. weights that made the loss diverge); True when there was one."""
    d = step_dir(root, step)
    if not d.is_dir():
        return False
    _remove_step_dir(d)
    return True


# --- reading -------------------------------------------------------------------------------------


def latest_checkpoint(root: str | os.PathLike, *, verify: bool = True, skip_corrupt: bool = False) -> Manifest | None:
    """The newest complete checkpoint under `root`, or None when there is none.

    Steps without a manifest (interrupted while writing) are ignored. A complete one that does not
    verify (unreadable manifest, missing or truncated file, sha256 mismatch) raises MmplanError naming
    the file, so a damaged checkpoint is never silently passed over; with skip_corrupt=True the next
    older one is tried instead.
    """
    for _, d in reversed(_step_dirs(Path(root))):
        if not (d / MANIFEST).is_file():
            continue
        try:
            manifest = read_manifest(d)
            if verify:
                for block in manifest.files:
                    verified_file(manifest, block)
            return manifest
        except MmplanError:
            if not skip_corrupt:
                raise
    return None


def read_manifest(d: str | os.PathLike) -> Manifest:
    """Parse and check D/step-N/manifest.json (no file verification)."""
    path = Path(d) / MANIFEST
    try:
        doc = json.loads(read_bounded(path, "checkpoint manifest"))
        if doc.get("format") not in FORMATS:
            raise ValueError(f"format {doc.get('format')!r}, expected one of {', '.join(FORMATS)}")
        if not isinstance(doc.get("files"), dict) or not doc["files"]:
            raise ValueError("'files' must name at least one block file")
        files = {b: BlockFile(**f) for b, f in doc["files"].items()}
        for b, f in files.items():
            if b != f.block or not _BLOCK_NAME.match(f.file) or "/" in f.file:
                raise ValueError(f"bad entry for block {b!r}")
            if not (_is_int(f.bytes) and f.bytes >= 0 and isinstance(f.sha256, str)):
                raise ValueError(f"bad size or checksum for block {b!r}")
        step, position = doc["step"], doc["data_position"]
        match = _STEP_DIR.match(Path(d).name)
        if not (_is_int(step) and step >= 0) or (match and int(match.group(1)) != step):
            raise ValueError(f"step {step!r} is not the step of directory {Path(d).name}")
        if not (_is_int(position) and position >= 0):
            raise ValueError(f"data_position {position!r} is not a count >= 0")
        identity = {k: doc.get(k, "") for k in ("model", "fingerprint", "lineage")}
        if not all(isinstance(v, str) for v in identity.values()):
            raise ValueError("model, fingerprint and lineage must be strings")
        _check_rng(doc["rng"])
        return Manifest(path=str(Path(d)), step=step, files=files, rng=dict(doc["rng"]), data_position=position,
                        format=doc["format"], extra=dict(doc.get("extra", {})), **identity)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise MmplanError(f"checkpoint manifest {path} is unreadable ({type(e).__name__}: {_short(e)}); refusing to resume") from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_rng(rng: Any) -> None:
    """Every rank's saved RNG state must be restorable: tried on this process's generators, which are put back."""
    if not isinstance(rng, dict) or not rng:
        raise ValueError("'rng' must map ranks to RNG states")
    saved = rng_state()
    try:
        for rank, state in rng.items():
            if not (isinstance(rank, str) and rank.isdigit() and isinstance(state, dict)):
                raise ValueError(f"rng entry {rank!r} is not a rank's RNG state")
            unknown = set(state) - {"torch", "python", "numpy", "cuda"}
            if unknown:
                raise ValueError(f"rng of rank {rank} has unknown generators {sorted(unknown)}")
            try:
                set_rng_state({k: v for k, v in state.items() if k != "cuda"})
            except Exception as e:  # noqa: BLE001 - whatever a bad state makes torch, random or numpy raise
                raise ValueError(f"rng of rank {rank} cannot be restored ({type(e).__name__}: {_short(e, 80)})") from None
    finally:
        set_rng_state(saved)


def verified_file(manifest: Manifest, block: str) -> None:
    """Check one file of the checkpoint against the manifest (size, then sha256 read in 4 MiB pieces); raises
    MmplanError naming the file."""
    if block not in manifest.files:
        raise MmplanError(f"checkpoint {manifest.path} has no block {block!r} (it has {', '.join(manifest.files)}); "
                          "was it written for another model?")
    bf = manifest.files[block]
    path = Path(manifest.path) / bf.file
    h, size = hashlib.sha256(), 0
    try:
        if path.stat().st_size == bf.bytes:
            with open(path, "rb") as f:
                while size <= bf.bytes and (chunk := f.read(1 << 22)):  # never read more than the manifest promises
                    h.update(chunk)
                    size += len(chunk)
        else:
            size = path.stat().st_size
    except FileNotFoundError:
        raise MmplanError(f"checkpoint {path} is missing; refusing to resume") from None
    except OSError as e:
        raise MmplanError(f"cannot read checkpoint {path}: {e.strerror or e}; refusing to resume") from None
    if size != bf.bytes:
        raise MmplanError(f"checkpoint {path} is corrupt: {size} bytes, the manifest says {bf.bytes} (truncated?); refusing to resume")
    if h.hexdigest() != bf.sha256:
        raise MmplanError(f"checkpoint {path} is corrupt: sha256 mismatch; refusing to resume")


def check_sizes(manifest: Manifest) -> None:
    """Every file the manifest names is there with its size (a DCP checkpoint's checksums are checked by
    the ranks, each a share: checkpoint_dcp.verify_share)."""
    for name, bf in manifest.files.items():
        path = Path(manifest.path) / bf.file
        try:
            size = path.stat().st_size
        except OSError:
            raise MmplanError(f"checkpoint {path} is missing; refusing to resume") from None
        if size != bf.bytes:
            raise MmplanError(f"checkpoint {path} is corrupt: {size} bytes, the manifest says {bf.bytes} (truncated?); "
                              "refusing to resume")


def _verified_bytes(manifest: Manifest, block: str) -> bytes:
    if block not in manifest.files:
        raise MmplanError(f"checkpoint {manifest.path} has no block {block!r} (it has {', '.join(manifest.files)}); "
                          "was it written for another model?")
    bf = manifest.files[block]
    path = Path(manifest.path) / bf.file
    try:
        size = path.stat().st_size
        data = path.read_bytes() if size == bf.bytes else b""  # never read more than the manifest promises
    except FileNotFoundError:
        raise MmplanError(f"checkpoint {path} is missing; refusing to resume") from None
    except OSError as e:
        raise MmplanError(f"cannot read checkpoint {path}: {e.strerror or e}; refusing to resume") from None
    if size != bf.bytes:
        raise MmplanError(f"checkpoint {path} is corrupt: {size} bytes, the manifest says {bf.bytes} (truncated?); refusing to resume")
    if len(data) != bf.bytes:
        raise MmplanError(f"checkpoint {path} is corrupt: {len(data)} bytes, the manifest says {bf.bytes} (truncated?); refusing to resume")
    if hashlib.sha256(data).hexdigest() != bf.sha256:
        raise MmplanError(f"checkpoint {path} is corrupt: sha256 mismatch; refusing to resume")
    return data


def load_block(manifest: Manifest, block: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """(params, optimizer state) of one block, both keyed by full parameter names; verified, weights_only."""
    if manifest.format != FORMAT:
        raise MmplanError(f"checkpoint {manifest.path} is in format {manifest.format} (sharded, "
                          "runtime/checkpoint_dcp.py), which has no block files")
    data = _verified_bytes(manifest, block)
    path = Path(manifest.path) / manifest.files[block].file
    try:
        payload = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a corrupt file
        raise MmplanError(f"checkpoint {path} cannot be loaded ({type(e).__name__}); refusing to resume") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("block") != block:
        raise MmplanError(f"checkpoint {path} does not hold block {block!r} in format {FORMAT}; refusing to resume")
    return payload["params"], payload["optimizer"]


# --- optimizer state and RNG -----------------------------------------------------------------------


def adam_state_by_name(optimizer: torch.optim.Optimizer, named_params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """torch.optim.Adam's per-parameter state keyed by full names (parameters without state are left out)."""
    return {n: dict(optimizer.state[p]) for n, p in named_params.items() if optimizer.state.get(p)}


def load_adam_state_by_name(optimizer: torch.optim.Optimizer, named_params: Mapping[str, torch.Tensor],
                            state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Install saved per-name state into a torch.optim.Adam over `named_params` (exact copies; `step` stays on CPU)."""
    for n, p in named_params.items():
        if n in state:
            optimizer.state[p] = {k: v.clone() if k == "step" else v.to(p.device, copy=True) for k, v in state[n].items()}


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA when initialised, Python random, numpy) as JSON-able data."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], [int(k) for k in np_state[1]], int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what rng_state() returned, exactly."""
    if "torch" in state:
        torch.set_rng_state(_unb64(state["torch"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _b64(t: torch.Tensor) -> str:
    """A uint8 RNG state tensor as base64 text."""
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
