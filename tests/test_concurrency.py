"""Collectives from several tasks of a rank (docs/concepts/concurrency.md).

Two tasks issuing collectives on one message order race: the test of that race
passes only if every repetition gives the right results or warns, never silently
wrong. The safe patterns are the docs page's own examples, run from the page, with
any warning an error.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import ReduceFunction

BACKENDS = ["asyncio", "trio"]
PAGE = Path(__file__).resolve().parents[1] / "docs" / "concepts" / "concurrency.md"
RACE = "message order"  # in the race's warning


def page_examples() -> dict[str, Any]:
    """The page's Python examples, by function name."""
    namespace: dict[str, Any] = {"aaccl": aaccl, "anyio": anyio, "np": np,
                                 "ReduceFunction": ReduceFunction}
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S):
        exec(compile(block, str(PAGE), "exec"), namespace)
    return {name: fn for name, fn in namespace.items() if name in ("one_task", "chained",
                                                                   "halves")}


def run_quietly(main: Any, size: int, **options: Any) -> list[Any]:
    """aaccl.run with the race's warning an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*" + RACE, category=RuntimeWarning)
        return aaccl.run(main, size, **options)


def run_recording(main: Any, size: int, **options: Any) -> tuple[list[Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = aaccl.run(main, size, **options)
    return results, [str(w.message) for w in caught if RACE in str(w.message)]


def two_tasks(duplicate: bool, rounds: int) -> Any:
    """Issue 29's program: per round, two tasks each allreduce their own buffer on the
    world (or, `duplicate`, one of them on a duplicate of it), started in an order
    that differs between ranks. Returns whether every result was right."""

    async def main(accl: aaccl.ACCL) -> bool:
        other = accl.split_communicator(list(range(accl.size))) if duplicate else 0
        bufs = [accl.allocate(8), accl.allocate(8)]
        right: list[bool] = []

        async def work(task: int, comm: int, round_: int) -> None:
            buf = bufs[task]
            buf[:] = accl.rank + 100 * task + 1000 * round_
            await accl.allreduce(buf, buf, 8, ReduceFunction.SUM, comm_id=comm)
            want = sum(r + 100 * task + 1000 * round_ for r in range(accl.size))
            right.append(bool((buf == want).all()))

        for round_ in range(rounds):
            tasks = [(0, 0), (1, other)]
            if (accl.rank + round_) % 2:
                tasks.reverse()
            async with anyio.create_task_group() as group:
                for task, comm in tasks:
                    group.start_soon(work, task, comm, round_)
        return all(right)

    return main


@pytest.mark.parametrize("duplicate", [False, True], ids=["same", "duplicate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_tasks_on_one_order_are_warned_or_right_never_silently_wrong(
        backend: str, duplicate: bool) -> None:
    for rounds in (1, 3) * 10:
        results, raced = run_recording(two_tasks(duplicate, rounds), 4, backend=backend)
        assert all(results) or raced, "silently wrong: no rank warned"
        for message in raced:
            assert "was issued by task" in message and (
                "is still outstanding" in message or "has ended but is not awaited" in message)
            if duplicate and "communicator 1" in message:
                assert "communicators 0, 1 have the same members" in message
        assert len(raced) <= 4  # once per rank and message order


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("in_order", [False, True])
@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize("example", ["one_task", "chained", "halves"])
def test_the_pages_safe_patterns_are_right_and_quiet(example: str, size: int, in_order: bool,
                                                      backend: str) -> None:
    main = page_examples()[example]
    run_quietly(main, size, backend=backend, in_order=in_order, timeout=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_task_gathering_unawaited_calls_on_duplicates_is_quiet(backend: str) -> None:
    async def main(accl: aaccl.ACCL) -> list[float]:
        twin = accl.split_communicator(list(range(accl.size)))
        bufs = [accl.allocate(8) for _ in range(6)]
        calls = []
        for i, buf in enumerate(bufs):
            buf[:] = i
            calls.append(accl.allreduce(buf, buf, 8, ReduceFunction.SUM,
                                        comm_id=twin if i % 2 else 0))
        for call in calls:
            await call
        return [float(buf[0]) for buf in bufs]

    for size in (1, 4):
        assert run_quietly(main, size, backend=backend) == [[i * size for i in range(6)]] * size


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_task_per_communicator_of_different_members_is_right(backend: str) -> None:
    """Not on a card: the world and a reversed world are two orders here; each rank
    starts them in its own order."""

    async def main(accl: aaccl.ACCL) -> tuple[float, float]:
        reverse = accl.split_communicator(list(range(accl.size))[::-1])
        a, b = accl.allocate(8), accl.allocate(8)
        a[:], b[:] = 1, 2

        async def on(buf: aaccl.Buffer, comm: int) -> None:
            for _ in range(3):
                await accl.allreduce(buf, buf, 8, ReduceFunction.SUM, comm_id=comm)

        jobs = [(a, 0), (b, reverse)][::1 if accl.rank % 2 else -1]
        async with anyio.create_task_group() as group:
            for buf, comm in jobs:
                group.start_soon(on, buf, comm)
        return float(a[0]), float(b[0])

    assert run_quietly(main, 4, backend=backend) == [(64.0, 128.0)] * 4


def test_an_in_order_timeout_names_the_call_the_peers_call_waits_behind() -> None:
    """The same program on a card (in_order): each rank's first call waits for the
    peer's, which is queued behind the peer's first call."""

    async def main(accl: aaccl.ACCL) -> list[str]:
        reverse = accl.split_communicator([1, 0])
        a, b = accl.allocate(8), accl.allocate(8)
        issue = [lambda: accl.allreduce(a, a, 8, ReduceFunction.SUM),
                 lambda: accl.allreduce(b, b, 8, ReduceFunction.SUM, comm_id=reverse)]
        calls = [start() for start in issue[::-1 if accl.rank else 1]]
        errors = []
        for call in calls:
            try:
                await call
            except aaccl.CCLOError as error:
                errors.append(str(error))
        return errors

    errors = run_quietly(main, 2, in_order=True, timeout=0.3)
    first = errors[0][0]
    assert "RECEIVE_TIMEOUT_ERROR" in first and "waited 0.3 s for rank 1" in first
    assert ("rank 1 has its call of it, allreduce(count=8, float32, SUM), queued behind "
            "allreduce(count=8, float32, SUM) on the communicator of ranks 1, 0") in first
    assert "in_order" in first
