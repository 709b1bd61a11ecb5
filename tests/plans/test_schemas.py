"""The JSON Schemas of the cluster TOML and of the metrics log accept what mmplan writes; the one atomic writer."""
from __future__ import annotations

import os
import re
import tomllib
from decimal import Decimal
from pathlib import Path

import pytest

from cost_models.catalog import CATALOG
from cost_models.cluster_spec import parse_cluster
from cost_models.cluster_toml import cluster_from_toml, cluster_to_toml
from plans.errors import FormatError, MmplanError
from plans.serial import parse_json, validate, write_atomic
from runtime.train import StepMetrics

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("spec", [*CATALOG, "64xh100-sxm"])
def test_every_cluster_file_calibrate_or_cluster_to_toml_writes_is_valid(spec):
    text = cluster_to_toml(parse_cluster(spec))
    validate(tomllib.loads(text, parse_float=Decimal), "cluster", "cluster TOML")


def test_the_documented_cluster_files_are_valid():
    for block in re.findall(r"```toml\n(.*?)```", (DOCS / "cluster-toml.md").read_text(), flags=re.S):
        validate(tomllib.loads(block, parse_float=Decimal), "cluster", "docs/cluster-toml.md")


def test_cluster_errors_name_the_field_as_the_file_does():
    with pytest.raises(FormatError, match=r"^c.toml: \[links.inter_node\] latency_us must be a finite number >= 0, got -1$"):
        cluster_from_toml('base = "h100-sxm"\n[links.inter_node]\nlatency_us = -1\n', source="c.toml")
    with pytest.raises(FormatError, match=r"^c.toml: \[device.peak_tflops\] bf16 must be a number, got 'fast'$"):
        cluster_from_toml('base = "h100-sxm"\n[device.peak_tflops]\nbf16 = "fast"\n', source="c.toml")
    with pytest.raises(FormatError, match=r"^c.toml: \[links.nvme\] bandwidth_gbps must be a finite number, got NaN$"):
        cluster_from_toml('base = "h100-sxm"\n[links.nvme]\nbandwidth_gbps = nan\n', source="c.toml")


def test_the_runtimes_metrics_rows_are_valid():
    row = StepMetrics(step=3, loss=2.5, step_time_s=0.1, compute_s=[0.05, 0.06], comm_s=[0.01, 0.0], idle_s=[0.0, 0.01],
                      peak_memory_bytes=[1e6, 2e6])
    validate(dict(row.__dict__), "metrics", "metrics row")
    validate({"step": 0, "step_time_s": 1, "compute_s": 0.5, "peak_memory_bytes": 10, "loss": None}, "metrics", "row")
    with pytest.raises(FormatError, match="field compute_s/1"):
        validate({"step": 0, "step_time_s": 1, "compute_s": [1, -1], "peak_memory_bytes": 10}, "metrics", "row")


def test_json_refuses_nan_unless_asked():
    with pytest.raises(FormatError, match="NaN is not a JSON number"):
        parse_json('{"loss": NaN}', "row")
    assert parse_json('{"loss": NaN}', "row", allow_nan=True)["loss"] != 0


def test_write_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    write_atomic(path, "first\n")
    write_atomic(path, b"second\n", durable=False)
    assert path.read_bytes() == b"second\n" and os.listdir(tmp_path) == ["out.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(MmplanError, match="is a directory, not a regular file"):  # refused before any write (issue 30)
        write_atomic(tmp_path, "x")
    assert os.listdir(tmp_path) == ["out.json"]
