"""The threads aaccl starts take no process signals: they are the main thread's.

The kernel hands a signal sent to the process (Ctrl-C's SIGINT, a launcher's SIGTERM,
hydra's SIGUSR1) to any one thread that does not block it. Python runs its handlers
in the main thread only, and only once that thread runs Python again: when the
signal lands on another thread, a main thread asleep in `select()` (an event loop
waiting for a call) goes on sleeping until something else wakes it. Under asyncio a
Ctrl-C then waited for the call's timeout (trio is immune: its wakeup file
descriptor wakes it whatever thread took the signal). So every thread aaccl starts
blocks those signals from its first instruction, and the kernel picks the main
thread over them. Threads aaccl does not start take signals all the same (numpy's
OpenBLAS pool, a user's): while a world is open on asyncio, a signal any thread
takes also writes to a socket the loop watches (`signals_wake_loop`), as trio's does.
"""

from __future__ import annotations

import asyncio
import signal
import socket
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


_waking: list[Any] = []  # [loop, reader, writer, worlds open] while installed


@contextmanager
def signals_wake_loop() -> Iterator[None]:
    """Meanwhile, a process signal wakes the running asyncio loop of the main thread,
    whichever thread took it, so that Python's handler runs at once (Ctrl-C cancels
    the program's main task). Through Python's wakeup file descriptor, where nobody
    set one (asyncio's `add_signal_handler` and trio set theirs: they wake already);
    worlds open at once share it, and the last one to close takes it away."""
    shared = _share()
    try:
        yield
    finally:
        if shared:
            _waking[3] -= 1
            if not _waking[3]:
                _uninstall()


def _share() -> bool:
    """Take a share of the wakeup of this thread's running loop, installing it if
    nobody has; False where there is nothing to share (not asyncio, not the main
    thread, a loop without readers, a wakeup fd of the program's own)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio has its own)
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    if _waking:
        if _waking[0] is loop:  # another world of this loop installed it
            _waking[3] += 1
            return True
        _uninstall()  # a loop's that ended with its worlds open
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    try:
        loop.add_reader(reader.fileno(), _drain, reader)
    except NotImplementedError:  # (Windows' proactor)
        reader.close()
        writer.close()
        return False
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone's: it wakes the loop already, and stays
        signal.set_wakeup_fd(previous)
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
        return False
    _waking[:] = [loop, reader, writer, 1]
    return True


def _uninstall() -> None:
    loop, reader, writer, _ = _waking
    _waking.clear()
    current = signal.set_wakeup_fd(-1)
    if current != writer.fileno():  # someone set theirs since: theirs stays
        signal.set_wakeup_fd(current)
    if not loop.is_closed():
        loop.remove_reader(reader.fileno())
    reader.close()
    writer.close()


def _drain(reader: socket.socket) -> None:
    """The loop woke for a signal: Python has run its handler; take the bytes."""
    try:
        while reader.recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass
