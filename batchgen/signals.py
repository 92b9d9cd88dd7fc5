"""SIGTERM and SIGINT as an exception, so a run ends cleanly: its lease released, its attempt recorded."""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(KeyboardInterrupt):
    """SIGTERM (what Prefect, Kubernetes and Ray send first) or SIGINT arrived."""


@contextlib.contextmanager
def interruptible():
    """Turn SIGTERM and SIGINT into Interrupted, so a run ends cleanly; only on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
