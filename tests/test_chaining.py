"""Calls as awaitables and as dependency graphs (`waitfor`) on the soft CCLO.

Chains and diamonds that cost one await, gathering calls with asyncio and trio,
failures that propagate as DependencyError without running the dependents,
cancellation that leaves the ranks usable, the "failed and nobody awaited it" log,
and the lifetime of an ACCL.
"""

from __future__ import annotations

import gc
import logging

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import CCLOError, DependencyError, ErrorCode, ReduceFunction
from conftest import on_device, run_ranks, wait_until

pytestmark = pytest.mark.anyio


def filled(accl: aaccl.ACCL, values: np.ndarray) -> aaccl.Buffer:
    buf = accl.allocate(values.shape, values.dtype)
    buf[:] = values
    return buf


# -- chains and graphs -------------------------------------------------------------------

@pytest.mark.aaccl(world_size=4, timeout=5)
async def test_copy_allreduce_bcast_chain_costs_one_await(accl: aaccl.ACCL) -> None:
    n, root = 100, 2
    inputs = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(accl.size)]
    src = filled(accl, inputs[accl.rank])
    staged, reduced = accl.allocate(n), accl.allocate(n)
    copied = accl.copy(src, staged, n, to_fpga=True)
    summed = accl.allreduce(staged, reduced, n, ReduceFunction.SUM, from_fpga=True,
                            to_fpga=True, waitfor=[copied])
    last = accl.bcast(reduced, n, root, from_fpga=True, waitfor=[summed])
    await last  # the only await of the chain
    assert copied.done() and summed.done()
    np.testing.assert_array_equal(staged, 0)  # to_fpga: the host copy was never written
    np.testing.assert_array_equal(on_device(staged), inputs[accl.rank])
    np.testing.assert_array_equal(reduced, sum(inputs))


@pytest.mark.aaccl(world_size=3, timeout=5)
async def test_chain_where_only_the_root_computes_before_the_bcast(accl: aaccl.ACCL) -> None:
    n, root = 33, 1
    src = filled(accl, np.full(n, accl.rank + 1, np.int64))
    reduced, out = accl.allocate(n, np.int64), accl.allocate(n, np.int64)
    summed = accl.allreduce(src, reduced, n, ReduceFunction.SUM, to_fpga=True)
    if accl.rank == root:  # out = reduced + reduced, on the device
        before = [accl.combine(n, ReduceFunction.SUM, reduced, reduced, out,
                               val1_from_fpga=True, val2_from_fpga=True, to_fpga=True,
                               waitfor=[summed])]
    else:
        before = [summed]
    await accl.bcast(out, n, root, from_fpga=True, waitfor=before)
    np.testing.assert_array_equal(out, 2 * (1 + 2 + 3))


@pytest.mark.aaccl(world_size=1, timeout=5)
async def test_diamond_on_one_rank(accl: aaccl.ACCL) -> None:
    n = 64
    data = np.linspace(-4, 4, n).astype(np.float64)
    src, ones = filled(accl, data), filled(accl, np.ones(n))
    x, y, z, w = (accl.allocate(n, np.float64) for _ in range(4))
    top = accl.copy(src, x, n, to_fpga=True)
    left = accl.combine(n, ReduceFunction.SUM, x, x, y, val1_from_fpga=True,
                        val2_from_fpga=True, to_fpga=True, waitfor=[top])
    right = accl.combine(n, ReduceFunction.MAX, x, ones, z, val1_from_fpga=True,
                         to_fpga=True, waitfor=[top])
    bottom = accl.combine(n, ReduceFunction.SUM, y, z, w, val1_from_fpga=True,
                          val2_from_fpga=True, waitfor=[left, right])
    await bottom
    np.testing.assert_array_equal(w, 2 * data + np.maximum(data, 1))
    assert all(c.done() for c in (top, left, right))


@pytest.mark.aaccl(world_size=4, timeout=5)
async def test_diamond_of_collectives_across_ranks(accl: aaccl.ACCL) -> None:
    n, size = 16, accl.size
    src = filled(accl, np.arange(n, dtype=np.int32) + 100 * accl.rank)
    x = accl.allocate(n, np.int32)
    summed, gathered = accl.allocate(n, np.int32), accl.allocate(n * size, np.int32)
    top = accl.copy(src, x, n, to_fpga=True)
    left = accl.allreduce(x, summed, n, ReduceFunction.SUM, from_fpga=True, waitfor=[top])
    right = accl.allgather(x, gathered, n, from_fpga=True, waitfor=[top])
    await accl.nop(waitfor=[left, right])
    assert left.done() and right.done()  # results are on the host once dependents run
    inputs = [np.arange(n, dtype=np.int32) + 100 * r for r in range(size)]
    np.testing.assert_array_equal(summed, sum(inputs))
    np.testing.assert_array_equal(gathered, np.concatenate(inputs))


@pytest.mark.aaccl(world_size=4, timeout=5)
async def test_token_ring_as_one_graph_per_rank(accl: aaccl.ACCL) -> None:
    """recv -> combine(+1) -> send around a ring, all on the device: one await per rank."""
    size, n = accl.size, 8
    token, one = accl.allocate(n, np.int64), filled(accl, np.ones(n, np.int64))
    left, right = (accl.rank - 1) % size, (accl.rank + 1) % size
    if accl.rank == 0:
        sent = accl.send(token, n, right, tag=3)
        last = accl.recv(token, n, left, tag=3, waitfor=[sent])
    else:
        got = accl.recv(token, n, left, tag=3, to_fpga=True)
        bumped = accl.combine(n, ReduceFunction.SUM, token, one, token, val1_from_fpga=True,
                              to_fpga=True, waitfor=[got])
        last = accl.send(token, n, right, tag=3, from_fpga=True, waitfor=[bumped])
    await last
    if accl.rank == 0:
        np.testing.assert_array_equal(token, size - 1)


@pytest.mark.aaccl(world_size=1, timeout=5)
async def test_long_chain_costs_one_await(accl: aaccl.ACCL) -> None:
    n, steps = 32, 200
    acc, one = accl.allocate(n, np.int64), filled(accl, np.ones(n, np.int64))
    last = accl.copy(one, acc, n, to_fpga=True)
    for i in range(steps):
        last = accl.combine(n, ReduceFunction.SUM, acc, one, acc, val1_from_fpga=True,
                            to_fpga=i < steps - 1, waitfor=[last])
    await last
    np.testing.assert_array_equal(acc, steps + 1)



async def recv_dependent_allreduce_then_an_independent_one(accl: aaccl.ACCL, count: int,
                                                           hazard: bool) -> None:
    """Rank 0: `first` (an allreduce) waits for a receive, `second` does not; rank 1
    sends only once its `second` is done. Correct only if `second` may overtake
    `first` on rank 0, as it may without in_order (issue 27): over MPI too, where the
    world's collectives go through one lane (tests/mpi/lane.py runs this). `hazard`:
    the dependencies come from the memory each call touches instead of `waitfor`."""
    assert accl.size == 2
    rank = accl.rank
    x = filled(accl, np.full(count, rank + 1, np.float32))
    p = filled(accl, np.full(count, 10 * (rank + 1), np.float32))
    y, q = accl.allocate(count, np.float32), accl.allocate(count, np.float32)
    if rank == 0:
        got = accl.recv(x, count, 1, tag=7, to_fpga=True)  # rank 1's q: 30
        first = accl.allreduce(x, y, count, ReduceFunction.SUM, from_fpga=True,
                               waitfor=[] if hazard else [got])
        second = accl.allreduce(p, q, count, ReduceFunction.SUM)
        calls = [got, first, second]
    else:
        first = accl.allreduce(x, y, count, ReduceFunction.SUM)
        second = accl.allreduce(p, q, count, ReduceFunction.SUM, to_fpga=True)
        calls = [first, second, accl.send(q, count, 0, tag=7, from_fpga=True,
                                          waitfor=[] if hazard else [second])]
    for call in calls:
        await call
    np.testing.assert_array_equal(on_device(q), 30)
    np.testing.assert_array_equal(y, 30 + 2)


@pytest.mark.aaccl(world_size=2, timeout=5)
@pytest.mark.parametrize("hazard", [False, True])
@pytest.mark.parametrize("count", [4, 5000])
async def test_a_collective_waiting_for_a_recv_lets_later_ones_run(
        accl: aaccl.ACCL, count: int, hazard: bool) -> None:
    await recv_dependent_allreduce_then_an_independent_one(accl, count, hazard)


async def test_waitfor_a_finished_call_runs_at_once() -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        src, dst = filled(accl, np.arange(5, dtype=np.float32)), accl.allocate(5)
        first = accl.nop()
        await first
        await accl.copy(src, dst, 5, waitfor=[first, first])
        np.testing.assert_array_equal(dst, np.arange(5))


async def test_waitfor_is_checked() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        other = b.nop()
        with pytest.raises(ValueError):
            a.nop(waitfor=[other])  # a call waits only for calls of its own rank
        with pytest.raises(TypeError):
            a.nop(waitfor=[object()])
        await other


# -- awaiting with asyncio and trio --------------------------------------------------------

@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_gather_calls_and_coroutines() -> None:
    import asyncio

    n = 256
    async with aaccl.open_world(4, timeout=5) as accls:
        srcs = [filled(a, np.full(n, a.rank + 1, np.float32)) for a in accls]
        dsts = [a.allocate(n) for a in accls]
        ring = [a.allocate(n) for a in accls]

        async def compute() -> float:
            await asyncio.sleep(0)
            return float(np.sum(np.arange(10)))

        calls = [a.allreduce(s, d, n, ReduceFunction.SUM) for a, s, d in zip(accls, srcs, dsts)]
        calls += [a.send(s, n, (a.rank + 1) % 4, tag=7) for a, s in zip(accls, srcs)]
        calls += [a.recv(r, n, (a.rank - 1) % 4, tag=7) for a, r in zip(accls, ring)]
        results = await asyncio.gather(*calls, compute(), calls[0])  # a call may repeat
        assert results == [None] * len(calls) + [45.0, None]
        for a, d, r in zip(accls, dsts, ring):
            np.testing.assert_array_equal(d, 1 + 2 + 3 + 4)
            np.testing.assert_array_equal(r, (a.rank - 1) % 4 + 1)


async def test_wait_async_runs_a_call_as_a_task(anyio_backend: str) -> None:
    """create_task / start_soon take coroutines, not awaitables: wait_async is one,
    and it raises the call's error as await does."""
    async with aaccl.open_world(2, timeout=0.3) as (a, b):
        src, dst = filled(a, np.arange(8, dtype=np.float32)), b.allocate(8)
        send, recv = a.send(src, 8, 1), b.recv(dst, 8, 0)
        lonely = b.recv(b.allocate(4), 4, 0, tag=9)
        if anyio_backend == "asyncio":
            import asyncio

            with pytest.raises(TypeError):
                asyncio.create_task(send)  # type: ignore[arg-type]
            tasks = [asyncio.create_task(c.wait_async()) for c in (send, recv)]
            await asyncio.gather(*tasks)
            with pytest.raises(CCLOError, match="RECEIVE_TIMEOUT"):
                await asyncio.create_task(lonely.wait_async())
        else:
            async with anyio.create_task_group() as tg:
                tg.start_soon(send.wait_async)
                tg.start_soon(recv.wait_async)
            with pytest.raises(CCLOError, match="RECEIVE_TIMEOUT"):
                await lonely.wait_async()
        np.testing.assert_array_equal(dst, np.arange(8))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_gather_returns_a_failed_call_s_error() -> None:
    import asyncio

    async with aaccl.open_world(2, timeout=0.2) as (a, b):
        lonely = b.recv(b.allocate(4), 4, 0)
        fine = a.nop()
        results = await asyncio.gather(fine, lonely, return_exceptions=True)
        assert results[0] is None
        assert isinstance(results[1], CCLOError)
        assert results[1].code & ErrorCode.RECEIVE_TIMEOUT_ERROR


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_wait_for_times_out_and_the_call_completes_later() -> None:
    import asyncio

    async with aaccl.open_world(2, timeout=5) as (a, b):
        dst = b.allocate(4)
        r = b.recv(dst, 4, 0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.ensure_future(r), 0.05)
        assert not r.done()
        await a.send(filled(a, np.arange(4, dtype=np.float32)), 4, 1)
        await r
        np.testing.assert_array_equal(dst, np.arange(4))


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_nursery_awaits_many_calls() -> None:
    import trio

    n, size = 128, 3
    async with aaccl.open_world(size, timeout=5) as accls:
        srcs = [filled(a, np.arange(n, dtype=np.int32) * (a.rank + 1)) for a in accls]
        dsts = [a.allocate(n, np.int32) for a in accls]
        gathered = [a.allocate(n * size, np.int32) for a in accls]
        calls = [a.allreduce(s, d, n, ReduceFunction.MAX) for a, s, d in zip(accls, srcs, dsts)]
        calls += [a.allgather(s, g, n) for a, s, g in zip(accls, srcs, gathered)]
        calls += [a.nop() for a in accls for _ in range(20)]
        finished = []

        async def wait(call: aaccl.Call) -> None:
            await call
            finished.append(call)

        async with trio.open_nursery() as nursery:
            for call in calls:
                nursery.start_soon(wait, call)
            nursery.start_soon(wait, calls[0])  # two tasks await the same call
        assert len(finished) == len(calls) + 1
        expected = np.concatenate([np.arange(n, dtype=np.int32) * (r + 1) for r in range(size)])
        for d, g in zip(dsts, gathered):
            np.testing.assert_array_equal(d, np.arange(n) * size)
            np.testing.assert_array_equal(g, expected)


async def test_a_call_awaited_by_several_tasks() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        dst = b.allocate(6)
        r = b.recv(dst, 6, 0)
        woken = []

        async def waiter(i: int) -> None:
            await r
            woken.append(i)

        async with anyio.create_task_group() as tasks:
            for i in range(5):
                tasks.start_soon(waiter, i)
            await a.send(filled(a, np.full(6, 2.5, np.float32)), 6, 1)
        assert sorted(woken) == list(range(5))
        np.testing.assert_array_equal(dst, 2.5)


async def test_done_reports_completion() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        dst = b.allocate(3)
        r = b.recv(dst, 3, 0)
        assert not r.done()  # nothing was sent: it cannot have completed
        s = a.send(filled(a, np.ones(3, np.float32)), 3, 1)
        await r
        assert r.done()
        await s
        assert s.done()
        await r  # awaiting a finished call again returns at once
        nop = a.nop()
        await nop
        assert nop.done()


# -- failures and dependencies ---------------------------------------------------------------

# (its chain reads on the host what the failing calls were to write: on purpose)
@pytest.mark.filterwarnings("ignore:this .* reads its input from host memory:RuntimeWarning")
async def test_failed_call_makes_dependents_fail_without_running() -> None:
    async with aaccl.open_world(2, timeout=0.2) as (a, b):
        n = 10
        lost = b.allocate(n)
        src = filled(b, np.full(n, 99, np.float32))
        mid, end = filled(b, np.full(n, 7, np.float32)), filled(b, np.full(n, 8, np.float32))
        mid.sync_to_device()
        end.sync_to_device()
        failing = b.recv(lost, n, 0)  # rank 0 never sends
        dependent = b.copy(src, mid, n, waitfor=[failing])
        second = b.copy(mid, end, n, waitfor=[dependent])
        also = b.nop(waitfor=[dependent, second])

        with pytest.raises(CCLOError) as original:
            await failing
        assert original.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
        with pytest.raises(DependencyError) as dep:
            await dependent
        assert dep.value.__cause__ is original.value
        assert not isinstance(dep.value, CCLOError)
        assert isinstance(dep.value, aaccl.ACCLError)
        with pytest.raises(DependencyError) as dep2:
            await second
        cause = dep2.value.__cause__
        while isinstance(cause, DependencyError):  # the chain leads back to the original
            cause = cause.__cause__
        assert cause is original.value
        with pytest.raises(DependencyError):
            await also
        # neither copy ran: device and host still hold what they held
        np.testing.assert_array_equal(mid, 7)
        np.testing.assert_array_equal(end, 8)
        np.testing.assert_array_equal(on_device(mid), 7)
        np.testing.assert_array_equal(on_device(end), 8)

        # the rank stays usable
        out = b.allocate(n)
        await b.copy(src, out, n)
        np.testing.assert_array_equal(out, 99)


async def test_dependent_send_and_recv_that_never_run_keep_the_message_order() -> None:
    async with aaccl.open_world(2, timeout=0.2) as (a, b):
        n = 4
        a_fails = a.recv(a.allocate(n), n, 0, tag=1)  # a receive from itself: nothing comes
        b_fails = b.recv(b.allocate(n), n, 1, tag=1)
        never_sent = a.send(filled(a, np.full(n, 1, np.float32)), n, 1, waitfor=[a_fails])
        never_dst = filled(b, np.full(n, -1, np.float32))
        never_recv = b.recv(never_dst, n, 0, waitfor=[b_fails])  # posted before the next one
        sent = a.send(filled(a, np.full(n, 2, np.float32)), n, 1)  # waits behind never_sent
        for call in (a_fails, b_fails):
            with pytest.raises(CCLOError):
                await call
        for call in (never_sent, never_recv):
            with pytest.raises(DependencyError):
                await call
        await sent
        # posted after never_recv gave up its place (before that, never_recv came first)
        dst = b.allocate(n)
        await b.recv(dst, n, 0)
        np.testing.assert_array_equal(dst, 2)  # not the send that never ran
        np.testing.assert_array_equal(never_dst, -1)
        np.testing.assert_array_equal(on_device(never_dst), 0)  # never synced, never written


async def test_dependency_failure_across_a_collective() -> None:
    async with aaccl.open_world(2, timeout=0.2) as (a, b):
        n = 8
        failing = a.recv(a.allocate(n), n, 1)  # rank 1 never sends
        srcs = [filled(x, np.full(n, x.rank + 1, np.float32)) for x in (a, b)]
        dsts = [x.allocate(n) for x in (a, b)]
        skipped = a.allreduce(srcs[0], dsts[0], n, ReduceFunction.SUM, waitfor=[failing])
        with pytest.raises(CCLOError):
            await failing
        with pytest.raises(DependencyError):
            await skipped
        # the peer's call of the collective learns at once, not at its timeout
        with anyio.fail_after(5):
            with pytest.raises(aaccl.Aborted, match="rank 0's allreduce.*did not run"):
                await b.allreduce(srcs[1], dsts[1], n, ReduceFunction.SUM)
        np.testing.assert_array_equal(dsts[0], 0)


# -- cancellation ----------------------------------------------------------------------------

async def test_cancelled_waiter_leaves_the_recv_running() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        n = 16
        dst = filled(b, np.full(n, -1, np.float32))
        r = b.recv(dst, n, 0)
        scopes: list[anyio.CancelScope] = []
        waiting = anyio.Event()

        async def waiter() -> None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                waiting.set()
                await r
                raise AssertionError("the receive cannot complete before the send")

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(waiter)
            await waiting.wait()
            scopes[0].cancel()
        assert scopes[0].cancelled_caught
        assert not r.done()
        np.testing.assert_array_equal(dst, -1)

        # the peer sends only now; the device still finishes the receive into `dst`
        data = np.arange(n, dtype=np.float32)
        await a.send(filled(a, data), n, 1)
        await b.nop(waitfor=[r])
        assert r.done()
        np.testing.assert_array_equal(dst, data)
        await r  # and awaiting it again succeeds

        # both ranks stay usable
        later = b.allocate(n)
        s = a.send(filled(a, data * 2), n, 1)
        await b.recv(later, n, 0)
        await s
        np.testing.assert_array_equal(later, data * 2)


async def test_move_on_after_a_rendezvous_send() -> None:
    async with aaccl.open_world(2, nbufs=4, bufsize=64, timeout=5) as (a, b):
        n = 1000  # far above the eager threshold
        data = np.arange(n, dtype=np.int32)
        s = a.send(filled(a, data), n, 1)  # the source buffer lives only in the call
        with anyio.move_on_after(0.05) as scope:
            await s
        assert scope.cancelled_caught and not s.done()
        dst = b.allocate(n, np.int32)
        await b.recv(dst, n, 0)
        await s
        np.testing.assert_array_equal(dst, data)


async def test_cancelling_ranks_inside_a_collective() -> None:
    size, n = 4, 50
    async with aaccl.open_world(size, timeout=5) as accls:
        srcs = [filled(a, np.full(n, a.rank + 1, np.float32)) for a in accls]
        dsts = [a.allocate(n) for a in accls]
        calls: dict[int, aaccl.Call] = {}
        entered = 0
        all_entered = anyio.Event()

        async def rank(accl: aaccl.ACCL) -> None:
            nonlocal entered
            calls[accl.rank] = accl.allreduce(srcs[accl.rank], dsts[accl.rank], n,
                                              ReduceFunction.SUM)
            entered += 1
            if entered == size - 1:
                all_entered.set()
            await calls[accl.rank]
            raise AssertionError("the allreduce cannot complete without the last rank")

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:
                for accl in accls[:-1]:
                    tasks.start_soon(rank, accl)
                await all_entered.wait()
                scope.cancel()
        assert scope.cancelled_caught
        assert not any(c.done() for c in calls.values())

        last = accls[-1]
        await last.allreduce(srcs[-1], dsts[-1], n, ReduceFunction.SUM)
        for accl in accls[:-1]:
            await accl.nop(waitfor=[calls[accl.rank]])
        for d in dsts:
            np.testing.assert_array_equal(d, 1 + 2 + 3 + 4)

        # and a second allreduce on every rank works
        async def again(accl: aaccl.ACCL):
            out = accl.allocate(n)
            await accl.allreduce(srcs[accl.rank], out, n, ReduceFunction.MAX)
            return np.array(out)

        for got in await run_ranks(accls, again):
            np.testing.assert_array_equal(got, size)


# -- errors nobody awaited -----------------------------------------------------------------------

def _failure_logs(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "aaccl" and r.levelno >= logging.ERROR and name in r.getMessage()]


async def test_unawaited_failed_call_is_logged_when_collected(caplog) -> None:
    async with aaccl.open_world(2, timeout=0.2) as (a, b):
        call = b.recv(b.allocate(4), 4, 0)
        name = call.name
        await wait_until(call.done)
        with caplog.at_level(logging.ERROR, logger="aaccl"):
            del call
            gc.collect()
        records = _failure_logs(caplog, name)
        assert len(records) == 1
        assert "RECEIVE_TIMEOUT_ERROR" in records[0].getMessage()


async def test_awaited_failed_call_is_not_logged(caplog) -> None:
    async with aaccl.open_world(2, timeout=0.2) as (a, b):
        call = b.recv(b.allocate(4), 4, 0)
        name = call.name
        with caplog.at_level(logging.ERROR, logger="aaccl"):
            with pytest.raises(CCLOError) as failed:
                await call
            del call, failed
            gc.collect()
        assert _failure_logs(caplog, name) == []


async def test_awaiting_a_dependent_reports_the_original_failure(caplog) -> None:
    async with aaccl.open_world(2, timeout=0.2) as (a, b):
        failing = b.recv(b.allocate(4), 4, 0)
        dependent = b.nop(waitfor=[failing])
        names = failing.name, dependent.name
        with caplog.at_level(logging.ERROR, logger="aaccl"):
            with pytest.raises(DependencyError) as failed:
                await dependent
            assert isinstance(failed.value.__cause__, CCLOError)
            del failing, dependent, failed
            gc.collect()
        for name in names:
            assert _failure_logs(caplog, name) == []


@pytest.mark.filterwarnings("ignore:Call .* was never awaited:RuntimeWarning")
async def test_successful_unawaited_call_is_not_logged(caplog) -> None:
    async with aaccl.open_world(1, timeout=5) as (accl,):
        call = accl.nop()
        name = call.name
        await wait_until(call.done)
        with caplog.at_level(logging.ERROR, logger="aaccl"):
            del call
            gc.collect()
        assert _failure_logs(caplog, name) == []


# -- lifetime of an ACCL ------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Call .* was never awaited:RuntimeWarning")
async def test_closing_a_world_waits_for_outstanding_calls() -> None:
    n = 3000
    data = np.arange(n, dtype=np.float32)
    async with aaccl.open_world(2, nbufs=4, bufsize=256, timeout=0.3) as (a, b):
        dst = b.allocate(n)
        sent = a.send(filled(a, data), n, 1)  # rendezvous: done only once received
        got = b.recv(dst, n, 0)
        lonely = a.recv(a.allocate(4), 4, 1)  # nobody sends: fails after the timeout
        chain = a.nop()
        for _ in range(50):
            chain = a.nop(waitfor=[chain])
        # leave without awaiting anything
    assert sent.done() and got.done() and lonely.done() and chain.done()
    np.testing.assert_array_equal(dst, data)
    with pytest.raises(CCLOError):
        await lonely  # awaiting a finished call needs no device
    await got


@pytest.mark.filterwarnings("ignore:Call .* was never awaited:RuntimeWarning")
async def test_leaving_an_accl_context_waits_and_closes_it() -> None:
    async with aaccl.open_world(2, timeout=0.3) as (a, b):
        async with b:
            lonely = b.recv(b.allocate(4), 4, 0)
        assert lonely.done()
        with pytest.raises(CCLOError):
            await lonely
        with pytest.raises(RuntimeError):
            b.nop()
        await a.nop()  # the other rank is still open


async def test_calls_on_a_closed_accl_raise() -> None:
    async with aaccl.open_world(2, timeout=5) as accls:
        a, b = accls
        src, dst = a.allocate(4), a.allocate(4)
        done = a.nop()
        await done
    for accl in accls:
        with pytest.raises(RuntimeError, match="closed"):
            accl.nop()
        with pytest.raises(RuntimeError):
            accl.allocate(4)
        with pytest.raises(RuntimeError):
            accl.split_communicator([0, 1])
        with pytest.raises(RuntimeError):
            accl.barrier()
    with pytest.raises(RuntimeError):
        a.copy(src, dst, 4)
    with pytest.raises(RuntimeError):
        a.send(src, 4, 1)
    with pytest.raises(RuntimeError):
        a.allreduce(src, dst, 4, ReduceFunction.SUM)
    await done  # a finished call stays awaitable
    await a.aclose()  # closing twice is harmless


@pytest.mark.anyio
async def test_blocking_wait_takes_its_timeout_as_threading_does_and_checks_it() -> None:
    """`Call.wait(timeout)` from a thread: inf waits as None (threading's wait raised
    OverflowError for it, and left its waker on the call), nan and non-numbers are
    refused before waiting; a timeout that passes leaves no waker behind."""
    async with aaccl.open_world(2, timeout=5) as (a, b):
        recv = a.recv(a.allocate(8), 8, 1, tag=3)

        def waits() -> list[str]:
            seen = []
            for timeout in (0.0, -1, float("nan"), "1", True):
                try:
                    recv.wait(timeout)  # type: ignore[arg-type]
                except (TimeoutError, ValueError, TypeError) as exc:
                    seen.append(type(exc).__name__)
            return seen

        assert await anyio.to_thread.run_sync(waits) == \
            ["TimeoutError", "TimeoutError", "ValueError", "TypeError", "TypeError"]
        assert not recv._wakers
        send = b.send(b.allocate(8), 8, 0, tag=3)
        await anyio.to_thread.run_sync(recv.wait, float("inf"))  # until it is done
        await send
        assert recv.done() and not recv._wakers
