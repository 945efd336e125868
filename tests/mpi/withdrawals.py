"""A send's deadline against its receive, step by step, on one MPI fabric (send to self).

    mpiexec -n 1 python tests/mpi/withdrawals.py SUITE

Drives `MPIFabric` directly (no device): the test holds the fabric's poll lock, so
that nothing that arrives is handled, to put the deadline exactly where it wants it.

Suites:
  taken    a receive takes the message, its acknowledgement not handled yet, when the
           send's deadline passes: the send must not fail (its receive got the data).
  pending  no receive: the send's deadline passes, the receiver agrees to drop the
           message, the send fails, and a receive posted after it never gets it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _harness import FAIL_MARK, OK_MARK, say
from mpi4py import MPI

from aaccl.soft.fabric import Message, MessageState, MPIFabric

KEY, TAG, DEQUEUE_TIMEOUT = ("p2p", (0,)), 5, 1 << 9


def in_engine(fabric: MPIFabric, fn: Callable[[], Any]) -> Any:
    """Run `fn` in the fabric's engine context; its result."""
    done, box = threading.Event(), []

    def run() -> None:
        box.append(fn())
        done.set()

    fabric.engine.post(run)
    assert done.wait(5), "the engine did not run it"
    return box[0]


def until(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():  # the progress thread moves the messages meanwhile
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.001)


def send(fabric: MPIFabric, payload: np.ndarray) -> Any:
    msg = Message(0, KEY, 0, TAG, payload, eager=False)
    awaited = in_engine(fabric, lambda: fabric.post(0, msg, DEQUEUE_TIMEOUT))
    assert awaited is not None, "a rendezvous send is done at once"
    return awaited


def taken(fabric: MPIFabric) -> int:
    payload = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    awaited = send(fabric, payload)
    recv = in_engine(fabric, lambda: fabric.inbox.post(KEY, 0, TAG))
    until("the receive matches and has the payload", lambda: recv.done)
    with fabric._poll_lock:  # nothing arriving is handled: the acknowledgement waits
        msg = in_engine(fabric, lambda: fabric.inbox.take(recv))
        withdrawn_now = in_engine(fabric, awaited.expire)
    data = np.array(fabric.inbox.data(msg))
    in_engine(fabric, lambda: fabric.inbox.release(msg))
    assert np.array_equal(data, payload), "the receive got other data"
    assert not withdrawn_now, "the send failed at its deadline, its message taken"
    until("the send ends", lambda: awaited.done)
    assert awaited.value is not MessageState.WITHDRAWN, \
        "the send failed, and its receive got the data"
    return 3


def pending(fabric: MPIFabric) -> int:
    awaited = send(fabric, np.ones(1 << 16, np.uint8))
    until("the header arrives", lambda: bool(fabric._incoming))
    withdrawn_now = in_engine(fabric, awaited.expire)
    until("the send ends", lambda: withdrawn_now or awaited.done)
    assert withdrawn_now or awaited.value is MessageState.WITHDRAWN, \
        "the send succeeded, nobody received it"
    recv = in_engine(fabric, lambda: fabric.inbox.post(KEY, 0, TAG))
    assert not recv.done and recv.value is None, "a receive got a withdrawn message"
    in_engine(fabric, lambda: fabric.inbox.cancel(KEY, 0, recv))
    assert not fabric._incoming and not fabric._waiting and not fabric._held, \
        "records of the withdrawn message remain"
    return 3


def main() -> None:
    name = sys.argv[1]
    fabric = MPIFabric(MPI.COMM_WORLD, 16, 1024)
    try:
        checks = {"taken": taken, "pending": pending}[name](fabric)
    except BaseException as error:  # noqa: BLE001 - report it, fail the process
        say(f"{FAIL_MARK} rank=0 suite={name}: {type(error).__name__}: {error}", sys.stderr)
        sys.exit(1)
    finally:
        fabric.close(2.0)
    say(f"{OK_MARK} suite={name} rank=0 size=1 checks={checks} seconds=0")


if __name__ == "__main__":
    main()
