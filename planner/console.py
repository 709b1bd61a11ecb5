"""Terminal output shared by the CLI commands: rich consoles, progress, one-line errors, FLOP counts (bytes: plans/units.py).

Names come from users (model, group and block names, file paths): the consoles print strings literally (no
rich markup unless a call asks for it, with the user's parts escape()d) and show control characters, ANSI
escapes included, as visible symbols instead of sending them to the terminal.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

# C0 controls (but newline and tab) -> their Unicode control pictures (U+2400..), DEL -> U+2421, C1 -> U+FFFD:
# one character for one, so the styles of a rich Text keep their places
_VISIBLE = {c: chr(0x2400 + c) for c in range(32) if chr(c) not in "\n\t"} | {0x7F: "\u2421"} | {c: "\ufffd" for c in range(0x80, 0xA0)}


def visible(text: str) -> str:
    """`text` with its control characters shown as symbols (an ESC byte can no longer restyle the terminal)."""
    return text.translate(_VISIBLE)


def safe(text: object) -> str:
    """A user's string to put inside rich markup: markup escaped, control characters made visible."""
    return escape(visible(str(text)))


class SafeConsole(Console):
    """A rich Console that never sends a control character of the text it renders to the terminal."""

    def render_str(self, text: str, **kwargs) -> Text:  # every str rendered (print, table cells, titles) passes here
        rendered = super().render_str(text, **kwargs)
        clean = visible(rendered.plain)
        if clean != rendered.plain:
            rendered.plain = clean
        return rendered


out = SafeConsole(highlight=False, emoji=False, markup=False)
err = SafeConsole(stderr=True, highlight=False, emoji=False, markup=False)


def fail(message: str) -> None:
    """The one way a command reports a user error: one line on stderr (exit code set by the caller)."""
    err.print(f"[bold red]error:[/] {safe(' '.join(message.split()))}", markup=True, soft_wrap=True)


PLAIN_INTERVAL_S = 15.0  # piped: one progress line per this many seconds (a command done sooner prints none)


class PlainLines:
    """Progress for a stderr that is not a terminal (piped, redirected to a file, a CI log), where rich's bar shows
    nothing: a background thread prints the latest step as one plain line every `interval` seconds,
    "profiling tiny-vlm: measuring blocks (40%, 30 s)". Nothing is printed before the first interval, so a quick
    command (or a refusal) stays silent or one line."""

    def __init__(self, description: str, interval: float = PLAIN_INTERVAL_S, console: Console | None = None) -> None:
        self.description, self.interval, self.console = visible(description), interval, console or err
        self.step, self.fraction = "", 0.0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmplan-progress", daemon=True)

    def update(self, step: str, fraction: float) -> None:
        self.step, self.fraction = visible(step), fraction  # read by the thread: two plain assignments

    def line(self) -> str:
        where = f"{self.step} " if self.step else ""
        return f"{self.description}: {where}({self.fraction:.0%}, {time.monotonic() - self.started:.0f} s)"

    def tick(self) -> None:
        self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)
        with contextlib.suppress(Exception):
            self.console.file.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def __enter__(self) -> "PlainLines":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def progress(description: str, *, enabled: bool = True) -> Iterator[Callable[[str, float], None]]:
    """A transient progress bar on stderr, or plain lines when stderr is not a terminal (PlainLines); yields a
    callback(step, fraction)."""
    if not enabled:
        yield lambda step, fraction: None
        return
    if not err.is_terminal:
        with PlainLines(description, PLAIN_INTERVAL_S) as lines:
            yield lines.update
        return
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), TextColumn("{task.fields[step]}", markup=False),
                  TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(visible(description), total=1.0, step="")
        yield lambda step, fraction: bar.update(task, completed=fraction, step=visible(step))


def human_count(n: float, unit: str = "") -> str:
    for suffix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".rstrip()
