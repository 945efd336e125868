"""Run a test's body once per rank of a world and learn how each rank ended, failing
fast: the first rank that fails aborts every call still outstanding and cancels the
ranks still running, as `aaccl.run` does, but every rank's end is kept for the report.

In one process the ranks are tasks of one task group. Under mpiexec this process runs
its own rank; it tells its peers when it leaves (so their calls waiting for it fail at
once), stops its body when a peer left after failing, and then every process gathers
every rank's outcome, so all of them report the same.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from .._errors import Aborted, ACCLError, DependencyError
from ..api import ACCL, open_world
from ..api._world import gather_every_rank
from ._plan import Plan
from ._report import ABORTED, CANCELLED, FAILED, LOST, PASSED, SKIPPED, Outcome, one_line, where

Body = Callable[[ACCL, list[ACCL]], Awaitable[Any]]
"""The test body for one rank: (this rank's ACCL, the ACCLs of this process)."""
Describe = Callable[[BaseException], str]
"""Formats a rank's own error (its traceback) as the report shows it."""

LEFT_PASSED = "its test passed"  # why a rank whose body returned leaves the world
LEFT_SKIPPED = "it skipped the test"
WATCH_EVERY = 0.02  # seconds between looks, under MPI, at whether a peer left failing
SHOWN_CALLS = 3


async def run_world(body: Body, plan: Plan, describe: Describe) -> list[Outcome]:
    """Open the plan's world, run `body` on each of this process's ranks, and return
    every rank's outcome in rank order (under MPI, gathered from every process)."""
    async with open_world(plan.world_size, **plan.options) as accls:
        mine = await run_ranks(accls, body, describe, mpi=plan.mpi)
        if not plan.mpi:
            return mine
        return await _gather(mine[0], accls[0], plan.world_size,
                             float(plan.options.get("timeout", 10.0)))


async def run_ranks(accls: list[ACCL], body: Body, describe: Describe, *,
                    mpi: bool = False) -> list[Outcome]:
    """`body` once per ACCL of `accls`, as tasks of one task group; how each ended."""
    ended: dict[int, Outcome] = {}
    failure: list[str] = []  # why the world failed, once it has
    calls_then: dict[int, tuple[str, ...]] = {}  # each rank's calls when it failed

    async with anyio.create_task_group() as tasks:
        def fail(reason: str) -> None:
            if failure:
                return
            failure.append(reason)
            for accl in accls:
                calls_then[accl.rank] = accl._unfinished()
                accl._abort(reason)
            if mpi:  # the peers' calls waiting for this rank fail now
                accls[0]._depart(reason)
            tasks.cancel_scope.cancel()

        async def rank(accl: ACCL) -> None:
            r, returned = accl.rank, False
            try:
                await body(accl, accls)
                returned = True
                await accl._settle()  # what it sent may still be needed
            except BaseException as exc:
                if isinstance(exc, anyio.get_cancelled_exc_class()) and failure:
                    place = where(exc.__traceback__) if not returned else \
                        "the end of its test, waiting for its calls"
                    ended[r] = Outcome(r, CANCELLED, where=place,
                                       calls=_merged(calls_then.get(r, ()), accl._unfinished()))
                    raise
                state = _state(exc)
                if state is None:  # interrupted, pytest.exit, or a cancel from outside
                    raise
                if state == SKIPPED:
                    ended[r] = Outcome(r, SKIPPED, error=str(exc))
                    accl._depart(LEFT_SKIPPED)
                    return
                ended[r] = Outcome(r, state, one_line(exc),
                                   _described(describe, exc) if state == FAILED else "",
                                   where(exc.__traceback__) if state == ABORTED else "",
                                   _merged(calls_then.get(r, ()), accl._unfinished()))
                fail(f"rank {r} failed: {one_line(exc)}")
            else:
                ended[r] = Outcome(r, PASSED)
                accl._depart(LEFT_PASSED)

        if mpi:
            tasks.start_soon(_watch_peers, accls[0], ended, fail)
        for accl in accls:
            tasks.start_soon(rank, accl)
    if failure:  # calls made since (and not awaited) must not hold the world's closing
        for accl in accls:
            accl._abort(failure[0])
    return [ended[accl.rank] for accl in accls]


def _described(describe: Describe, exc: BaseException) -> str:
    """`describe(exc)`, or Python's own traceback if that fails."""
    try:
        return describe(exc)
    except Exception:
        return "".join(traceback.format_exception(exc))


def _state(exc: BaseException) -> str | None:
    """FAILED, ABORTED (a call ended by another rank's failure) or SKIPPED; None for
    what must go on up (KeyboardInterrupt, pytest.exit, a cancellation)."""
    if isinstance(exc, pytest.skip.Exception):
        return SKIPPED
    if isinstance(exc, pytest.fail.Exception):
        return FAILED
    if not isinstance(exc, Exception):
        return None
    if isinstance(exc, Aborted) or (isinstance(exc, DependencyError)
                                    and isinstance(exc.__cause__, Aborted)):
        return ABORTED
    return FAILED


def _merged(then: tuple[str, ...], now: tuple[str, ...]) -> tuple[str, ...]:
    """A rank's calls when the world failed (since aborted) and those outstanding as
    it ended, in submission order: the first few, and how many more."""
    def number(name: str) -> int:
        found = re.search(r"call (\d+)", name)
        return int(found.group(1)) if found else 0

    names = sorted(dict.fromkeys(then + now), key=number)
    if len(names) > SHOWN_CALLS:
        names[SHOWN_CALLS:] = [f"{len(names) - SHOWN_CALLS} more"]
    return tuple(names)


async def _watch_peers(accl: ACCL, ended: dict[int, Outcome],
                       fail: Callable[[str], None]) -> None:
    """Under MPI: end this process's rank as soon as a peer left the world failing, or
    the launcher said a process died, even if the rank waits for something that is
    not a call (a call waiting for that peer fails by itself)."""
    from ..soft import MPIFabric

    while accl.rank not in ended:
        failed = {peer: why for peer, why in accl._peers_gone().items()
                  if why not in (LEFT_PASSED, LEFT_SKIPPED)}
        died = MPIFabric.ended()
        if failed or died:
            peer = min(failed) if failed else None
            fail(f"rank {peer} left the world: {failed[peer]}" if peer is not None
                 else f"a process of the job ended: {died}")
            return
        await anyio.sleep(WATCH_EVERY)


async def _gather(mine: Outcome, accl: ACCL, size: int, timeout: float) -> list[Outcome]:
    """Every rank's outcome, from every process of the MPI job, however long their
    bodies take. A process that ended without reporting (the launcher or the MPI
    fabric says so; on other devices, one that did not report within `timeout`)
    counts as LOST."""
    def why_not(ended: str | None) -> str:
        return (f"a process of the job ended: {ended}" if ended else
                f"did not finish within {timeout} s of rank {mine.rank}")

    missing = accl._peers_missing()
    try:
        every = await gather_every_rank(mine, None if missing else timeout, why_not, missing)
    except ACCLError as exc:
        return [mine if r == mine.rank else Outcome(r, LOST, error=str(exc))
                for r in range(size)]
    return sorted(every, key=lambda o: o.rank)
