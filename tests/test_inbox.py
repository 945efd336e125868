"""The inbox's collective steps (aaccl/soft/fabric/_inbox.py) on their own: what it
keeps of, and tells about, a message that comes for a collective whose call here has
ended, and a root's announcement of its call.

Over MPI, on a sub-communicator, ranks whose calls of a collective do not match may
each only send (each names another the gather's root): the message can come after
its receiver's call succeeded. It must neither stay in the rx buffers nor leave a
record (nothing reads it any more), and it proves the calls differ. A gather's root
sends nothing, so it announces its call. tests/test_communicators.py's program of
gathers with different roots runs the same through both fabrics.
"""

from __future__ import annotations

from collections.abc import Callable

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


def join(inbox: Inbox, seq: int, fp: tuple,
         fail: Callable[[int, str, bool], None]) -> tuple[int, str, bool] | None:
    """Our call of collective `seq` is admitted (in order, as the device does), and
    joins it."""
    assert inbox.admit(COMM) == seq
    return inbox.join(("coll", COMM, seq), _Member(fp, fail))


class _Member:
    """Our call of a collective, as the inbox sees it (`fabric._inbox.Member`)."""

    session = 0

    def __init__(self, fp: tuple, fail: Callable[[int, str, bool], None]) -> None:
        self.fp, self.peer_failed = fp, fail


def fail(code: int, why: str, notified: bool) -> None:
    raise AssertionError(f"no call of ours runs: {why}")


def test_a_step_for_a_call_that_ended_here_is_dropped_at_once() -> None:
    inbox = inbox_with_rx()
    assert join(inbox, 0, fingerprint(1), fail) is None
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
    join(inbox, 0, fingerprint(1), fail)
    inbox.leave(("coll", COMM, 0))
    msg, told = step(0, root=0, eager=False)
    assert not inbox.deliver(msg)  # its sender's wait fails (never taken)
    assert msg.state == MessageState.WITHDRAWN and told == []
    assert not inbox._steps and not inbox._seen


def test_steps_of_calls_still_to_come_or_running_are_kept() -> None:
    inbox = inbox_with_rx(nbufs=4)
    join(inbox, 0, fingerprint(1), fail)
    inbox.leave(("coll", COMM, 0))
    early, _ = step(1, root=1)  # our call of collective 1 comes later
    assert inbox.deliver(early) and inbox.rx is not None and len(inbox.rx.free) == 3
    assert join(inbox, 1, fingerprint(1), fail) is None
    assert inbox.expect_step(1, early.key).value is early
    running, _ = step(2, root=1)
    join(inbox, 2, fingerprint(1), fail)  # our call runs
    assert inbox.deliver(running)
    assert inbox.expect_step(1, running.key).value is running


def test_a_stray_step_is_reported_unless_our_call_failed() -> None:
    """A step for a call of ours that succeeded proves the calls differ: the device
    tells the members (`on_stray`); one for a call that failed here does not (it told
    them already)."""
    inbox = inbox_with_rx()
    strays: list[Message] = []
    inbox.on_stray = strays.append
    for seq in (0, 1):
        join(inbox, seq, fingerprint(1), fail)
        inbox.leave(("coll", COMM, seq))
    inbox.abandon_steps(("coll", COMM, 1))  # our call 1 failed
    first, _ = step(0, root=0)
    second, _ = step(1, root=0)
    assert inbox.deliver(first) and inbox.deliver(second)
    assert strays == [first]


def test_a_step_for_a_call_that_failed_as_it_joined_is_no_stray() -> None:
    """Our call failed at once (a peer told us its call failed before ours came):
    the peers' steps for it are rightful, not proof of a mismatch."""
    inbox = inbox_with_rx()
    strays: list[Message] = []
    inbox.on_stray = strays.append
    notice = Message(1, ("abort", COMM, 0), 0, 0, None, eager=True)
    notice.notice = (1, "rank 1's gather failed")
    assert inbox.deliver(notice)
    assert join(inbox, 0, fingerprint(1), fail) is not None
    msg, told = step(0, root=1)
    assert inbox.deliver(msg) and told == ["done"]
    assert strays == [] and not inbox._steps and not inbox._failed


def announcement(seq: int, root: int) -> tuple[Message, list[str]]:
    """Rank 1 takes itself for the root of gather `seq`: what it tells us."""
    msg = Message(1, ("fp", COMM, seq), seq, 0, None, eager=True)
    msg.fp = fingerprint(root)
    told: list[str] = []
    msg.on_taken = lambda: told.append("taken")
    return msg, told


def test_a_root_s_announcement_is_checked_and_keeps_nothing() -> None:
    inbox = inbox_with_rx()
    failures: list[str] = []
    running = announcement(0, root=1)[0]  # our call runs and names rank 0 (us) the root
    join(inbox, 0, fingerprint(0),
               lambda code, why, notified: failures.append(why))
    assert inbox.deliver(running)
    assert failures == ["rank 0 called gather(count=4, float32, root=0); "
                        "rank 1 called gather(count=4, float32, root=1)"]
    early, told = announcement(1, root=1)  # before our call: it fails when it comes
    assert inbox.deliver(early) and told == ["taken"]
    assert join(inbox, 1, fingerprint(0), fail) is not None
    agreeing, _ = announcement(2, root=1)
    join(inbox, 2, fingerprint(1), fail)  # the same call: no failure
    assert inbox.deliver(agreeing)
    inbox.leave(("coll", COMM, 0))
    inbox.leave(("coll", COMM, 2))
    late, _ = announcement(0, root=1)  # for a call that ended here: nothing to check
    assert inbox.deliver(late)
    assert not inbox._steps and not inbox._seen and not inbox._failed
