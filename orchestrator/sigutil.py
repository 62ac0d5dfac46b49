"""Signals for long-running commands."""

from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM and SIGHUP act like Ctrl-C inside the block (``up`` tears down, ``build`` stops its compiler and
    keeps what it compiled), so every way of stopping a command ends the same clean way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
