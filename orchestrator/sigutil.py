"""Stop signals (SIGINT, SIGTERM, SIGHUP) for the commands that run for long: the one module that installs,
holds, blocks and restores them.

- :class:`StopSignals`: ``up``'s handlers for its whole life; the first signal raises :class:`StopRequested`,
  later ones are only counted, so nothing cuts the clean stop short.
- :func:`stop_signals_blocked`: the stop signals blocked in this thread, so threads started inside leave them to
  the main thread.
- :func:`keep_signal_handlers`: Ray's own signal handling kept out of this process around ``ray.init`` and
  ``ray.shutdown``.
- :func:`terminate_as_interrupt`: SIGTERM and SIGHUP act like Ctrl-C (``build``, ``bench``).
- :func:`interrupts_held`: Ctrl-C and SIGTERM kept while a child process is being started.
- :func:`stop_signals_set`: a helper process (the keeper of an early llama-server) told to stop by any of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class StopRequested(KeyboardInterrupt):
    """A signal (Ctrl-C, SIGTERM, SIGHUP) asked ``up`` to stop. A KeyboardInterrupt, so every clean-up path that
    handles Ctrl-C handles it; ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP for the whole life of ``up``: the first one raises :class:`StopRequested` (or,
    while :meth:`held`, is kept until the hold ends); every later one is only counted, so nothing cuts the stop
    it started short. Installed in the main thread only; :func:`keep_signal_handlers` puts these handlers back
    after ``ray.init`` and ``ray.shutdown`` (Ray installs its own SIGTERM handler, which exits at once).

    A signal whose disposition is "ignore" when this is entered stays ignored: ``nohup orchestrator up`` must
    survive the hang-up it was started to survive."""

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.first: int | None = None        # the signal that asked for the stop
        self.count = 0
        self._raised = False
        self._holds = 0
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if _in_main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _on_signal(self, signum: int, _frame) -> None:
        self.count += 1
        if self.first is None:
            self.first = signum
        if self._holds or self._raised:
            return
        self._raised = True
        raise StopRequested(signum)

    @contextlib.contextmanager
    def held(self):
        """Signals inside the block are kept; the first one is raised when the outermost hold ends (unless the
        block raised itself)."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
        self.raise_pending()

    def raise_pending(self) -> None:
        if self._holds == 0 and self.first is not None and not self._raised:
            self._raised = True
            raise StopRequested(self.first)

    def absorb(self) -> None:
        """From now on every signal is only counted (the stop has begun some other way)."""
        self._raised = True


@contextlib.contextmanager
def stop_signals_blocked():
    """SIGINT, SIGTERM and SIGHUP blocked in this thread for the block; a thread started inside keeps them
    blocked for good (a new thread inherits its creator's mask), so such signals always reach the main thread."""
    if not _in_main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def start_thread_unsignalled(thread: threading.Thread) -> threading.Thread:
    """Start ``thread`` with the stop signals blocked in it, so they always go to the main thread."""
    with stop_signals_blocked():
        thread.start()
    return thread


@contextlib.contextmanager
def keep_signal_handlers():
    """Ray's own signal handling kept out of this process. ``ray.init`` installs a SIGTERM handler that calls
    ``sys.exit`` at once (which would skip ``up``'s clean stop and leave everything running): it is not allowed
    to. ``ray.shutdown`` resets SIGTERM to the default below Python (Python still reports its handler, the kernel
    kills). So the stop signals are blocked in this thread while Ray runs the block (Ray's threads, started
    inside, keep them blocked; ``up``'s own threads are started blocked too), so one that comes meanwhile waits,
    pending; every handler is installed again afterwards, whatever ``signal.getsignal`` says, and only then are
    they unblocked: the signal reaches our handler, never Ray's or the default."""
    if not _in_main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    utils = sys.modules.get("ray._private.utils")
    ray_setter = getattr(utils, "set_sigterm_handler", None)
    with stop_signals_blocked():
        if ray_setter is not None:
            utils.set_sigterm_handler = lambda handler: None
        try:
            yield
        finally:
            if ray_setter is not None:
                utils.set_sigterm_handler = ray_setter
            for sig, handler in saved.items():
                if handler is not None:
                    signal.signal(sig, handler)


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM and SIGHUP act like Ctrl-C inside the block (``build`` stops its compiler and keeps what it
    compiled, ``bench`` stops its server and keeps its results), so every way of stopping a command ends the same
    clean way. An ignored SIGHUP (``nohup``) stays ignored."""
    if not _in_main_thread():
        yield
        return

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    old = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:
            old[s] = signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def interrupts_held():
    """Hold Ctrl-C/SIGTERM while a child is being started: an interrupt between fork and exec would leave a
    process that no one owns. Once the start returned (the process object exists, so it will be stopped), a held
    signal goes to its own handler. Only the Python handlers change, not the signal mask, so the child does not
    inherit blocked signals. Outside the main thread this holds nothing."""
    if not _in_main_thread():
        yield
        return
    got: list[int] = []
    old = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda signum, frame: got.append(signum))
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if got:
            handler = old.get(got[0])
            if callable(handler):
                handler(got[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), got[0])


def stop_signals_set(event: threading.Event) -> None:
    """Every stop signal sets ``event`` for the rest of this process: a helper process's main loop watches it and
    stops what it keeps. Even a hang-up ignored by whoever started it stops it: it lives only for its owner."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: event.set())
