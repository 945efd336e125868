"""Dependencies resolved on the host, for CCLOs that cannot take a wait list.

XRT 2.11 and later start kernel runs without wait lists, and ACCL's emulator has
no notion of one. For those devices a dependent call is started by the completion
callback of its last dependency: on the thread that completed it (a device's
completion thread), never on an event loop, so a whole chain still costs the user
one `await`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ._base import DeviceCall


def start_after(call: DeviceCall, waitfor: Sequence[DeviceCall],
                start: Callable[[DeviceCall], None]) -> DeviceCall:
    """Run `start(call)` once every call in `waitfor` succeeded.

    As soon as one of them fails (or never ran), `call` completes as aborted and
    `start` is never called. `start` runs on whichever thread completes the last
    dependency (or on this one, if none is pending), so it must hand the call off,
    not block.
    """
    _Countdown(call, waitfor, start)
    return call


class _Countdown:
    __slots__ = ("call", "start", "left", "lock")

    def __init__(self, call: DeviceCall, waitfor: Sequence[DeviceCall],
                 start: Callable[[DeviceCall], None]) -> None:
        self.call, self.start = call, start
        self.left = len(waitfor) + 1  # +1 until every callback is registered
        self.lock = threading.Lock()
        for dep in waitfor:
            dep.add_done_callback(self._dependency_done)
        self._dependency_done(None)

    def _dependency_done(self, dep: DeviceCall | None) -> None:
        with self.lock:
            if self.left == 0:
                return  # already aborted
            failed = dep is not None and dep.failed
            self.left = 0 if failed else self.left - 1
            if self.left and not failed:
                return
        if failed:
            self.call.complete(aborted=True)
        else:
            self.start(self.call)
