"""`Call`: one call on a CCLO, from the device that runs it to the task awaiting it.

One object carries a call all the way: the device makes it (`Device.start`, or a
subclass, as the soft CCLO's state machine is) and completes it with a return code;
the rank that submitted it (`aaccl.ACCL`) adopts it, and it is what the user awaits,
passes in `waitfor` and reads. So a call has one completion: no handshake between an
API object and a device object, no second list of callbacks. Every call shares one
lock (`LOCK`) with the ranks that adopt calls: a rank adopts a call and books it in
one critical section, and the completion that settles it forgets it in the same
critical section, so a call has no lock of its own, and a small call is submitted
and completed in two acquisitions.

Devices also make calls nobody adopts (a host job, a step of a call run as several,
a wait for a host sync): those have no owner, never warn, and complete the same way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Generator, Sequence
from types import CodeType
from typing import Any, NamedTuple, Protocol

from .. import _trace
from .._errors import Aborted, ACCLError, DependencyError

log = logging.getLogger("aaccl")

_Future = asyncio.Future
_running_loop = asyncio._get_running_loop  # None outside asyncio (trio, a thread)
_ident = threading.get_ident
_UNKNOWN = object()  # a loop that does not say which thread runs it (not asyncio's own)
_now = time.perf_counter_ns

LOCK = threading.RLock()
"""The lock of every call's state, and of the books of the ranks that adopt them
(`aaccl.ACCL`). Held for a few stores at a time, never while calling out but for the
owner's `_on_done` (its books, and a trace's record). Reentrant: a collection that
runs inside a critical section (any allocation may start one) may finalize a task
whose await of a call gives up, and that takes it again (`_forget`)."""

Origin = tuple[CodeType, int, dict[str, Any]]
"""Where a call was made: the code, instruction offset and globals of the frame that
called the public method (the frame itself would keep its locals alive)."""

Waker = Callable[[], None] | asyncio.Future[None]
"""What wakes a waiter when a call finishes: a function to call (a thread's event, a
bridge's wake), or the future an asyncio task awaits (see `_wake`)."""


class CallArgs(NamedTuple):
    """The CCLO's 12 call arguments, in ACCL's order."""

    scenario: int
    count: int  # type: ignore[assignment]  # ACCL's name, though it hides tuple.count
    comm: int
    root_src_dst: int
    function: int
    tag: int
    arithcfg: int
    compression_flags: int
    stream_flags: int
    addr_0: int
    addr_1: int
    addr_2: int


class Poller(Protocol):
    """Progress a task waiting for a call can make itself on its device (the MPI
    fabric): see `aaccl.api._bridge.wait`."""

    def poll(self) -> object:
        """Make progress once, on the calling thread."""

    def park(self) -> None:
        """A task stopped polling before its call finished: the device's own thread
        takes over."""


class Owner(Protocol):
    """The rank that adopted a call (`aaccl.ACCL`): it says what the call's outcome
    means to the user, and how a task that cannot wait on asyncio's future waits."""

    _poller: Poller | None
    """Progress a waiting task makes itself (the MPI fabric), or None."""

    _loop: asyncio.AbstractEventLoop | None
    """The asyncio loop last found running its calls (`running_loop`), or None."""

    def _outcome(self, call: Call) -> BaseException | None:
        """The error the call raises (its return code, a failed host sync), or None;
        on the completing thread, before anyone can see the call done."""

    _wait: Callable[..., Any]
    """`aaccl.api._bridge.wait`, where asyncio's future cannot wait (trio, or a poller
    to poll): `_wait(call._register, poller, call._forget, call, loop)` is an awaitable
    that returns once `call` finished. (A function, not a method: no frame of the
    owner's between an await and its wait.)"""

    _wait_trio: Callable[..., Any]
    """`aaccl.api._bridge.wait_trio`: `_wait` where no asyncio loop runs (trio), as
    `_wait_trio(call._register, poller, call._forget)`."""

    _answered: Callable[..., bool]
    """`aaccl.api._bridge.answered`: poll once; True if that finished the call and the
    event loop need not turn yet (then the task awaiting it, on asyncio or trio, goes
    on with no wait at all: over MPI, the common small collective)."""


try:  # the running task of a loop, without a Python call (asyncio.current_task is one)
    from asyncio.tasks import _current_tasks  # type: ignore[attr-defined]
    asyncio_task = _current_tasks.get
except ImportError:  # pragma: no cover  (Pythons that keep it elsewhere)
    asyncio_task = asyncio.current_task


def asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop whose task runs here, or None: trio (trio as the guest of an
    asyncio loop too, whose steps run in the host loop's callbacks, outside its
    tasks), or a thread with no loop."""
    loop = _running_loop()
    return loop if loop is not None and asyncio_task(loop) is not None else None


def running_loop(owner: Owner) -> asyncio.AbstractEventLoop | None:
    """The asyncio loop whose task runs here, or None (`asyncio_loop`).

    asyncio's own lookup costs a system call (getpid, against a fork) every time;
    a call's path needs it two or three times. A loop of asyncio's runs in the
    thread whose ident it holds (`_thread_id`, None once it stopped), so the loop
    `owner` found last is checked against the thread instead, and only another
    loop (or none) is looked up. (The two callers on every small call's path,
    `ACCL._submit` and `Call.__await__`, make the first check in line.)"""
    loop = owner._loop
    if loop is not None and loop._thread_id == _ident():  # type: ignore[attr-defined]
        return loop
    loop = asyncio_loop()
    owner._loop = loop if isinstance(loop, asyncio.BaseEventLoop) else None
    return loop


def _wake(future: asyncio.Future[None]) -> None:
    """Resume a task of asyncio awaiting a call: in line on its loop's thread (no
    system call), through the loop's thread-safe entry from any other."""
    loop = future.get_loop()
    thread = getattr(loop, "_thread_id", _UNKNOWN)  # (`running_loop`)
    if thread == _ident() or thread is _UNKNOWN and _running_loop() is loop:
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


def root_cause(error: BaseException | None) -> BaseException | None:
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

    For devices (where it is also `DeviceCall`): `args` are the CCLO call's arguments,
    or None for host work (a job, a kernel run), which has no return code: it succeeds
    or ends with `error`. A device completes it (`complete`) from any thread, once.
    Its owner learns the outcome first, so a dependent submitted meanwhile finds the
    call's error in place; then whoever waits wakes and the device's callbacks
    (`add_done_callback`) run, on the completing thread: they must not block. A
    callback that raises is logged and the others run all the same; callbacks of a
    completion inside another's callbacks queue behind them instead of nesting, so no
    chain is too long for the stack.
    """

    __slots__ = ("args", "_callbacks", "_wakers", "retcode", "aborted", "error",
                 "started", "ended", "detail", "_settled", "_finished", "owner", "_error",
                 "_name", "_retrieved", "_used", "_given_up", "_deps", "_buffers", "_finish",
                 "_on_done", "_origin", "_seen", "__weakref__")

    _lock = LOCK  # (one for all: see `LOCK`)
    retcode: int
    aborted: bool  # a dependency failed, so the call never ran
    error: Exception | None  # the device could not run it, or host work raised
    detail: str | None  # what went wrong, in words, where the device knows
    # perf_counter_ns when the device began running it (0: not yet), and when its
    # outcome was set, before anyone was told
    started: int
    ended: int
    owner: Owner | None
    _callbacks: list[Callable[[Call], None]] | None
    _wakers: list[Waker] | None
    _settled: bool  # the device set its outcome
    _finished: bool  # ... and its owner has made it the call's error: it is done
    _error: BaseException | None  # what awaiting it raises
    # (the API's: set when a rank adopts the call, `ACCL._submit`; the flags start False)
    _name: str | tuple[str, int, int, str]
    _deps: tuple[Call, ...]
    _buffers: tuple[object, ...]
    # set with the owner, under `LOCK`, unless the call was settled already: a host
    # sync to run once it succeeded, and the owner's bookkeeping (run under `LOCK`
    # once it ended, before anyone wakes: it must not block, nor take a lock that is
    # ever held while `LOCK` is taken)
    _finish: Callable[[], None] | None
    _on_done: Callable[[Call], None] | None
    _origin: Origin | None
    _retrieved: bool
    _used: bool  # awaited, waited, exception() read or in a waitfor: see __del__
    _seen: bool  # its end seen by the code that made it, or it is in a waitfor
    _given_up: bool  # an await of it was cancelled before it finished

    def __init__(self, args: CallArgs | None, done: bool = False) -> None:
        """A call with these arguments, to be completed; `done`: it ended well the
        moment it was made (a nop with nothing to wait for), with nobody to tell.
        (Each field with a natural default is set once, in one line per default.)"""
        self.args = args
        self.owner = self.error = self.detail = self._error = None
        self._callbacks = self._wakers = self._finish = self._on_done = None
        self.aborted = self._retrieved = self._used = self._seen = self._given_up = False
        self.started = self.ended = _now() if done else 0
        self.retcode, self._settled, self._finished = 0, done, done

    # -- the device's side ------------------------------------------------------------

    def mark_started(self) -> None:
        """Devices call this when the call leaves their queue and begins to run."""
        self.started = _now()

    @property
    def failed(self) -> bool:
        """The device failed it, or it never ran."""
        return self.aborted or self.retcode != 0 or self.error is not None

    def complete(self, retcode: int = 0, aborted: bool = False,
                 error: Exception | None = None, detail: str | None = None) -> None:
        """The device's outcome (once, any thread): the owner makes it the call's
        error, then waiters wake and callbacks run."""
        lock = self._lock
        lock.acquire()  # (not `with`: its __exit__ costs a call on every call's path)
        try:
            if self._settled:
                raise RuntimeError("device call completed twice")
            # (`ended`: a trace's end, not when a callback ran)
            self.ended, self._settled, self.detail = _now(), True, detail
            # the owner works out a failure's error, or runs a host sync (`_finish`, set
            # with the owner), outside the lock; anything else (the common small call,
            # whose outcome the fields hold already: they start as success) is done at once
            if self._finish is not None or retcode or aborted or error is not None:
                self.retcode, self.aborted, self.error = retcode, aborted, error
                lock.release()
                try:
                    self._conclude()
                finally:
                    lock.acquire()
                self._finished = True
            else:
                self._finished, self._buffers, self._deps = True, (), ()
            wakers, callbacks, on_done = self._wakers, self._callbacks, self._on_done
            self._wakers = self._callbacks = self._on_done = None
            if on_done is not None:  # (the owner's books, in this critical section)
                try:
                    on_done(self)
                except Exception:  # its own failure: the waiters still wake
                    log.exception("aaccl: bookkeeping of a finished call failed")
        finally:
            lock.release()
        if wakers:
            ident = _ident()
            for wake in wakers:
                if not isinstance(wake, _Future):  # (any loop's future is one: uvloop's too)
                    wake()
                elif getattr(wake.get_loop(), "_thread_id", None) != ident:
                    _wake(wake)  # (another thread's loop, or one that does not say)
                elif not wake.done():  # (`_wake`'s common case in line: a task of our loop)
                    wake.set_result(None)
        if callbacks:
            _run_callbacks(self, callbacks)

    def add_done_callback(self, fn: Callable[[Call], None]) -> None:
        """Run `fn(self)` once the call is done, or right now if it is."""
        with self._lock:
            if not self._finished:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        fn(self)

    # -- the rank's side --------------------------------------------------------------

    def _ended(self, owner: Owner, finish: Callable[[], None] | None) -> None:
        """`owner` adopts a call that ended before it could (a nop, the last rank of a
        meeting, a refusal; see `ACCL._submit`): its outcome is worked out here, and
        no `on_done` runs. (Once settled a call stays so: no lock.)"""
        self.owner = owner
        if self.retcode or self.aborted or self.error is not None or finish is not None:
            self._finish = finish
            self._conclude()
        else:
            self._buffers = self._deps = ()

    def _conclude(self) -> None:
        """Work out the call's error from the device's outcome (its owner knows what
        it means) and run its host sync; never raises (nor hangs the device)."""
        owner = self.owner
        if owner is None:  # a device's own call: its outcome is all there is
            return
        try:
            self._error = owner._outcome(self)
        except Exception as exc:  # fail this call, never the device's thread
            error = ACCLError(f"{self.name} failed inside aaccl: {type(exc).__name__}")
            error.__cause__ = exc
            self._error = error
        self._buffers, self._finish = (), None

    @property
    def name(self) -> str:
        """The call as errors name it: "allreduce (rank 0, call 7)"."""
        try:
            name = self._name
        except AttributeError:  # a device's own call, never adopted
            return "a device call" if self.args is None else f"device call {self.args}"
        if type(name) is tuple:
            op, rank, number, where = name
            name = self._name = f"{op} (rank {rank}, call {number}{where})"
        return name  # type: ignore[return-value]

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
        if self.owner is None:
            raise TypeError(f"{self.name} is a device's own call, which raises nothing: "
                            "block() waits for it")
        self._used = True
        if not self.block(timeout):
            raise TimeoutError(f"{self.name} did not finish within {timeout} s")
        self._seen = True
        self._mark_retrieved()
        if self._error is not None:
            raise self._error

    def block(self, timeout: float | None = None) -> bool:
        """Block this thread until the call finished; False if `timeout` passed first.
        Raises nothing, and does not count as using the call (see the class): for
        devices, and for aaccl's own waits when a rank closes."""
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
        """Call `wake()` once the call finished; False (and never) if it has."""
        with self._lock:
            if self._finished:
                return False
            if self._wakers is None:
                self._wakers = [wake]
            else:
                self._wakers.append(wake)
            return True

    def _forget(self, wake: Waker) -> None:
        """A waiter gave up (cancelled, timed out): its `wake` goes."""
        with self._lock:
            wakers = self._wakers
            if wakers and wake in wakers:
                wakers.remove(wake)  # (a future compares by identity)

    def __await__(self) -> Generator[Any, None, None]:
        if self._finished and self.owner is not None:  # (the common small call: ended)
            self._used = self._seen = True
        else:
            self._used = True  # even if the await is cancelled: the caller did await it
            owner = self.owner
            if owner is None:
                raise TypeError("a device's own call is not awaitable")
            trace = _trace._active
            began = _now() if trace is not None else 0
            try:
                poller, loop = owner._poller, owner._loop  # (`running_loop`, its common case)
                if loop is None or loop._thread_id != _ident():  # type: ignore[attr-defined]
                    loop = _running_loop()  # (None on trio: no Python call to find that)
                    if loop is not None:  # asyncio's (kept for the next call), unless
                        loop = running_loop(owner)  # trio runs as its guest
                if poller is None and loop is not None:  # asyncio: the future wakes (`_wake`)
                    future = loop.create_future()
                    lock = self._lock
                    lock.acquire()  # (as in `complete`)
                    try:
                        waiting = not self._finished
                        if waiting:
                            if self._wakers is None:
                                self._wakers = [future]
                            else:
                                self._wakers.append(future)
                    finally:
                        lock.release()
                    if waiting:
                        try:
                            yield from future
                        except BaseException:
                            self._forget(future)
                            raise
                elif poller is None or not owner._answered(poller, self):
                    # trio, or a device to poll while waiting (MPI) that a first poll
                    # did not answer
                    if loop is None:
                        until_done = owner._wait_trio(self._register, poller, self._forget)
                    else:
                        until_done = owner._wait(self._register, poller, self._forget, self,
                                                 loop)
                    yield from until_done.__await__()
            except BaseException:
                self._given_up = not self._finished  # cancelled: see ACCL._settle
                raise
            finally:
                if trace is not None:
                    rank = getattr(owner, "rank", 0)
                    trace.add(rank, "host", f"await {self.name.split(' (')[0]}", began,
                              _now(), call=self.name)
            self._seen = True
        if self._error is not None:  # (a call that succeeded has no error to retrieve)
            self._mark_retrieved()
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
        state = "pending" if not self._finished else \
            "failed" if self._error is not None or (self.owner is None and self.failed) \
            else "done"
        return f"<Call {self.name} {state}>"

    def __del__(self) -> None:
        # One report per failure. A failure is logged unless someone retrieved it (itself or
        # through a dependent's DependencyError): the warning would add nothing. A call
        # that did not fail (or never finished) and was never used warns.
        try:
            if self._used and self._error is None or self.owner is None:
                return  # used and ended well, or a device's own call: nobody was to await it
        except AttributeError:  # __init__ never ran
            return
        error = self._error
        if error is not None:
            # an Aborted call's world ended early: that cause is reported, not each call;
            # nor is every call that failed because one did (a loop of 10,000 calls
            # after it): the first one collected says what failed, once for them all
            root = root_cause(error)
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


_local = threading.local()


def _run_callbacks(call: Call, callbacks: list[Callable[[Call], None]]) -> None:
    """Run completion callbacks iteratively: one thread, one loop at a time."""
    pending: deque[tuple[Call, list[Callable[[Call], None]]]] | None = \
        getattr(_local, "pending", None)
    if pending is not None:
        pending.append((call, callbacks))
        return
    pending = _local.pending = deque([(call, callbacks)])
    try:
        while pending:
            done, fns = pending.popleft()
            for fn in fns:
                try:
                    fn(done)
                except Exception:  # its own failure: the others still run (and wake)
                    log.exception("a completion callback of a device call raised")
    finally:
        _local.pending = None


def joined(whole: CallArgs, calls: Sequence[Call]) -> Call:
    """One call, with `whole`'s arguments, for several that together do its work: it
    completes once all of them have, failed as the first (in `calls`' order) that
    failed."""
    result = Call(whole)
    left = [len(calls)]
    lock = threading.Lock()

    def one_done(_: Call) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        result.started = min((c.started for c in calls if c.started), default=0)
        failed = next((c for c in calls if c.failed), None)
        if failed is None:
            result.complete()
        else:
            result.complete(retcode=failed.retcode, aborted=failed.aborted,
                            error=failed.error, detail=failed.detail)

    if not calls:
        result.complete()
    for call in calls:
        call.add_done_callback(one_done)
    return result
