"""Issue 30: no output option replaces what is not a regular file. Outputs are written to a temporary file renamed
over the path, so `-o /dev/null` run as root replaced the system's device node with a file, and a FIFO likewise;
every output option now refuses a device, a FIFO or a directory in one line, before any work, and leaves it as it
was (`--log` already did). The device case goes through a symbolic link to /dev/null: were the check ever lost, the
rename would replace the link, never the device."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans.errors import MmplanError
from plans.serial import write_atomic
from tests.cli_helpers import one_line_error

REPO = Path(__file__).resolve().parents[2]
DP2 = REPO / "plans" / "examples" / "tiny-vlm-dp2.json"
runner = CliRunner()


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prof") / "tiny-vlm.json"
    assert runner.invoke(app, ["profile", "tiny-vlm", "-o", str(path), "--quiet"]).exit_code == 0
    return path


def _target(tmp_path: Path, kind: str, name: str = "out.json") -> Path:
    path = tmp_path / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/null")
    return path


def _unchanged(path: Path, kind: str) -> bool:
    mode = os.stat(path).st_mode
    return {"fifo": stat.S_ISFIFO, "directory": stat.S_ISDIR, "device": stat.S_ISCHR}[kind](mode)


COMMANDS = {
    "solve -o": lambda p, out: ["solve", str(p), "--cluster", "2xlocal-cpu", "--global-batch", "8", "-o", str(out)],
    "export -o": lambda p, out: ["export", str(DP2), "--to", "deepspeed", "--lossy", "-o", str(out)],
    "run --trace": lambda p, out: ["run", str(DP2), "--steps", "1", "--trace", str(out)],
    "run --log": lambda p, out: ["run", str(DP2), "--steps", "1", "--log", str(out)],
    "profile -o": lambda p, out: ["profile", "tiny-vlm", "-o", str(out)],
    "calibrate -o": lambda p, out: ["calibrate", "--quick", "-o", str(out)],
}


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_output_option_refuses_what_is_not_a_regular_file(profile, tmp_path, command, kind):
    out = _target(tmp_path, kind)
    line = one_line_error(runner.invoke(app, COMMANDS[command](profile, out)))
    assert "not a regular file" in line or "is a directory" in line, line
    assert _unchanged(out, kind)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_compare_trace_files_are_checked_before_any_is_written(profile, tmp_path, kind):
    traces = tmp_path / "traces"
    traces.mkdir()
    second = _target(traces, kind, "tiny-vlm-pp2.trace.json")
    res = runner.invoke(app, ["compare", str(DP2), str(REPO / "plans" / "examples" / "tiny-vlm-pp2.json"),
                              "--profile", str(profile), "--trace", str(traces)])
    assert "not a regular file" in one_line_error(res)
    assert _unchanged(second, kind) and not (traces / "tiny-vlm-dp2.trace.json").exists()


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_the_atomic_writer_itself_refuses(tmp_path, kind):
    out = _target(tmp_path, kind)
    with pytest.raises(MmplanError, match="not a regular file"):
        write_atomic(out, "x")
    assert _unchanged(out, kind) and [p.name for p in tmp_path.iterdir()] == [out.name]
