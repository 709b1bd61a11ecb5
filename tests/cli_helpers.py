"""Shared by CLI tests: a user error is exit 2 and exactly one line on stderr, never a traceback."""
from __future__ import annotations


def one_line_error(res, code: int = 2) -> str:
    """The single stderr line of a CliRunner result that exited with `code`."""
    assert res.exit_code == code, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]
