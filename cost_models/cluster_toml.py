"""Cluster TOML files: reading (validated against plans/schema/cluster.json, one-line errors) and writing."""
from __future__ import annotations

import functools
import tomllib
from dataclasses import replace
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Any

from cost_models.catalog import CATALOG, GB, LOCAL
from plans.cluster import DTYPES, Cluster, Device, Link
from plans.errors import FormatError
from plans.serial import read_text, validate


def load_cluster_toml(path: str | Path) -> Cluster:
    """Read a cluster TOML file (format: docs/cluster-toml.md); every problem is one FormatError."""
    return cluster_from_toml(read_text(path, "cluster file"), source=str(path))


def cluster_from_toml(text: str, source: str = "cluster TOML") -> Cluster:
    """Parse cluster TOML text. Floats are read as decimals so that cluster_to_toml's output reads back exactly."""
    try:
        data = tomllib.loads(text, parse_float=Decimal)
    except tomllib.TOMLDecodeError as e:
        raise FormatError(f"{source} is not valid TOML ({e})") from None
    except ValueError as e:  # valid TOML Python refuses to read: an integer of more digits than it converts
        raise FormatError(f"{source} is not usable TOML: {str(e).split('; use sys.set_int_max_str_digits')[0]}") from None
    except ArithmeticError:  # a float whose exponent does not fit a Decimal (e.g. 1e99999999999999999999)
        raise FormatError(f"{source} is not usable TOML: a number is out of range") from None
    except RecursionError:
        raise FormatError(f"{source} is not usable TOML: arrays or tables nest too deeply") from None
    return _cluster_from_data(data, source)


_LINKS = ("intra_node", "inter_node", "host_to_device", "nvme")


def _cluster_from_data(data: dict[str, Any], source: str) -> Cluster:
    """A Cluster from a parsed cluster TOML: validated against plans/schema/cluster.json (keys, types, signs, what
    is required without a base entry), then converted to bytes, FLOP/s and seconds over the base entry's values."""
    _check_finite(data, [], source)
    validate(data, "cluster", source, message=functools.partial(_schema_message, source))
    device_value = data.get("device")
    base_name = data.get("base", device_value if isinstance(device_value, str) else None)
    device_table = device_value if isinstance(device_value, dict) else {}
    base = None
    if base_name is not None:
        if base_name.lower() not in CATALOG:
            raise FormatError(f"{source}: unknown base device {base_name!r}; known: {', '.join(CATALOG)}")
        base_name = base_name.lower()
        base = CATALOG[base_name]
    gpus_per_node = data.get("gpus_per_node", base.gpus_per_node if base else None)
    host_memory = _bytes(data, "host_memory_gb", base.host_memory_bytes if base else None, source)
    device = _device(device_table, base.device if base else None, source)
    if base_name in LOCAL and "memory_gb" not in device_table:
        device = replace(device, memory_bytes=host_memory // gpus_per_node)  # a rank's share of RAM
    links_table = data.get("links", {})
    links = {k: _link(links_table.get(k), getattr(base, k) if base else None, f"[links.{k}]", source) for k in _LINKS}
    return Cluster(name=data.get("name", base_name or "cluster"), nodes=data.get("nodes", 1), gpus_per_node=gpus_per_node,
                   device=device, **links, host_memory_bytes=host_memory,
                   nvme_bytes=_bytes(data, "nvme_gb", base.nvme_bytes if base else None, source),
                   backend=data.get("backend", base.backend if base else "nccl"), **_runtime_costs(data, base, source))


# The [runtime] table of a cluster TOML (`mmplan calibrate`'s measured runtime costs): TOML key -> (Cluster field, exponent)
_RUNTIME = {"optimizer_us_per_tensor": ("optimizer_tensor_s", -6), "optimizer_ns_per_byte": ("optimizer_byte_s", -9),
            "step_overhead_us": ("step_overhead_s", -6), "compute_slowdown": ("compute_slowdown", 0),
            "zero_us_per_block": ("zero_block_s", -6), "zero_ns_per_byte": ("zero_byte_s", -9),
            "zero_us_per_tensor": ("zero_tensor_s", -6), "forward_us_per_op": ("forward_op_s", -6),
            "backward_us_per_op": ("backward_op_s", -6), "us_per_saved_tensor": ("saved_tensor_s", -6),
            "us_per_released_tensor": ("released_tensor_s", -6)}


def _runtime_costs(data: dict[str, Any], base: Cluster | None, source: str) -> dict[str, float]:
    table = data.get("runtime", {})
    return {name: _scaled(table[key], exponent, f"[runtime] {key}", source) if key in table
            else getattr(base, name) if base else Cluster.__dataclass_fields__[name].default
            for key, (name, exponent) in _RUNTIME.items()}


def _check_finite(value: Any, path: list, source: str) -> None:
    """TOML's inf and nan (read as decimals) are no sizes or speeds (and a NaN does not compare: check them first)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, [*path, key], source)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, [*path, i], source)
    elif isinstance(value, Decimal) and not value.is_finite():
        raise FormatError(f"{source}: {_field(path)} must be a finite number, got {value}")


def _table(path: list) -> str:
    """The TOML table a path into the document names: "the top level", "[device]", "[links.nvme]", ..."""
    keys = [k for k in path if isinstance(k, str)]
    if not keys:
        return "the top level"
    return "[" + ".".join(keys[:2] if keys[0] == "links" or keys[1:2] == ["peak_tflops"] else keys[:1]) + "]"


def _field(path: list) -> str:
    """How a field is named in messages: "nodes", "[device] memory_gb", "[links.nvme] latency_us", "[device] efficiency"."""
    keys = [k for k in path if isinstance(k, str)]
    if len(keys) == 1:
        return keys[0] if keys[0] not in ("device", "links") else f"[{keys[0]}]"
    table = _table(keys)
    rest = keys[2:] if table.count(".") else keys[1:]
    if keys == ["device", "peak_tflops"]:
        return "[device] peak_tflops"
    return " ".join([table, *rest])


def _schema_message(source: str, err: Any) -> str:
    """One sentence for the first schema error of a cluster TOML, naming the field as the file names it."""
    path, node = list(err.absolute_path), err.schema
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        key = next(k for k in err.instance if k not in node.get("properties", {}))
        return f"{source}: unknown key {key!r} in {_table(path)}; allowed: {', '.join(node.get('properties', {}))}"
    if err.validator == "required":
        missing = next(k for k in err.validator_value if k not in err.instance)
        return f"{source}: {_field([*path, missing])} is required when no base device is given (base = \"h100-sxm\")"
    if "propertyNames" in err.schema_path:
        return f"{source}: unknown dtype {err.instance!r} in [device.peak_tflops]; known: {', '.join(DTYPES)}"
    if err.validator == "not":  # device = "name" beside base = "name"
        return f"{source}: {node['x-error']}"
    clause = node.get("x-error") or _expected(node, err.validator) or err.message
    return f"{source}: {_field(path)} {clause}, got {_brief_value(err.instance)}"


def _expected(node: dict, validator: str) -> str | None:
    """The clause of a message for a failed scalar field, from its schema: "must be an integer >= 1", ..."""
    if "enum" in node:
        return f"must be one of {', '.join(node['enum'])}"
    kind = node.get("type")
    if kind == "integer":
        return f"must be an integer >= {node.get('minimum', 0)}"
    if kind == "number":
        if validator == "type":
            return "must be a number"
        return f"must be a finite number > {node['exclusiveMinimum']}" if "exclusiveMinimum" in node \
            else f"must be a finite number >= {node.get('minimum', 0)}"
    if kind == "string":
        return "must be a non-empty string"
    return None


def _brief_value(value: Any) -> str:
    """A value as the TOML file wrote it (decimals as numbers), cut short."""
    text = _as_written(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]}"


def _as_written(value: Any) -> str:
    if isinstance(value, Decimal):
        return _brief(value)
    if isinstance(value, list):
        return "[" + ", ".join(_as_written(v) for v in value[:8]) + (", ..." if len(value) > 8 else "") + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_as_written(v)}" for k, v in list(value.items())[:8]) + "}"
    return repr(value)


# Numbers of a cluster file lie within 1e-400 .. 1e400 (floats span 5e-324 .. 1.8e308, and a field is scaled by
# at most 1e12); beyond, the decimal arithmetic that turns them into bytes and seconds overflows or stalls.
_MAX_EXPONENT = 400
_MAX_BYTES = 10**24  # no tier holds a yottabyte; larger integers overflow float arithmetic downstream


def _in_range(number: Decimal, field: str, source: str) -> Decimal:
    if number and not -_MAX_EXPONENT <= number.adjusted() <= _MAX_EXPONENT:
        raise FormatError(f"{source}: {field} is out of range, got {_brief(number)}")
    return number


def _brief(number: Decimal) -> str:
    text = str(number)
    return text if len(text) <= 32 else f"{text[:16]}...{text[-8:]}"


def _bytes(table: dict[str, Any], key: str, default: int | None, source: str, where: str = "") -> int:
    """A size in GB (1e9 bytes; a schema-checked number > 0, or absent: the base's) -> whole bytes."""
    if key not in table:
        return default
    nbytes = int(_in_range(Decimal(table[key]), where + key, source).scaleb(9).to_integral_value(ROUND_HALF_EVEN))
    if nbytes < 1:
        raise FormatError(f"{source}: {where}{key} must be at least one byte, got {table[key]}")
    if nbytes > _MAX_BYTES:
        raise FormatError(f"{source}: {where}{key} is out of range (at most {_MAX_BYTES // GB:.0e} GB), "
                          f"got {_brief(Decimal(table[key]))}")
    return nbytes


def _scaled(value: Any, exponent: int, field: str, source: str) -> float:
    """value x 10**exponent, rounded once (so decimals written by _number() read back bit-exactly)."""
    return float(_in_range(Decimal(value), field, source).scaleb(exponent))


def _device(table: dict[str, Any], base: Device | None, source: str) -> Device:
    """The [device] table (schema-checked) over the base entry's device."""
    peaks = {k: _scaled(v, 12, f"[device.peak_tflops] {k}", source) for k, v in table.get("peak_tflops", {}).items()}
    memory = _bytes(table, "memory_gb", base.memory_bytes if base else None, source, "[device] ")
    if "memory_bandwidth_gbps" in table:
        bandwidth = _scaled(table["memory_bandwidth_gbps"], 9, "[device] memory_bandwidth_gbps", source)
    else:
        bandwidth = base.memory_bandwidth
    curve = _efficiency_points(table["efficiency"], source) if "efficiency" in table else (
        base.efficiency if base else Device.__dataclass_fields__["efficiency"].default)
    try:
        return Device(table.get("name", base.name if base else None), {**(base.peak_flops if base else {}), **peaks},
                      memory, bandwidth, curve)
    except FormatError as e:
        raise FormatError(f"{source}: [device] {e}") from None


def _efficiency_points(value: list, source: str) -> tuple[tuple[float, float], ...]:
    points = tuple((_scaled(f, 0, "[device] efficiency flops", source), _scaled(e, 0, "[device] efficiency value", source))
                   for f, e in value)
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
        raise FormatError(f"{source}: [device] efficiency points must be sorted by strictly increasing flops")
    return points


def _link(table: dict[str, Any] | None, base: Link | None, where: str, source: str) -> Link:
    """A [links.*] table (schema-checked) over the base entry's link."""
    if table is None:
        return base
    bandwidth = _scaled(table["bandwidth_gbps"], 9, f"{where} bandwidth_gbps", source) if "bandwidth_gbps" in table \
        else base.bandwidth
    latency = float(_in_range(Decimal(table["latency_us"]), f"{where} latency_us", source).scaleb(-6)) \
        if "latency_us" in table else (base.latency_s if base else 0.0)
    collective = float(_in_range(Decimal(table["collective_us"]), f"{where} collective_us", source).scaleb(-6)) \
        if "collective_us" in table else (base.collective_s if base else 0.0)
    try:
        return Link(bandwidth, latency, collective)
    except FormatError as e:  # a finite decimal too large for a float
        raise FormatError(f"{source}: {where} {e}") from None


def _number(value: float | int, exponent: int = 0) -> str:
    """value x 10**exponent as a plain TOML number whose exact decimal reads back to value (see _scaled)."""
    exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    return format(exact.scaleb(exponent).normalize(), "f")


def cluster_to_toml(cluster: Cluster) -> str:
    """A self-contained cluster TOML (no base entry) that parse_cluster reads back to an equal Cluster."""
    dev = cluster.device
    lines = [
        "# mmplan cluster (format: docs/cluster-toml.md). Units: GB = 1e9 bytes, GB/s = 1e9 bytes/s,",
        "# us = 1e-6 s, TFLOP/s = 1e12 FLOP/s; efficiency = [[FLOPs of one kernel, fraction of peak], ...].",
        f"name = {_string(cluster.name)}",
        f"nodes = {cluster.nodes}",
        f"gpus_per_node = {cluster.gpus_per_node}",
        f"backend = {_string(cluster.backend)}",
        f"host_memory_gb = {_number(cluster.host_memory_bytes, -9)}  # per node",
        f"nvme_gb = {_number(cluster.nvme_bytes, -9)}  # per node",
        "",
        "[device]",
        f"name = {_string(dev.name)}",
        f"memory_gb = {_number(dev.memory_bytes, -9)}  # per rank",
        f"memory_bandwidth_gbps = {_number(dev.memory_bandwidth, -9)}",
        "efficiency = [" + ", ".join(f"[{_number(f)}, {_number(e)}]" for f, e in dev.efficiency) + "]",
        "",
        "[device.peak_tflops]  # dense",
        *(f"{dtype} = {_number(flops, -12)}" for dtype, flops in dev.peak_flops.items()),
    ]
    for key in _LINKS:
        link: Link = getattr(cluster, key)
        lines += ["", f"[links.{key}]", f"bandwidth_gbps = {_number(link.bandwidth, -9)}",
                  f"latency_us = {_number(link.latency_s, 6)}"]
        if link.collective_s:
            lines.append(f"collective_us = {_number(link.collective_s, 6)}")
    if any(getattr(cluster, name) != Cluster.__dataclass_fields__[name].default for name, _ in _RUNTIME.values()):
        lines += ["", "[runtime]  # measured by mmplan calibrate"]
        lines += [f"{key} = {_number(getattr(cluster, name), -exponent)}" for key, (name, exponent) in _RUNTIME.items()]
    return "\n".join(lines) + "\n"


def _string(text: str) -> str:
    """A TOML basic string: backslash, quote and control characters (incl. DEL) escaped (TOML 1.0, "String")."""
    escaped = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else "\\" + c if c in '"\\' else c
                      for c in text)
    return f'"{escaped}"'
