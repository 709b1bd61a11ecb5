"""SIGTERM and SIGHUP handled like Ctrl-C: they raise in the main thread, so every `finally` cleans up."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives SIGTERM or SIGHUP (a KeyboardInterrupt, so code that
    cleans up after Ctrl-C cleans up after these too)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@contextlib.contextmanager
def terminate_like_interrupt() -> Iterator[None]:
    """While inside: the first SIGTERM/SIGHUP raises Terminated; later ones are ignored, so that the cleanup the
    first one started is not itself interrupted. Outside the main thread this does nothing (Python delivers
    signals to the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):  # noqa: ARG001 - the signal module's signature
        if not fired:
            fired.append(signum)
            raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _exit_line(signum: int) -> bytes:
    """What user_errors (planner/cli.py) prints for the signal, as one line."""
    what = "interrupted" if signum == signal.SIGINT else f"terminated by {signal.Signals(signum).name}"
    return f"error: {what}\n".encode()


@contextlib.contextmanager
def exit_at_once() -> Iterator[None]:
    """While inside -- work that owns nothing yet (no file written, no rank started: `mmplan run`'s pre-check) --
    SIGTERM, SIGHUP and SIGINT end the process at once: one line on stderr, exit code 128 + signal, no exception to
    unwind. An exception raised by a handler can be held back or lost in library code (a broad `except`, a `__del__`,
    a finalizer: "Exception ignored"), and terminate_like_interrupt ignores every later signal, so a pre-check
    building a large model could outlive SIGTERM by minutes (issue 31). The C-level handler also wakes a watcher
    thread (signal.set_wakeup_fd), which exits even while the main thread sits in a long call that released the GIL.
    Outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    once = threading.Lock()  # the handler and the watcher may both see the signal: one line, one exit

    def handler(signum, frame):  # noqa: ARG001 - the signal module's signature
        once.acquire()  # the second caller waits here for the first one's exit
        os.write(2, _exit_line(signum))
        os._exit(128 + signum)

    read, write = os.pipe()
    os.set_blocking(write, False)

    def watch() -> None:
        try:
            got = os.read(read, 1)
        except OSError:
            return
        if got:
            handler(got[0], None)

    caught = (*SIGNALS, signal.SIGINT)
    previous = {s: signal.signal(s, handler) for s in caught}
    wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="mmplan-exit-at-once", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(wakeup)
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        os.close(write)  # the watcher reads end-of-file and returns
        watcher.join(timeout=5)
        os.close(read)


def default_in_child() -> None:
    """In a forked rank: the default actions again (a rank is stopped by its launcher, which cleans up)."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)
