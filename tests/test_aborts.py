"""No abort is lost (in process): a world cancelled, or a rank raising, at any point
of a loop of allreduces ends every rank's calls at once with `Aborted` naming the
cause, never at the timeout. Allreduces on both sides of OFFLOAD_BYTES: the steps
of large ones run as data jobs, which an abort cannot withdraw; the call must end
as soon as its job is over, not go on to wait for peers that have stopped."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable

import anyio
import pytest

import aaccl
from aaccl import ReduceFunction
from aaccl.soft._calls import OFFLOAD_BYTES
from aaccl.soft._engine import Wait

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

pytestmark = pytest.mark.anyio

SUM = ReduceFunction.SUM
TIMEOUT = 5.0
SURFACES = 1.0
"""Every trial's world ends this long after its abort, far below TIMEOUT."""

SIZES = {  # float32 elements of one allreduce, on `ranks` ranks
    "met in shared memory": lambda ranks: 256,
    "steps in line": lambda ranks: OFFLOAD_BYTES // 16,  # each rank's chunk is smaller still
    "steps as data jobs": lambda ranks: ranks * OFFLOAD_BYTES // 4,  # 1 MiB chunks
}


async def raising_trial(rng: random.Random, ranks: int, count: int, backend: str) -> None:
    """A random rank raises after a random number of allreduces: `run` raises its
    error soon after, and every rank that saw an error saw `Aborted` naming it."""
    culprit, stop = rng.randrange(ranks), rng.randrange(6)
    raised: list[float] = []
    seen: list[BaseException] = []

    async def main(accl: aaccl.ACCL) -> None:
        a, b = accl.allocate(count), accl.allocate(count)
        a[:] = accl.rank + 1
        for i in range(1000):
            if accl.rank == culprit and i == stop:
                raised.append(time.monotonic())
                raise KeyError("boom")
            try:
                await accl.allreduce(a, b, count, SUM)
            except BaseException as error:
                seen.append(error)
                raise
            assert b[0] == ranks * (ranks + 1) // 2

    with pytest.raises(KeyError, match="boom"):
        await anyio.to_thread.run_sync(
            lambda: aaccl.run(main, ranks, timeout=TIMEOUT, backend=backend))
    took = time.monotonic() - raised[0]
    assert took < SURFACES, f"rank {culprit} raised at allreduce {stop}: run took {took:.2f} s"
    for error in seen:
        if isinstance(error, aaccl.ACCLError):
            assert isinstance(error, aaccl.Aborted), error
            assert f"rank {culprit} raised KeyError" in str(error)


async def cancelling_trial(rng: random.Random, ranks: int, count: int) -> None:
    """A random rank cancels the world (from outside `open_world`) after a random
    number of allreduces: the world closes soon after, and each rank's last call
    either completed right or failed with `Aborted` saying the world was cancelled."""
    culprit, stop = rng.randrange(ranks), rng.randrange(6)
    last: list[aaccl.Call] = []
    cancelled: list[float] = []
    with anyio.CancelScope() as scope:
        async with aaccl.open_world(ranks, timeout=TIMEOUT) as accls:
            async def rank(accl: aaccl.ACCL) -> None:
                a, b = accl.allocate(count), accl.allocate(count)
                a[:] = accl.rank + 1
                for i in range(1000):
                    if accl.rank == culprit and i == stop:
                        cancelled.append(time.monotonic())
                        scope.cancel()
                    call = accl.allreduce(a, b, count, SUM)
                    last.append(call)
                    await call

            async with anyio.create_task_group() as tasks:
                for accl in accls:
                    tasks.start_soon(rank, accl)
    took = time.monotonic() - cancelled[0]
    assert took < SURFACES, f"rank {culprit} cancelled at allreduce {stop}: took {took:.2f} s"
    for call in last:
        assert call.done()
        try:
            await call
        except aaccl.ACCLError as error:
            assert isinstance(error, aaccl.Aborted), error
            assert "its world was cancelled" in str(error)


async def trials(n: int, seed: int, ranks: int, count: int, backend: str) -> None:
    rng = random.Random(seed)
    for k in range(n):
        if k % 2:
            await cancelling_trial(rng, ranks, count)
        else:
            await raising_trial(rng, ranks, count, backend)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("ranks", [2, 3, 4])
async def test_a_cancelled_world_or_a_raising_rank_ends_every_call_at_once(
        ranks: int, size: str, anyio_backend: str) -> None:
    await trials(4, ranks * 10 + list(SIZES).index(size), ranks, SIZES[size](ranks),
                 anyio_backend)


@pytest.mark.slow
async def test_no_abort_is_lost_in_100_trials(anyio_backend: str) -> None:
    """The case as reported: 4 ranks, 4 MiB allreduces, 100 trials."""
    await trials(100, 1234, 4, (4 << 20) // 4, anyio_backend)


async def test_a_call_made_after_its_world_was_aborted_fails_at_once() -> None:
    """Nobody would ever end it otherwise: its peers' calls are aborted too."""
    async with aaccl.open_world(2, timeout=TIMEOUT) as (a, b):
        x = a.allocate(1024)
        a._abort("the test gave up")
        b._abort("the test gave up")
        start = time.monotonic()
        with pytest.raises(aaccl.Aborted, match="the test gave up"):
            await a.allreduce(x, x, x.size, SUM)
        with pytest.raises(aaccl.Aborted, match="the test gave up"):
            await a.send(x, 4, 1)
        assert time.monotonic() - start < SURFACES


async def test_an_abort_during_a_data_job_ends_the_call_when_the_job_is_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The world is aborted while the first data job of a large allreduce runs:
    every rank's call ends with `Aborted`, none runs a further step (before, they
    went on, and waited for peers that had stopped or finished without them)."""
    async with aaccl.open_world(3, timeout=TIMEOUT) as accls:
        engine = accls[0]._driver.device.engine
        offload = engine.offload
        aborted = []

        def abort_during_the_job(job: Callable[[], None]) -> Wait:
            if not aborted:  # (engine context: the abort comes before the job's end)
                aborted.append(True)
                for accl in accls:
                    accl._abort("stopped during a data job")
            return offload(job)

        monkeypatch.setattr(engine, "offload", abort_during_the_job)
        count = 3 * OFFLOAD_BYTES // 4
        bufs = [a.allocate(count) for a in accls]
        start = time.monotonic()
        calls = [a.allreduce(x, x, count, SUM) for a, x in zip(accls, bufs)]
        for call in calls:
            with pytest.raises(aaccl.Aborted, match="stopped during a data job"):
                await call
        assert aborted and time.monotonic() - start < SURFACES


async def test_a_root_waiting_for_a_rank_that_left_to_take_its_data_fails_at_once(
        anyio_backend: str) -> None:
    """A large bcast's root waits for each peer to read its data from its memory; a
    peer whose program returned never will (before: the root waited the timeout)."""
    count = OFFLOAD_BYTES // 4  # far more than the rx buffers hold: read in place
    errors: dict[int, aaccl.ACCLError] = {}

    async def main(accl: aaccl.ACCL) -> None:
        if accl.rank == 1:
            return
        buf = accl.allocate(count)
        try:
            await accl.bcast(buf, count, 0)
        except aaccl.ACCLError as error:  # (or cancelled once rank 0 raised)
            errors[accl.rank] = error
            raise

    start = time.monotonic()
    with pytest.raises((aaccl.Aborted, ExceptionGroup)):
        await anyio.to_thread.run_sync(
            lambda: aaccl.run(main, 3, timeout=TIMEOUT, backend=anyio_backend))
    assert time.monotonic() - start < SURFACES
    assert "bcast (rank 0, call 1) was aborted: rank 1 left the world: its program returned" \
        in str(errors[0])
    if 2 in errors:  # (unless it took its data before the root learned)
        assert isinstance(errors[2], aaccl.Aborted)
        assert "rank 1 left the world" in str(errors[2])


INTERRUPTED = """
import anyio, aaccl

async def world():
    async with aaccl.open_world(2, timeout=30) as (a, b):
        pending = b.recv(b.allocate(4), 4, 0)  # nobody sends: the close must abort it

        def interrupt():  # as Ctrl-C landing while the engine runs on the loop's thread
            raise KeyboardInterrupt

        a._driver.device.engine.post(interrupt)
    await pending

anyio.run(world, backend=BACKEND)
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_keyboard_interrupt_inside_the_engine_reaches_the_program_and_the_world_closes(
        backend: str) -> None:
    """(In a process of its own: before, the engine stayed wedged and the world's
    close waited forever.)"""
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED.replace("BACKEND", repr(backend))],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == "KeyboardInterrupt"


@pytest.mark.parametrize("anyio_backend", ["trio"])
@pytest.mark.anyio
async def test_a_ctrl_c_on_trio_waits_while_the_engine_runs_events() -> None:
    """trio raises KeyboardInterrupt wherever the event loop's thread is, unless the
    code is marked protected: one raised inside a soft CCLO event left a call
    half-stepped, which no abort ended, and its world's closing hung (1 Ctrl-C in 5
    of `aaccl launch -n 3` on trio). Events, and polls of the MPI fabric, are
    protected once a world is open: the Ctrl-C comes at the next checkpoint."""
    import trio

    async with aaccl.open_world(2) as (a, b):
        seen: list[bool] = []
        a._driver.device.engine.post(lambda: seen.append(trio.lowlevel.currently_ki_protected()))
        assert seen == [True]
        assert not trio.lowlevel.currently_ki_protected()  # (the task itself is not)
        buf = a.allocate(4)
        await anyio.to_thread.run_sync(lambda: None)  # a checkpoint: still usable
        calls = [accl.allreduce(buf if accl is a else b.allocate(4), buf if accl is a
                                else b.allocate(4), 4, ReduceFunction.SUM) for accl in (a, b)]
        for call in calls:
            await call
