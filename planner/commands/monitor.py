"""A run's progress while it trains: a progress bar on a terminal, one line every N steps for logs, TensorBoard.

Rank 0 appends each step's metrics to a JSON-lines file (runtime/train.py, Job.progress); a thread of the
process that launched the ranks (or of rank 0 itself under torchrun) reads the new rows a few times a second
and shows them. Everything goes to stderr, so `--json` keeps stdout for its summary. The metrics log
(`--log`) is written by rank 0 itself and does not depend on this.
"""
from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plans.errors import MmplanError

POLL_S = 0.2


@dataclass(frozen=True, slots=True)
class MonitorOptions:
    show: bool = True  # progress bar (terminal) and log lines on stderr
    log_every: int = 10  # one line every N steps (0: none)
    tensorboard: Path | None = None  # a TensorBoard log directory (needs the tensorboard package)


def check_monitor(options: MonitorOptions) -> None:
    """Refuse bad options before any rank starts (one line each)."""
    if isinstance(options.log_every, bool) or not isinstance(options.log_every, int) or options.log_every < 0:
        raise MmplanError(f"--log-every must be a number of steps >= 0, got {options.log_every!r}")
    if options.tensorboard is not None:
        if importlib.util.find_spec("tensorboard") is None:
            raise MmplanError("--tensorboard needs the tensorboard package: pip install tensorboard")
        if options.tensorboard.exists() and not options.tensorboard.is_dir():
            raise MmplanError(f"--tensorboard {options.tensorboard} is a file, not a directory")


def step_line(row: dict[str, Any], steps: int, global_batch: int) -> str:
    """'step 20/100  loss 4.1234  12.3 samples/s  0.652 s/step' for the step just finished (row: StepMetrics)."""
    t = row["step_time_s"]
    rate = global_batch / t if t > 0 else float("inf")
    return f"step {row['step'] + 1}/{steps}  loss {row['loss']:.4f}  {rate:,.1f} samples/s  {t:.3f} s/step"


class Monitor:
    """Context manager: `path` is the file for rank 0's rows (None when nothing is shown or written)."""

    def __init__(self, options: MonitorOptions, *, steps: int, global_batch: int) -> None:
        self.options, self.steps, self.global_batch = options, steps, global_batch
        active = options.show or options.tensorboard is not None
        self._dir = tempfile.mkdtemp(prefix="mmplan-progress-") if active else None
        self.path = os.path.join(self._dir, "steps.jsonl") if self._dir else None
        self._offset = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = self._task = self._writer = None

    def __enter__(self) -> Monitor:
        if self.path is None:
            return self
        from planner import console

        if self.options.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.options.tensorboard))
        self._console = console.err
        if self.options.show and console.err.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}", markup=False), TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=console.err, transient=True)
            self._bar.start()
            self._task = self._bar.add_task("training", total=self.steps, status="starting the ranks")
        self._thread = threading.Thread(target=self._loop, name="mmplan-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.path is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        try:
            self._poll()  # the rows written since the last poll
        finally:
            if self._bar is not None:
                self._bar.stop()
            if self._writer is not None:
                self._writer.close()
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self._poll()

    def _poll(self) -> None:
        """Show the complete rows appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            self._show(json.loads(line))

    def _show(self, row: dict[str, Any]) -> None:
        step = row["step"] + 1
        line = step_line(row, self.steps, self.global_batch)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=line.split("  ", 1)[1])
        if self.options.show and self.options.log_every and (step % self.options.log_every == 0 or step == self.steps):
            self._console.print(line, soft_wrap=True)
        if self._writer is not None:
            w, t = self._writer, row["step_time_s"]
            w.add_scalar("train/loss", row["loss"], step)
            w.add_scalar("train/step_time_s", t, step)
            if t > 0:
                w.add_scalar("train/samples_per_s", self.global_batch / t, step)
            if row.get("peak_memory_bytes"):
                w.add_scalar("memory/peak_bytes_max_rank", max(row["peak_memory_bytes"]), step)
            w.flush()
