"""Every call and the books of the ranks that adopt them share one lock
(`aaccl.devices._call.LOCK`): adopting a call and booking it is one critical section,
and so are completing it and forgetting it."""

from __future__ import annotations

import asyncio

from aaccl.api._call import outcome
from aaccl.devices import DeviceCall
from aaccl.devices._call import LOCK


class _Rank:
    """What adopts the calls here: no books, the outcome a rank works out."""

    _poller = _loop = None
    _outcome = staticmethod(outcome)

    @staticmethod
    def _forget(call: DeviceCall) -> None:
        pass


def test_an_await_given_up_inside_a_critical_section_takes_the_lock_again() -> None:
    """A collection may run inside any critical section (an allocation starts it) and
    finalize a task awaiting a call: its await gives up, and forgets its waker under
    the same lock, on the same thread. That must not deadlock."""

    async def main() -> None:
        call = DeviceCall(None)  # (adopted as `ACCL._submit` does, with nothing to book)
        call._name, call._origin, call._buffers, call._deps = "call", None, (), ()
        call.owner, call._finish, call._on_done = _Rank(), None, None

        async def awaiting() -> None:
            await call

        coro = awaiting()
        coro.send(None)  # suspended on its future, registered among the call's wakers
        assert call._wakers
        with LOCK:
            coro.close()  # as a collection of the abandoned task would
        assert not call._wakers and call._given_up
        call.complete()
        assert call.done()

    asyncio.run(main())
