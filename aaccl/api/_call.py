"""`Call`: one operation submitted to a CCLO, awaitable from asyncio and trio."""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable, Generator
from types import CodeType
from typing import Any

from .. import _trace
from .._errors import Aborted, ACCLError, DependencyError
from ..devices import DeviceCall
from ..driver import Driver
from . import _bridge

log = logging.getLogger("aaccl")


_Future = asyncio.Future
_running_loop = asyncio._get_running_loop  # None outside asyncio (trio, a thread)

Origin = tuple[CodeType, int, dict[str, Any]]
"""Where a call was made: the code, instruction offset and globals of the frame that
called the public method (the frame itself would keep its locals alive)."""

Waker = Callable[[], None] | asyncio.Future[None]
"""What wakes a waiter when a call finishes: a function to call (a thread's event, a
bridge's wake), or the future an asyncio task awaits (see `_wake`)."""


def _wake(future: asyncio.Future[None]) -> None:
    """Resume a task of asyncio awaiting a call: in line on its loop's thread (no
    system call), through the loop's thread-safe entry from any other."""
    loop = future.get_loop()
    if _running_loop() is loop:
        if not future.done():  # a cancelled await has gone away
            future.set_result(None)
        return
    try:
        loop.call_soon_threadsafe(_resolve, future)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _root_cause(error: BaseException | None) -> BaseException | None:
    """The failure a DependencyError comes from: the first call that really failed."""
    while isinstance(error, DependencyError) and error.__cause__ is not None:
        error = error.__cause__  # one step at most: every DependencyError points at its root
    return error


class Call:
    """An operation on the CCLO: submitted when created, awaitable, and usable in
    another call's `waitfor`.

    Awaiting returns None once the result is in place (in host memory, unless
    `to_fpga` asked to leave it on the device) and raises the call's error.

    A call garbage collected without ever being used — awaited, `wait()`ed, its
    `exception()` read, or passed in another call's `waitfor` (`done()` does not
    count, nor aaccl's own waits when a rank closes) — warns with a RuntimeWarning,
    like a coroutine never awaited: whoever dropped it may read a buffer before the
    result is in place. A failed call is reported once, by its error instead: logged
    on the `aaccl` logger if nobody retrieved it, silent if someone did (awaiting a
    dependent that raised DependencyError counts).
    """

    __slots__ = ("_name", "owner", "_device", "_lock", "_wakers", "_finished", "_error",
                 "_retrieved", "_used", "_given_up", "_deps", "_buffers", "_finish", "_on_done",
                 "_origin", "_seen", "__weakref__")

    def __init__(self, name: str | tuple[str, int, int, str], owner: object, device: DeviceCall,
                 deps: tuple[Call, ...], finish: Callable[[], None] | None,
                 on_done: Callable[[Call], None] | None = None,
                 buffers: tuple[object, ...] = (), origin: Origin | None = None) -> None:
        # `name` may come as (op, rank, number, where): formatted only when someone reads
        # it (an error, a warning, a trace), not for every call
        self._name = name
        self._origin = origin  # where the user made it: see __del__
        self.owner = owner
        self._buffers = buffers  # the device uses them until it completes: keep them allocated
        self._device = device
        self._lock = threading.Lock()
        self._wakers: list[Waker] = []
        self._finished = False
        self._error: BaseException | None = None
        self._retrieved = False
        self._used = False  # awaited, waited, exception() read or in a waitfor: see __del__
        self._seen = False  # its end seen by the code that made it, or it is in a waitfor
        # (api/_tasks.py: another task's collective after it is ordered on every rank)
        self._given_up = False  # an await of it was cancelled before it finished
        self._deps = deps
        self._finish, self._on_done = finish, on_done
        if not device._settled:
            device.own(self)  # its one completion
        elif on_done is None and finish is None and not device.retcode \
                and not device.aborted and device.error is None:
            # it ended well on the spot (a nop), with nothing to sync or tell: done,
            # before any other thread can see this Call
            self._finished, self._buffers, self._deps = True, (), ()
        else:  # completed already: its owner is told by nobody else
            self._completed(device)

    @property
    def name(self) -> str:
        """The call as errors name it: "allreduce (rank 0, call 7)"."""
        name = self._name
        if type(name) is tuple:
            op, rank, number, where = name
            name = self._name = f"{op} (rank {rank}, call {number}{where})"
        return name  # type: ignore[return-value]

    def _outcome(self, dev: DeviceCall) -> BaseException | None:
        error: BaseException | None = Driver.error(dev, self.name)
        if error is None and self._finish is not None:
            try:
                self._finish()
            except Exception as exc:  # a host sync failed: the call failed
                error = exc
        if isinstance(error, DependencyError):
            failed = [d for d in self._deps if d._error is not None]
            error = DependencyError(f"{self.name} did not run: "
                                    f"{', '.join(d.name for d in failed)} failed")
            if failed:  # the root, not the chain: a cause per call would be 20,000 deep
                error.__cause__ = _root_cause(failed[0]._error)
        else:
            self._deps = ()  # keep a chain's history only where it explains a failure
        return error

    def _completed(self, dev: DeviceCall) -> None:  # on the device's thread
        if dev.retcode or dev.aborted or dev.error is not None or self._finish is not None:
            try:
                error = self._outcome(dev)
            except Exception as exc:  # fail this call, never the device's thread (nor hang)
                error = ACCLError(f"{self.name} failed inside aaccl: {type(exc).__name__}")
                error.__cause__ = exc
            self._buffers, self._finish = (), None
        else:  # it succeeded, with nothing to sync: the common small call
            error = None
            self._buffers = self._deps = ()
        with self._lock:
            self._error, self._finished = error, True
            wakers, self._wakers = self._wakers, []
        on_done = self._on_done
        if on_done is not None:
            self._on_done = None
            on_done(self)
        for wake in wakers:
            if isinstance(wake, _Future):  # (any loop's future: uvloop's too)
                _wake(wake)
            else:
                wake()

    def done(self) -> bool:
        """True once the call has finished, successfully or not."""
        return self._finished

    def exception(self) -> BaseException | None:
        """The error of a finished call, or None (counts as retrieving it)."""
        if not self._finished:
            raise RuntimeError(f"{self.name} has not finished")
        self._used = self._seen = True
        self._mark_retrieved()
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block this thread until the call finished, then raise its error, as `await`
        would: for code without an event loop (threads, `aaccl.compat`). Never call it
        on an event loop's thread. TimeoutError if `timeout` seconds pass first (the
        call goes on). A timeout of inf waits as None does."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
                raise TypeError(f"timeout must be a number of seconds or None, "
                                f"not {type(timeout).__name__}")
            if math.isnan(timeout):
                raise ValueError("timeout must be a number of seconds or None, not nan")
            if timeout == math.inf:  # (threading's wait takes no infinite timeout)
                timeout = None
        self._used = True
        if not self._block(timeout):
            raise TimeoutError(f"{self.name} did not finish within {timeout} s")
        self._seen = True
        self._mark_retrieved()
        if self._error is not None:
            raise self._error

    def _block(self, timeout: float | None = None) -> bool:
        """Block this thread until the call finished; False if `timeout` passed first.
        Internal waits (leaving a rank) do not count as using the call: see __del__."""
        if self._finished:
            return True
        finished = threading.Event()
        if not self._register(finished.set):
            return True
        try:
            if finished.wait(timeout):
                return True
        except BaseException:  # interrupted (Ctrl-C): the waker goes with the wait
            self._forget(finished.set)
            raise
        self._forget(finished.set)
        return False

    def _register(self, wake: Callable[[], None]) -> bool:
        with self._lock:
            if self._finished:
                return False
            self._wakers.append(wake)
            return True

    def _forget(self, wake: Waker) -> None:
        """A waiter gave up (cancelled, timed out): its `wake` goes."""
        with self._lock:
            if wake in self._wakers:
                self._wakers.remove(wake)  # (a future compares by identity)

    def __await__(self) -> Generator[Any, None, None]:
        self._used = True  # even if the await is cancelled: the caller did await it
        if not self._finished:
            trace = _trace._active
            began = time.perf_counter_ns() if trace is not None else 0
            try:
                poller = getattr(self.owner, "_poller", None)
                loop = _running_loop() if poller is None else None
                if loop is not None:  # asyncio: the future is the waker (see _wake)
                    future = loop.create_future()
                    with self._lock:
                        waiting = not self._finished
                        if waiting:
                            self._wakers.append(future)
                    if waiting:
                        try:
                            yield from future
                        except BaseException:
                            self._forget(future)
                            raise
                else:
                    yield from _bridge.wait(self._register, poller, self._forget,
                                            self).__await__()
            except BaseException:
                self._given_up = not self._finished  # cancelled: see ACCL._settle
                raise
            finally:
                if trace is not None:
                    rank = getattr(self.owner, "rank", 0)
                    trace.add(rank, "host", f"await {self.name.split(' (')[0]}", began,
                              time.perf_counter_ns(), call=self.name)
        self._seen = True
        if self._deps:
            self._mark_retrieved()
        else:
            self._retrieved = True
        if self._error is not None:
            raise self._error

    async def wait_async(self) -> None:
        """Await the call as a coroutine: a Call is awaitable but not a coroutine, so
        `asyncio.create_task(call)` and trio's `nursery.start_soon` refuse it; pass
        `call.wait_async()` (asyncio) or `call.wait_async` (trio) instead."""
        await self

    def _mark_retrieved(self) -> None:
        """Retrieving a call's error retrieves those of the calls its failure came from,
        so none of them is logged as unawaited; a stack, not recursion, for long chains."""
        self._retrieved = True
        pending = list(self._deps)
        while pending:
            dep = pending.pop()
            if not dep._retrieved:
                dep._retrieved = True
                pending.extend(dep._deps)

    def __repr__(self) -> str:
        state = "pending" if not self._finished else "failed" if self._error else "done"
        return f"<Call {self.name} {state}>"

    def __del__(self) -> None:
        # One report per failure. A failure is logged unless someone retrieved it (itself or
        # through a dependent's DependencyError): the warning would add nothing. A call
        # that did not fail (or never finished) and was never used warns.
        error = self._error
        if error is not None:
            # an Aborted call's world ended early: that cause is reported, not each call;
            # nor is every call that failed because one did (a loop of 10,000 calls
            # after it): the first one collected says what failed, once for them all
            root = _root_cause(error)
            if self._retrieved or isinstance(root, Aborted) \
                    or getattr(root, "_aaccl_logged", False):
                return
            if root is error:
                log.error("%s failed and nobody awaited it: %s", self.name, error)
            else:
                log.error("%s failed and nobody awaited it: %s; the failure: %s (other "
                          "calls that did not run because of it are not listed)",
                          self.name, error, root)
            try:
                root._aaccl_logged = True  # type: ignore[union-attr]
            except AttributeError:  # (an exception type without attributes of its own)
                pass
        elif not self._used:
            # Where it is collected says nothing (often the device's thread): the warning
            # points at the line that made the call, as a coroutine's would at its await.
            message = (f"Call {self.name} was never awaited: its result may not be in "
                       "place when you read the buffer; await it, pass it in waitfor=, "
                       "or call .wait()")
            warn_at(self._origin, message)


def warn_at(origin: Origin | None, message: str) -> None:
    """A RuntimeWarning shown at the user's line that made a call (`origin`), as
    warnings.warn would from that frame: its module's filters and registry. The source
    line comes from the file when shown (a loader's get_source, tried first when given
    the module's globals, may raise here)."""
    if origin is None:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    code, offset, module = origin
    warnings.warn_explicit(message, RuntimeWarning, code.co_filename, _line(code, offset),
                           module.get("__name__", "<unknown>"),
                           module.setdefault("__warningregistry__", {}))


def _line(code: CodeType, offset: int) -> int:
    """The line of the instruction at `offset` in `code` (what frame.f_lineno says)."""
    for start, end, line in code.co_lines():
        if start <= offset < end and line is not None:
            return line
    return code.co_firstlineno
