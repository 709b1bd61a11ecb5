"""Terminal output shared by the CLI commands: rich consoles, progress, one-line errors, byte/FLOP units."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

out = Console(highlight=False, emoji=False)
err = Console(stderr=True, highlight=False, emoji=False)


def fail(message: str) -> None:
    """The one way a command reports a user error: one line on stderr (exit code set by the caller)."""
    err.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}", markup=True, soft_wrap=True)


@contextlib.contextmanager
def progress(description: str, *, enabled: bool = True) -> Iterator[Callable[[str, float], None]]:
    """A transient progress bar on stderr; yields a callback(step, fraction)."""
    if not enabled or not err.is_terminal:
        yield lambda step, fraction: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(description, total=1.0, step="")
        yield lambda step, fraction: bar.update(task, completed=fraction, step=step)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def short_by(need: float, have: float) -> str:
    """"(3.2 MB short)": the shortfall in a unit that shows it (a fixed 0.00 GB hid small ones)."""
    return f"({human_bytes(need - have)} short)"


def human_count(n: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()
