"""Parse an architecture TOML file (documented in ARCH_TOML.md) into an ArchConfig."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

import tomllib

from plans.serial import read_bounded

from .configs import ArchConfig, AudioConfig, ClipConfig, DecoderConfig, ProjectorConfig, VisionConfig

# Each table is named after the ArchConfig field it fills.
TABLES: dict[str, type] = {
    "vision": VisionConfig,
    "audio": AudioConfig,
    "projector": ProjectorConfig,
    "audio_projector": ProjectorConfig,
    "decoder": DecoderConfig,
    "clip": ClipConfig,
}
TOP_LEVEL_KEYS = ("name", "dtype")


def load_arch_toml(path: str | os.PathLike) -> ArchConfig:
    """Read and validate an architecture TOML; `name` defaults to the file name without .toml."""
    path = Path(path)
    try:
        raw = tomllib.loads(read_bounded(path, "architecture file").decode("utf-8"))
        return parse_arch(raw, default_name=path.stem)
    except (tomllib.TOMLDecodeError, ValueError) as e:  # ValueError also: an integer of too many digits
        raise ValueError(f"{path}: {str(e).split('; use sys.set_int_max_str_digits')[0]}") from e
    except RecursionError:
        raise ValueError(f"{path}: arrays or tables nest too deeply") from None


def parse_arch(raw: dict[str, Any], *, default_name: str) -> ArchConfig:
    """An ArchConfig from a parsed TOML document; unknown or missing keys raise ValueError naming them."""
    unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS) - set(TABLES))
    if unknown:
        raise ValueError(
            f"unknown top-level key(s) {', '.join(unknown)} (known: {', '.join([*TOP_LEVEL_KEYS, *TABLES])})"
        )
    for key in TOP_LEVEL_KEYS:
        if isinstance(raw.get(key), dict):
            raise ValueError(f"{key!r} must be a top-level value, not a table")
    tables = {name: _parse_table(name, raw[name], cls) for name, cls in TABLES.items() if name in raw}
    return ArchConfig(name=raw.get("name", default_name), dtype=raw.get("dtype", "fp32"), **tables)


def _parse_table(table: str, values: Any, cls: type) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"[{table}] must be a table, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"[{table}] unknown key(s) {', '.join(unknown)} (known: {', '.join(fields)})")
    missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING and name not in values]
    if missing:
        raise ValueError(f"[{table}] missing required key(s): {', '.join(missing)}")
    return cls(**values)
