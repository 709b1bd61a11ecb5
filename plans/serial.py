"""One serialiser for every file mmplan writes: frozen dataclasses <-> canonical JSON, schema checks, atomic writes."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import tempfile
import types
import typing
from collections.abc import Callable
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import jsonschema

from plans.errors import FormatError, MmplanError
from plans.limits import MAX_FILE_BYTES

T = TypeVar("T")
OMIT_DEFAULT = "omit_default"  # dataclass field metadata key: to_data leaves the field out while it equals its default


def to_data(obj: Any) -> Any:
    """Dataclasses -> plain JSON data (dicts keep field order; tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # a field declared with metadata OMIT_DEFAULT is left out while it has its default (files without it stay as they were)
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get(OMIT_DEFAULT) and getattr(obj, f.name) == f.default)}
    if isinstance(obj, (list, tuple)):
        return [to_data(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    return obj


def dumps(obj: Any) -> str:
    """Canonical JSON text: stable key order (field order), one-space indent, trailing newline."""
    return json.dumps(to_data(obj), indent=1, allow_nan=False) + "\n"


def write_atomic(path: str | os.PathLike, data: str | bytes, *, durable: bool = True) -> None:
    """Write `data` to `path` so that no half-written file is ever left there: a temporary file beside it
    (`.<name>.tmp-XXXXXXXX`), flushed and fsynced, renamed over `path`, then the directory fsynced so the rename
    survives a crash too. durable=False skips both fsyncs (files handed between processes of one run, which a
    crash makes worthless anyway). The one atomic writer of plans, profiles, traces, cluster files, checkpoints
    and the launcher's results."""
    path = Path(path)
    refuse_non_regular(path, "output")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a written file gets the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def refuse_non_regular(path: str | os.PathLike, option: str) -> None:
    """An output that exists must be a regular file (through any link): renaming over a device node (run as root,
    `-o /dev/null` replaced the system's with a file), a FIFO or a directory is refused, in one line, nothing
    replaced."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there yet (or a parent that is no directory: the write fails on its own)
    except OSError:
        return  # not ours to judge (a dangling link, a permission): the write reports it
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file"
        raise MmplanError(f"{option} {path} is {kind}, not a regular file; mmplan replaces only regular files: "
                          "choose another path")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_bounded(path: str | os.PathLike, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """A file's bytes, reading at most `limit` (+1 to notice more): a larger file, or an endless one such as
    /dev/zero, is refused with a FormatError before it can fill memory. OSError / ValueError pass through."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FormatError(f"{what} {path} is larger than {limit / 2**20:g} MiB, more than mmplan reads; is it the right file?")
    return data


def read_text(path: str | os.PathLike, what: str, limit: int = MAX_FILE_BYTES) -> str:
    """A text file's contents (at most `limit` bytes); every I/O or decoding problem is one FormatError naming
    `what` and the path."""
    try:
        return read_bounded(path, what, limit).decode("utf-8")
    except FileNotFoundError:
        raise FormatError(f"cannot read {what} {path}: not found") from None
    except IsADirectoryError:
        raise FormatError(f"cannot read {what} {path}: it is a directory") from None
    except OSError as e:
        raise FormatError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise FormatError(f"{what} {path} is not UTF-8 text") from None
    except ValueError as e:  # a path Python cannot hand the OS, e.g. one with a NUL byte
        raise FormatError(f"cannot read {what} {path!r}: {e}") from None


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Load a JSON file, turning every I/O or syntax problem into one FormatError sentence."""
    return parse_json(read_text(path, what), f"{what} {path}")


def parse_json(text: str, where: str, *, allow_nan: bool = False) -> Any:
    """JSON text -> data; every syntax problem, and what JSON allows but we refuse (NaN, Infinity, numbers beyond
    a float, unpaired surrogates, nesting deeper than Python recurses), is one FormatError starting with `where`.
    allow_nan: read NaN / Infinity as Python's json does (a metrics log records a diverged loss as NaN)."""

    def not_a_number(token: str) -> float:  # NaN / Infinity: Python accepts them, JSON (and our writer) does not
        raise FormatError(f"{where} is not valid JSON: {token} is not a JSON number")

    def finite(token: str) -> float:
        value = float(token)
        if not math.isfinite(value):
            not_a_number(token)
        return value

    try:
        data = json.loads(text) if allow_nan else json.loads(text, parse_constant=not_a_number, parse_float=finite)
        if "\\ud" in text.lower():  # \ud800-\udfff escapes: fine in pairs, an unpaired one is not text
            json.dumps(data, ensure_ascii=False).encode()
        return data
    except UnicodeEncodeError:
        raise FormatError(f"{where} is not usable JSON: a string holds an unpaired surrogate escape "
                          "(\\ud800-\\udfff), which is no character") from None
    except json.JSONDecodeError as e:
        raise FormatError(f"{where} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except ValueError as e:  # valid JSON Python refuses to read: an integer of more digits than it converts
        raise FormatError(f"{where} is not usable JSON: {str(e).split('; use sys.set_int_max_str_digits')[0]}") from None
    except RecursionError:
        raise FormatError(f"{where} is not usable JSON: arrays or objects nest too deeply") from None


@lru_cache(maxsize=None)
def schema(name: str) -> dict:
    """The JSON Schema `plans/schema/<name>.json`."""
    return json.loads(resources.files("plans").joinpath("schema", f"{name}.json").read_text())


def validate(data: Any, schema_name: str, what: str, *,
             message: Callable[[jsonschema.ValidationError], str] | None = None,
             distinct: dict[tuple[str, ...], tuple[str, ...]] | None = None) -> None:
    """Validate against the JSON Schema plans/schema/<schema_name>.json; the first error (the shallowest) is one
    FormatError: by default naming the offending field by its JSON path, or the sentence `message` makes of it
    (file formats whose users know their fields by another name: cluster TOML tables, metrics log lines).
    distinct: {path of an array of objects: its name fields}: items equal but for names that are non-empty strings
    are validated once (a profile of 10,000 identical layers: jsonschema takes ~1 ms per item); exact, since
    every schema types those fields as non-empty strings."""
    data, where_from = _distinct_items(data, distinct or {})
    validator = _Validator(schema(schema_name))
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        err = errors[0]
        if message is not None:
            raise FormatError(message(err))
        path = list(err.absolute_path)
        for array, index in where_from.items():  # an index into a shortened array -> the index in the file
            if tuple(path[:len(array)]) == array and len(path) > len(array) and isinstance(path[len(array)], int):
                path[len(array)] = index[path[len(array)]]
        where = "/".join(str(p) for p in path) or "(top level)"
        raise FormatError(f"{what}: field {where}: {_short(err.message)}")


def _distinct_items(data: Any, distinct: dict[tuple[str, ...], tuple[str, ...]]) -> tuple[Any, dict[tuple, list[int]]]:
    """`data` with each array at a path of `distinct` reduced to its items distinct but for their name fields (when
    those are non-empty strings), and per such path the original index of each kept item."""
    where_from: dict[tuple, list[int]] = {}
    for path, names in distinct.items():
        parents = [data]
        for key in path[:-1]:
            parents.append(parents[-1].get(key) if isinstance(parents[-1], dict) else None)
        items = parents[-1].get(path[-1]) if isinstance(parents[-1], dict) else None
        if not isinstance(items, list):
            continue
        seen: dict[Any, int] = {}
        kept, index = [], []
        for i, item in enumerate(items):
            named = isinstance(item, dict) and all(isinstance(item.get(n), str) and item[n] for n in names)
            key = json.dumps({k: v for k, v in item.items() if k not in names}, sort_keys=True, default=repr) if named else i
            if key not in seen:
                seen[key] = i
                kept.append(item)
                index.append(i)
        if len(kept) == len(items):
            continue
        copy = {**parents[-1], path[-1]: kept}  # rebuild the containers along the path, the input left as it is
        for parent, key in zip(reversed(parents[:-1]), reversed(path[:-1])):
            copy = {**parent, key: copy}
        data = copy
        where_from[path] = index
    return data, where_from


def _strict_integer(checker: Any, instance: Any) -> bool:
    """JSON Schema's "integer" as a Python int: jsonschema also counts 8.0 as one, which the code reading the
    field then uses as an index, a range or a dict key and fails on (`"dp": 1.0`, `"global_batch": 8.0`)."""
    return isinstance(instance, int) and not isinstance(instance, bool)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _strict_integer))


def _short(message: str, limit: int = 160) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."


def from_data(cls: type[T], data: Any) -> T:
    """Plain JSON data -> (nested) frozen dataclass, guided by the type hints; validate first."""
    return _build(cls, data)


def _build(tp: Any, data: Any) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in data:
                kwargs[f.name] = _build(hints[f.name], data[f.name])
        return tp(**kwargs)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if data is None:
            return None
        return _build(args[0], data) if len(args) == 1 else data
    if origin is tuple:
        args = typing.get_args(tp)
        item = args[0] if args else Any
        return tuple(_build(item, x) for x in data)
    if origin is dict:
        _, vt = typing.get_args(tp)
        return {k: _build(vt, v) for k, v in data.items()}
    return data  # numbers stay as written (an integral float field may hold an int): round trips are exact


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
