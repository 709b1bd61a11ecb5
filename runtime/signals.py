"""SIGTERM and SIGHUP handled like Ctrl-C: they raise in the main thread, so every `finally` cleans up."""
from __future__ import annotations

import contextlib
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


def default_in_child() -> None:
    """In a forked rank: the default actions again (a rank is stopped by its launcher, which cleans up)."""
    for s in SIGNALS:
        signal.signal(s, signal.SIG_DFL)
