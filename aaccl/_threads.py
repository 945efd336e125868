"""The threads aaccl starts take no process signals: they are the main thread's.

The kernel hands a signal sent to the process (Ctrl-C's SIGINT, a launcher's SIGTERM,
hydra's SIGUSR1) to any one thread that does not block it. Python runs its handlers
in the main thread only, and only once that thread runs Python again: when the
signal lands on another thread, a main thread asleep in `select()` (an event loop
waiting for a call) goes on sleeping until something else wakes it. Under asyncio a
Ctrl-C then waited for the call's timeout (trio is immune: its wakeup file
descriptor wakes it whatever thread took the signal). So every thread aaccl starts
blocks those signals from its first instruction, and the kernel always picks the
main thread.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

SIGNALS = frozenset(getattr(signal, name) for name in (
    "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD",
    "SIGWINCH") if hasattr(signal, name))
"""The signals a process is sent, which its main thread's handlers are for (never
SIGSEGV and its kind: those go to the thread that faulted)."""

_CAN_BLOCK = hasattr(signal, "pthread_sigmask")  # (POSIX)


@contextmanager
def _blocked() -> Iterator[None]:
    """SIGNALS blocked in this thread meanwhile: a thread started now inherits the
    mask, with no moment in which it could take one. A signal that comes meanwhile
    waits, and is handled once they are unblocked."""
    if not _CAN_BLOCK:
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def start(target: Callable[..., object], name: str, *args: Any) -> threading.Thread:
    """Start a daemon thread running `target(*args)`, blind to process signals."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    with _blocked():
        thread.start()
    return thread


def leave_signals() -> None:
    """Block SIGNALS in the calling thread, one started by someone else (a pool's
    worker): the initializer of aaccl's pools, and the first step of its work on
    anyio's worker threads (`quietly`)."""
    if _CAN_BLOCK and threading.current_thread() is not threading.main_thread():
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def quietly(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, for a worker thread that is not aaccl's (anyio.to_thread): the thread
    blocks process signals first."""
    def run(*args: Any) -> T:
        leave_signals()
        return fn(*args)
    return run
