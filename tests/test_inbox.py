"""The inbox's collective steps (aaccl/soft/fabric/_inbox.py) on their own: what it
keeps of a message that comes for a collective whose call here has ended.

Over MPI, on a sub-communicator, ranks whose calls of a collective do not match may
each only send (each names another the gather's root): the message can come after
its receiver's call succeeded. It must neither stay in the rx buffers nor leave a
record: nothing reads it any more (tests/mpi/lane.py's `roots` runs the same
through the MPI fabric).
"""

from __future__ import annotations

import numpy as np

from aaccl._constants import Scenario
from aaccl.soft.fabric import Inbox, Message, MessageState, RxPool

COMM = (1, 0)  # a sub-communicator's key: its members' sessions
GATHER = int(Scenario.GATHER)


def fingerprint(root: int) -> tuple:
    return (GATHER, 4, "<f4", "<f4", root, None, 2)


def inbox_with_rx(nbufs: int = 2) -> Inbox:
    inbox = Inbox()
    inbox.rx = RxPool([np.zeros(64, np.uint8) for _ in range(nbufs)], 64,
                      lambda slot, state, msg: None)
    return inbox


def step(seq: int, root: int, eager: bool = True) -> tuple[Message, list[str]]:
    """Rank 1's gather step for collective `seq`, and what the inbox tells its sender."""
    msg = Message(1, ("coll", COMM, seq, GATHER, 0), seq, 0, np.ones(16, np.uint8),
                  eager=eager)
    msg.fp = fingerprint(root)
    told: list[str] = []
    msg.on_done = lambda: told.append("done")
    return msg, told


def fail(code: int, why: str, notified: bool) -> None:
    raise AssertionError(f"no call of ours runs: {why}")


def test_a_step_for_a_call_that_ended_here_is_dropped_at_once() -> None:
    inbox = inbox_with_rx()
    assert inbox.join(("coll", COMM, 0), 0, fingerprint(1), fail) is None
    inbox.leave(("coll", COMM, 0))  # our call only sent, and succeeded
    msg, told = step(0, root=0)  # rank 1 named the other root: it sent to us
    assert inbox.deliver(msg)  # the send is done ...
    assert told == ["done"] and msg.state == MessageState.DONE  # ... and acknowledged
    assert inbox.rx is not None and len(inbox.rx.free) == 2  # no rx buffer taken
    assert not inbox._steps and not inbox._seen  # no record
    notice = Message(1, ("abort", COMM, 0), 0, 0, None, eager=True)
    notice.notice = (1, "rank 1's gather failed")
    assert inbox.deliver(notice)
    assert not inbox._failed  # no call of it will come here any more


def test_a_rendezvous_step_for_a_call_that_ended_here_is_refused() -> None:
    inbox = inbox_with_rx()
    inbox.join(("coll", COMM, 0), 0, fingerprint(1), fail)
    inbox.leave(("coll", COMM, 0))
    msg, told = step(0, root=0, eager=False)
    assert not inbox.deliver(msg)  # its sender's wait fails (never taken)
    assert msg.state == MessageState.WITHDRAWN and told == []
    assert not inbox._steps and not inbox._seen


def test_steps_of_calls_still_to_come_or_running_are_kept() -> None:
    inbox = inbox_with_rx(nbufs=4)
    inbox.join(("coll", COMM, 0), 0, fingerprint(1), fail)
    inbox.leave(("coll", COMM, 0))
    early, _ = step(1, root=1)  # our call of collective 1 comes later
    assert inbox.deliver(early) and inbox.rx is not None and len(inbox.rx.free) == 3
    assert inbox.join(("coll", COMM, 1), 0, fingerprint(1), fail) is None
    assert inbox.expect_step(1, early.key).value is early
    running, _ = step(2, root=1)
    inbox.join(("coll", COMM, 2), 0, fingerprint(1), fail)  # our call runs
    assert inbox.deliver(running)
    assert inbox.expect_step(1, running.key).value is running
