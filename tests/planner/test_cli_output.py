"""What the CLI prints: user names with rich markup or control characters are shown literally and harmlessly
(never a crash after the output was written, never a raw escape sequence), and every `run` option passes
through torchrun's own argument parser."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from planner.cli import app
from planner.console import safe, visible

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()
MARKUP = "text[/]"
ANSI = "v\x1b[31mis"


def no_raw_controls(text: str) -> None:
    assert not any(ord(c) < 32 and c not in "\n\t" for c in text), repr(text)


def test_visible_and_safe_keep_one_symbol_per_control_character():
    assert visible("a\x1b[2Jb\r\x07\x9b") == "a\u241b[2Jb\u240d\u2407\ufffd"
    assert visible("tab\tand\nnewline") == "tab\tand\nnewline"
    assert safe("[bold]x[/]") == "\\[bold]x\\[/]"


def test_names_with_markup_and_escapes_go_through_every_command(tmp_path):
    prof, plan = tmp_path / "p[bold].json", tmp_path / "plan[red].json"
    res = runner.invoke(app, ["profile", "tiny-vlm", "--group", f"llm.*={MARKUP}", "--group", f"vision*={ANSI}", "-o", str(prof)])
    assert res.exit_code == 0, res.output
    assert json.loads(prof.read_text())["blocks"][-1]["group"] == MARKUP  # stored as given
    outputs = [res.stdout]
    for args in (["show", str(prof)],
                 ["solve", str(prof), "--cluster", "2xlocal-cpu", "--global-batch", "8", "-o", str(plan)],
                 ["compare", str(plan), "--profile", str(prof), "--trace", str(tmp_path / "tr[/]")]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
        outputs.append(res.stdout)
    for out in outputs:
        no_raw_controls(out)
    assert all(MARKUP in out for out in outputs[:3])  # profile, show and solve name the groups
    assert "v\u241b[31mis" in outputs[1] and "p[bold].json" in outputs[0] and "plan[red].json" in outputs[2]


def test_an_error_naming_a_control_character_prints_it_visibly(tmp_path):
    res = runner.invoke(app, ["show", str(tmp_path / "x\x1b[2J[/].json")])
    assert res.exit_code == 2
    no_raw_controls(res.stderr)
    assert "x\u241b[2J[/].json" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def _run_options() -> list[str]:
    cmd = typer.main.get_command(app).commands["run"]
    return [n for p in cmd.params for n in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])] if n.startswith("-")]


def test_every_run_option_passes_through_torchrun():
    """torchrun parses its whole command line, abbreviations included: `--log` is taken for its --log-dir /
    --logs-specs (ambiguous), so `run` also accepts it as --log-file; every other option must not collide."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    options = _run_options()
    assert "--log-file" in options
    refused = []
    for option in options:
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                parser.parse_args(["--standalone", "--nproc-per-node", "2", "-m", "planner.cli", "run", "plan.json", option, "x"])
            except SystemExit:
                refused.append(option)
    assert refused == ["--log"]
