"""Issue 30's first-ten-minutes items: `--version`; a plan that does not fit exits 2 from `solve` unless
--allow-unfit; "1 GPU" / "1 micro-batch"; a GPU's memory as its datasheet (GB) and nvidia-smi (GiB) state it; the
`--layout` help readable at 80 columns."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cost_models.catalog import CATALOG
from planner.cli import app, version
from plans.units import format_capacity, plural
from tests.cli_helpers import one_line_error

runner = CliRunner()


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prof") / "tiny-vlm.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(path), "--quiet"]).exit_code == 0
    return path


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"mmplan {version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version())


def test_the_layout_help_is_readable_at_80_columns():
    res = runner.invoke(app, ["solve", "--help"], env={"COLUMNS": "80", "TERM": "dumb"})
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    start = next(i for i, line in enumerate(lines) if "--layout " in line)
    end = next(i for i in range(start + 1, len(lines)) if "--" in lines[i][:45])  # the next option's row
    text = " ".join(line.strip("│ ").split("  ")[-1].strip() for line in lines[start:end])
    assert "…" not in text
    for key in ("tp=8,pp=2,dp=32", "micro-batch", "interleaved:2", "selective", "zero", "sp (sequence"):
        assert key in text, (key, text)


def test_plurals_and_capacities():
    assert plural(1, "GPU") == "1 GPU" and plural(2, "GPU") == "2 GPUs"
    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch" and plural(4, "micro-batch", "micro-batches") == "4 micro-batches"
    assert format_capacity(CATALOG["h100-sxm"].device.memory_bytes) == "85.5 GB (79.6 GiB)"  # 81,559 MiB (nvidia-smi)


def _tiny_gpus(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text('base = "local-cpu"\nname = "tiny"\ngpus_per_node = 1\n\n[device]\nmemory_gb = 0.001\n')
    return path


def test_a_plan_that_does_not_fit_exits_2_unless_allowed(profile, tmp_path):
    cluster = _tiny_gpus(tmp_path)
    args = ["solve", str(profile), "--cluster", str(cluster), "--global-batch", "8", "--baseline", "homogeneous",
            "--layout", "tp=1,pp=1,dp=1", "-o", str(tmp_path / "p.json")]
    line = one_line_error(runner.invoke(app, args))
    assert "does not fit" in line and "--allow-unfit" in line and (tmp_path / "p.json").exists()
    res = runner.invoke(app, [*args, "--allow-unfit"])
    assert res.exit_code == 0, res.output
    # the summary of a one-GPU plan: "1 GPU", never "1 GPUs"
    assert "1 GPUs" not in res.stdout and "1 GPU" in res.stdout and "1 micro-batches" not in res.stdout
