"""Which task issues a collective, and the race of two tasks on one message order.

Collectives are matched between ranks by their place in their communicator's
message order (the n-th on one rank meets the n-th on every other), and
communicators with the same members share one order, on a card as in the soft
CCLO (see docs/concepts/concurrency.md). Two tasks of a rank that issue
collectives on one order, neither waiting for the other, issue them in an order
that scheduling decides, and it can differ between ranks: results silently wrong,
or a deadlock on a card. A rank cannot see the other ranks' orders, so this is a
warning, not an error, and it sees what one rank can: a collective issued by one task
while the last one on its order, from another task, is still outstanding and is not
waited for (`waitfor`). Tasks whose calls happen not to overlap on any rank go
unseen (a sound rule would need to know which task of one rank is which of another).

The common case costs no Python call: `ACCL._submit` looks the order up and compares
the issuing task with the last one's, and that call's state; only an outstanding
call of another task comes here.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..devices._call import Owner, asyncio_task, running_loop
from ._call import warn_at

_running_loop = asyncio._get_running_loop  # (None outside asyncio: no exception to raise)

if TYPE_CHECKING:
    from ._call import Call


def current_task(owner: Owner) -> object:
    """The task issuing a call of `owner` where the asyncio loop it last ran on
    (`running_loop`) is not this thread's: another loop's task, trio's task, or else
    the thread itself (aaccl.compat: pyaccl's one thread per rank)."""
    if _running_loop() is not None:
        loop = running_loop(owner)  # (kept: the next call finds it in line)
        if loop is not None:
            return asyncio_task(loop)
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_task()
        except RuntimeError:  # not in trio's thread
            pass
    return threading.current_thread()


def task_name(task: object) -> str:
    if isinstance(task, asyncio.Task):
        return f"task {task.get_name()!r}"
    if isinstance(task, threading.Thread):
        return f"thread {task.name!r}"
    return f"task {getattr(task, 'name', task)!r}"


class Order:
    """One message order of a rank: the communicators with the same members share it.
    `task`: the task that issued the last collective on it (None: none yet), and
    `last`, a weak reference to that collective's Call (a dropped call has ended, and
    will never be seen to); `warned`: the race on it was reported.

    Another task's collective is ordered after the last one on every rank only if that
    one's task had seen it end (awaited it) or the new one waits for it: a call that
    already ended, unseen, may have ended on this rank before the other task issued and
    on another rank after (trio runs a batch of ready tasks in a random order), so it
    counts as outstanding until its end is seen (awaited, waited for, or the call is
    in a later call's `waitfor`).
    """

    __slots__ = ("comm_ids", "task", "last", "warned")

    def __init__(self, comm_id: int) -> None:
        self.comm_ids = [comm_id]
        self.task: object = None
        self.last: Callable[[], Call | None] = _nothing
        self.warned = False


def _nothing() -> None:
    """An order's `last` before its first collective."""


def waits_for(call: Call, target: Call) -> bool:
    """Whether `call` waits for `target`, through its `waitfor` and theirs."""
    seen: set[int] = set()
    todo = list(call._deps)
    while todo:
        dep = todo.pop()
        if dep is target:
            return True
        if id(dep) not in seen:
            seen.add(id(dep))
            todo.extend(dep._deps)
    return False


def unranked(name: Any) -> str:
    """A call's name without its rank ("allreduce (call 2)"): every rank of a world in
    one process that races says the same words, which warnings then show once."""
    if type(name) is str:
        return name
    op, _, number, where = name
    return f"{op} (call {number}{where})"


def check_race(order: Order, result: Call, before: Call, deps: tuple[Call, ...],
               task: object) -> None:
    """`result`, a collective `task` issued on `order`, follows a collective another
    task issued there that is still outstanding or not yet awaited: warn (once per
    order) unless `result` waits for it (`deps`: its `waitfor`)."""
    other = order.task
    if order.warned:
        return
    if any(d is before for d in deps) or any(waits_for(d, before) for d in deps):
        return  # chained: issued after it on every rank
    order.warned = True
    comms = sorted(order.comm_ids)
    mine, theirs = task_name(task), task_name(other)
    if theirs == mine:  # (anyio names tasks by their function)
        theirs = f"another {theirs}"
    shared = "" if len(comms) == 1 else (
        f"; communicators {', '.join(map(str, comms))} have the same members, so they "
        "share one message order")
    state = "has ended but is not awaited yet" if before._settled else "is still outstanding"
    warn_at(result._origin,  # (the user's line that made the call)
            f"{unranked(result._name)} was issued by {mine} while {unranked(before._name)}, "
            "issued on the "
            f"same message order by {theirs}, {state}{shared}. Collectives meet in the "
            "order each rank issues them on their communicator; two tasks issuing on one "
            "may interleave differently on different ranks, and then results are silently "
            "wrong (or, on a card, the ranks deadlock). Issue them from one task, chain "
            "them (waitfor=[...]), or give each task a communicator of different members; "
            "see docs/concepts/concurrency.md")
