"""Worlds of ranks: `open_world` builds them, `run` runs one function on each."""

from __future__ import annotations

import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio

from .. import _exchmem as xm
from ..driver import Driver
from ..soft import InProcessFabric, SoftDevice
from ._accl import ACCL

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

T = TypeVar("T")
DEVICES = ("soft",)


def _check_options(world_size: Any, device: str, nbufs: Any, bufsize: Any, timeout: Any) -> None:
    for name, value in (("world_size", world_size), ("nbufs", nbufs), ("bufsize", bufsize)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: available here: {', '.join(DEVICES)}")
    if bufsize % 8:
        raise ValueError(f"bufsize must be a multiple of 8 bytes, got {bufsize}")
    if not isinstance(timeout, (int, float)) or not 0 < timeout < 4000 or math.isnan(timeout):
        raise ValueError(f"timeout must be a positive number of seconds below 4000, got {timeout!r}")


@asynccontextmanager
async def open_world(world_size: int, *, device: str = "soft", nbufs: int = 16,
                     bufsize: int = 1024, timeout: float = 10.0) -> AsyncIterator[list[ACCL]]:
    """Open `world_size` ranks in this process; yield their ACCLs in rank order.

    `nbufs` eager rx buffers of `bufsize` bytes each per rank; `timeout` seconds a
    call waits for a peer before it fails with RECEIVE_TIMEOUT_ERROR. On exit, waits
    for every outstanding call and releases the devices.
    """
    _check_options(world_size, device, nbufs, bufsize, timeout)
    fabric = InProcessFabric(world_size)
    ranks = [xm.RankRecord(ip=xm.ip_encode("127.0.0.1"), port=17000 + r, session=r,
                           max_segment_size=bufsize) for r in range(world_size)]
    accls: list[ACCL] = []
    try:
        for rank in range(world_size):
            dev = SoftDevice(rank, fabric.port(rank), fabric.inboxes[rank])
            driver = Driver(dev, rank, ranks, nbufs=nbufs, bufsize=bufsize, timeout=timeout)
            try:
                accls.append(await ACCL.open(driver))
            except BaseException:
                dev.close()
                raise
        yield accls
    finally:
        with anyio.CancelScope(shield=True):
            for accl in accls:
                await accl.aclose()


def run(main: Callable[[ACCL], Awaitable[T]], world_size: int, *, backend: str = "asyncio",
        **options: Any) -> list[T]:
    """Run `main(accl)` for every rank, as tasks of one event loop; return their
    results in rank order.

    `backend` is "asyncio" or "trio"; `options` go to `open_world`. If ranks fail,
    the others are cancelled; a single failure is raised as itself, several as an
    exception group.
    """

    async def world() -> list[T]:
        results: list[Any] = [None] * world_size

        async def rank(accl: ACCL) -> None:
            results[accl.rank] = await main(accl)

        async with open_world(world_size, **options) as accls:
            async with anyio.create_task_group() as tasks:
                for accl in accls:
                    tasks.start_soon(rank, accl)
        return results

    try:
        return anyio.run(world, backend=backend)
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
