"""Issue 30 item 4: piped (stderr not a terminal), `mmplan demo`, `profile`, `solve` and `calibrate` print plain
progress lines instead of nothing for minutes; a command done within the first interval prints none (a refusal stays
one line)."""
from __future__ import annotations

import io
import time

from rich.console import Console

import planner.console as console
from planner.console import PlainLines


def plain_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=200), buf


def test_a_line_names_the_latest_step_its_share_and_the_time():
    con, buf = plain_console()
    lines = PlainLines("profiling tiny-vlm", interval=3600, console=con)
    lines.update("measuring blocks", 0.4)
    lines.update("writing \x1b[31m", 0.9)  # a user's text: its control characters shown, never sent
    lines.tick()
    text = buf.getvalue()
    assert text.startswith("profiling tiny-vlm: writing \u241b[31m (90%, ") and text.endswith(" s)\n")
    assert "\x1b" not in text and "measuring" not in text


def test_piped_progress_prints_lines_from_a_thread_while_the_work_is_silent(monkeypatch):
    con, buf = plain_console()
    monkeypatch.setattr(console, "err", con)
    monkeypatch.setattr(console, "PLAIN_INTERVAL_S", 0.05)
    with console.progress("solving") as note:
        note("ILP", 0.5)
        deadline = time.monotonic() + 30  # bounded wait for the thread's first lines (no speed asserted)
        while buf.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    printed = buf.getvalue().splitlines()
    assert len(printed) >= 2 and all(line.startswith("solving: ILP (50%, ") for line in printed)
    after = buf.getvalue()
    time.sleep(0.2)
    assert buf.getvalue() == after  # the thread stopped with the command


def test_a_quick_command_prints_no_progress_line(monkeypatch):
    con, buf = plain_console()
    monkeypatch.setattr(console, "err", con)
    with console.progress("mmplan demo") as note:  # the default interval: nothing before it
        note("profiling", 0.1)
    assert buf.getvalue() == ""
    with console.progress("mmplan demo", enabled=False) as note:
        note("profiling", 0.1)
    assert buf.getvalue() == ""
