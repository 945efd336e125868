"""Scale of a program is not a fault; a wait never outlives its reason (issue 12).

Chains of 20,000 calls cost one await, whatever the calls are; a chain behind a
failing head fails call by call with DependencyError, and timeouts keep working
afterwards in every world; thousands of outstanding sends and collectives all
complete, in MPI's matching order; a kernel that raises fails only its call; and
`in_order=True` makes a program that needs two calls of a rank to overlap time
out, as it would hang on ACCL's firmware.

Every wait here is bounded: short world timeouts, `anyio.fail_after` around
awaits, a lonely receive released by a late send if it never times out (so
leaving its world cannot wait forever), and, last, a per-test watchdog that dumps
every thread's stack and exits should a test wedge where nothing can be cancelled.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import (TAG_ANY, ACCLError, CCLOError, DependencyError, ErrorCode, KernelError,
                   ReduceFunction)
from aaccl.api._call import outcome
from aaccl.devices import DeviceCall
from conftest import on_device, run_ranks

CHAIN = 20_000
LIMIT = 60.0
"""Seconds any one test awaits at most: a failure raises TimeoutError, never hangs."""
GRACE = 2.0
"""Slack on a timeout, for a busy two-core CI machine."""
HARD_LIMIT = 150.0
"""Seconds after which a wedged test dumps every thread's stack and ends the process."""
TIMEOUTS = ErrorCode.RECEIVE_TIMEOUT_ERROR | ErrorCode.DEQUEUE_BUFFER_TIMEOUT_ERROR
LARGE = 16 * 1024
"""int32 elements in 64 KiB: above the eager threshold of the default 16 x 1024 B."""


leaving: list[BaseException] = []
"""What the running test raised inside a world, shown should leaving the world wedge."""


@pytest.fixture(autouse=True)
def never_hang(request: pytest.FixtureRequest) -> Iterator[None]:
    """The last resort: leaving a world waits, shielded, for its outstanding calls, so a
    call the device lost would hang the suite. Print every thread's stack and exit."""
    capture = request.config.pluginmanager.getplugin("capturemanager")

    def wedged() -> None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"\n{request.node.nodeid} still runs after {HARD_LIMIT} s", file=sys.stderr)
            for error in leaving:
                print("it raised, then waited to leave its world:", file=sys.stderr)
                traceback.print_exception(error, file=sys.stderr)
            print("every thread:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(sys.stderr)
        os._exit(3)

    leaving.clear()
    watchdog = threading.Timer(HARD_LIMIT, wedged)
    watchdog.daemon = True
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


@contextlib.asynccontextmanager
async def world(size: int, **options: Any) -> AsyncIterator[list[aaccl.ACCL]]:
    """`aaccl.open_world`, remembering what the body raised: leaving a world waits for
    its calls, and a wedged exit would otherwise hide why the test failed."""
    async with aaccl.open_world(size, **options) as accls:
        try:
            yield accls
        except BaseException as error:
            leaving.append(error)
            raise


def filled(accl: aaccl.ACCL, values: np.ndarray) -> aaccl.Buffer:
    buf = accl.allocate(values.shape, values.dtype)
    buf[...] = values
    return buf


def resident(accl: aaccl.ACCL, values: np.ndarray) -> aaccl.Buffer:
    """A buffer whose device memory holds `values`, for calls with from_fpga."""
    buf = filled(accl, values)
    buf.sync_to_device()
    return buf


async def finish(calls: Sequence[aaccl.Call], limit: float = LIMIT) -> float:
    """Await every call within `limit` seconds (the first error raises); the seconds
    it took."""
    began = time.monotonic()
    with anyio.fail_after(limit):
        for call in calls:
            await call
    return time.monotonic() - began


async def expect_receive_timeout(receiver: aaccl.ACCL, sender: aaccl.ACCL,
                                 timeout: float) -> None:
    """A receive nobody sends to fails with RECEIVE_TIMEOUT_ERROR within about
    `timeout`. If it does not, the sender releases it (so the world can close) and the
    test fails: the device lost the timer that should have ended the wait."""
    tag = 0x5C41E
    began = time.monotonic()
    lonely = receiver.recv(receiver.allocate(1, np.int32), 1, sender.rank, tag=tag)
    with anyio.move_on_after(timeout + GRACE):
        with pytest.raises(CCLOError) as failed:
            await lonely
        assert failed.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR, failed.value
        assert time.monotonic() - began < timeout + GRACE
        return
    try:
        await finish([sender.send(sender.allocate(1, np.int32), 1, receiver.rank, tag=tag),
                      lonely])
    except ACCLError:
        pass  # it timed out after all, just late
    pytest.fail(f"a receive with no sender did not time out within {timeout} + {GRACE} s")


# -- the API layer alone: a failed chain of 100,000 Calls -------------------------------------

def test_a_failed_chain_of_100000_calls_reports_its_root_without_recursion(caplog) -> None:
    """No engine here: device calls completed by hand, one after the other, so this
    checks only what `Call` does per chained call (retrieving, causes, collection)."""
    n = 100_000

    class Rank:  # what adopts the calls: their outcome as a rank works it out
        _poller = _loop = None
        _outcome = staticmethod(outcome)

    def adopted(name: str, deps: tuple[aaccl.Call, ...]) -> aaccl.Call:
        call = DeviceCall(None)  # (adopted as `ACCL._submit` does, with nothing to book)
        call._name, call._origin, call._buffers, call._deps = name, None, (), deps
        call.owner, call._finish, call._on_done = rank, None, None
        return call

    rank = Rank()
    calls = [adopted("head", ())]
    for i in range(n):
        calls.append(adopted(f"call {i}", (calls[-1],)))
    calls[0].complete(error=ValueError("the root"))
    for call in calls[1:]:
        call.complete(aborted=True)
    last = calls[-1]
    with pytest.raises(DependencyError, match=f"call {n - 1} did not run: call {n - 2} failed") \
            as failed:
        last.wait(0)  # retrieves all 100,000 errors
    root = calls[0].exception()
    assert isinstance(root, KernelError) and isinstance(root.__cause__, ValueError)
    assert failed.value.__cause__ is root
    assert calls[n // 2].exception().__cause__ is root
    assert len(traceback.format_exception(failed.value)) < 40  # printing does not recurse
    # what earlier tests left to the collector (a rank's failed call whose await
    # `aaccl.run` cancelled, say) is collected, and reported, before: only the chain's
    # calls are judged below
    gc.collect()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="aaccl"):
        del calls, failed, root, call
        del last  # the last reference to a chain 100,000 deep
        gc.collect()
    assert [r for r in caplog.records if "nobody awaited" in r.getMessage()] == []


# -- chains of 20,000 calls, one await ----------------------------------------------------------

class Gate:
    """A receive that holds a chain until `open()` sends its message: the whole chain is
    pending when its first call may start, so its calls complete in one cascade instead
    of each finding the one before it done already."""

    TAG = 0x6A7E

    def __init__(self, holder: aaccl.ACCL, opener: aaccl.ACCL) -> None:
        self.holder, self.opener = holder, opener
        self.call = holder.recv(holder.allocate(1, np.int32), 1, opener.rank, tag=self.TAG)

    async def open(self) -> None:
        await finish([self.opener.send(self.opener.allocate(1, np.int32), 1, self.holder.rank,
                                       tag=self.TAG), self.call])


@pytest.mark.anyio
@pytest.mark.parametrize("gated", [True, False], ids=["behind a gate", "as submitted"])
async def test_a_chain_of_20000_nops_costs_one_await(gated: bool) -> None:
    async with world(2, timeout=10) as (accl, peer):
        gate = Gate(accl, peer) if gated else None
        sampled, last = [], accl.nop(waitfor=[gate.call] if gate else [])
        for i in range(CHAIN - 1):
            last = accl.nop(waitfor=[last])  # only the chain keeps earlier calls
            if i % 1000 == 0:
                sampled.append(last)
        if gate:
            assert not any(call.done() for call in sampled)
            await gate.open()
        await finish([last])
        assert all(call.done() and call.exception() is None for call in sampled)


@pytest.mark.anyio
async def test_chains_of_20000_small_allreduces_one_per_rank() -> None:
    """Rank 0 feeds each allreduce the previous one's result (ping-ponging between two
    buffers), rank 1 adds one of three fixed increments; counts cycle 1..4, so every
    step leaves its trace in the final values of a numpy replay."""
    counts = 1 + np.arange(CHAIN) % 4
    bumps = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [-3, 9, -1, 2]], np.int64)
    initial = [np.array([10, 20, 30, 40], np.int64), np.array([-1, -2, -3, -4], np.int64)]
    pingpong = [values.copy() for values in initial]
    received = np.zeros(4, np.int64)
    for i, c in enumerate(counts):
        src, dst = pingpong[i % 2], pingpong[(i + 1) % 2]
        dst[:c] = src[:c] + bumps[i % 3, :c]
        received[:c] = dst[:c]

    async def rank(accl: aaccl.ACCL) -> list[np.ndarray]:
        if accl.rank == 0:
            bufs = [resident(accl, values) for values in initial]

            def step(i: int, count: int, waitfor: list[aaccl.Call]) -> aaccl.Call:
                return accl.allreduce(bufs[i % 2], bufs[(i + 1) % 2], count, ReduceFunction.SUM,
                                      from_fpga=True, to_fpga=True, waitfor=waitfor)
        else:
            incs = [resident(accl, values) for values in bumps]
            bufs = [resident(accl, np.zeros(4, np.int64))]

            def step(i: int, count: int, waitfor: list[aaccl.Call]) -> aaccl.Call:
                return accl.allreduce(incs[i % 3], bufs[0], count, ReduceFunction.SUM,
                                      from_fpga=True, to_fpga=True, waitfor=waitfor)
        last: list[aaccl.Call] = []
        for i, c in enumerate(counts):
            last = [step(i, int(c), last)]  # each rank chains its own calls
        await finish(last)
        for buf in bufs:
            buf.sync_from_device()
        return [np.array(b) for b in bufs]

    async with world(2, timeout=10) as accls:
        mine, theirs = await run_ranks(accls, rank)
    np.testing.assert_array_equal(mine[0], pingpong[0])
    np.testing.assert_array_equal(mine[1], pingpong[1])
    np.testing.assert_array_equal(theirs[0], received)


def step_in_order(state: np.ndarray, i: int) -> None:
    """A kernel run: add i, and remember whether the runs came in order."""
    state[0] += i
    state[1] = i if state[1] == i - 1 else -(10 ** 9)


@pytest.mark.anyio
async def test_a_chain_of_20000_python_kernel_runs_costs_one_await() -> None:
    async with world(2, timeout=10) as (accl, peer):
        gate = Gate(accl, peer)
        state = filled(accl, np.array([0, -1], np.int64))
        step = accl.kernel(step_in_order)
        last = accl.sync_to_device(state, waitfor=[gate.call])
        for i in range(CHAIN):
            last = step(state, i, waitfor=[last])
        await gate.open()
        await finish([accl.sync_from_device(state, waitfor=[last])])
        np.testing.assert_array_equal(state, [CHAIN * (CHAIN - 1) // 2, CHAIN - 1])


@pytest.mark.anyio
async def test_a_chain_of_20000_transfers_costs_one_await() -> None:
    """Alternately one element of `up` to the device and one of `down` back: each of the
    20,000 transfers moves its own element, so a lost one shows."""
    half = CHAIN // 2
    async with world(2, timeout=10) as (accl, peer):
        up = filled(accl, np.arange(half, dtype=np.int32) + 7)
        down = resident(accl, -np.arange(half, dtype=np.int32) - 1)
        down[:] = 0
        gate = Gate(accl, peer)
        last = gate.call
        for i in range(half):
            last = accl.sync_to_device(up[i:i + 1], waitfor=[last])
            last = accl.sync_from_device(down[i:i + 1], waitfor=[last])
        await gate.open()
        await finish([last])
        np.testing.assert_array_equal(down, -np.arange(half) - 1)
        np.testing.assert_array_equal(on_device(up), np.arange(half) + 7)


# -- many outstanding calls ---------------------------------------------------------------------

async def exchange_large(a: aaccl.ACCL, b: aaccl.ACCL, count: int, timeout: float) -> None:
    """Both ranks post `count` 64 KiB sends to each other, then `count` receives."""
    pairs = ((a, b), (b, a))
    data = {(s.rank, i): np.arange(LARGE, dtype=np.int32) + (s.rank * count + i) * LARGE
            for s, _ in pairs for i in range(count)}
    srcs = {key: filled(a if key[0] == a.rank else b, values) for key, values in data.items()}
    began = time.monotonic()
    sends = [s.send(srcs[s.rank, i], LARGE, r.rank, tag=1)
             for s, r in pairs for i in range(count)]
    dsts = {(r.rank, i): r.allocate(LARGE, np.int32) for _, r in pairs for i in range(count)}
    recvs = [r.recv(dsts[r.rank, i], LARGE, s.rank, tag=1)
             for s, r in pairs for i in range(count)]
    await finish(recvs + sends)
    took = time.monotonic() - began
    for s, r in pairs:
        for i in range(count):
            np.testing.assert_array_equal(dsts[r.rank, i], data[s.rank, i])
    assert took < timeout / 2, f"{2 * count} large sends took {took:.1f} s: not well inside " \
                               f"the {timeout} s timeout"


@pytest.mark.anyio
async def test_256_outstanding_large_sends_each_way() -> None:
    async with world(2, timeout=10) as (a, b):
        await exchange_large(a, b, 256, 10)


@pytest.mark.slow
@pytest.mark.anyio
async def test_1000_outstanding_large_sends_each_way() -> None:
    async with world(2, timeout=20) as (a, b):
        await exchange_large(a, b, 1000, 20)


async def ring_of_small_sends(count: int, timeout: float) -> None:
    """Every rank of four posts `count` small sends to the next before any receive."""
    size = 4
    async with world(size, timeout=timeout) as accls:
        def message(rank: int, i: int) -> np.ndarray:
            return np.array([rank, i, rank * count + i], np.int64)

        sends = [a.send(filled(a, message(a.rank, i)), 3, (a.rank + 1) % size, tag=2)
                 for a in accls for i in range(count)]
        dsts = [[a.allocate(3, np.int64) for _ in range(count)] for a in accls]
        recvs = [a.recv(dsts[a.rank][i], 3, (a.rank - 1) % size, tag=2)
                 for a in accls for i in range(count)]
        await finish(recvs + sends)
        for a in accls:
            got = np.array(dsts[a.rank])
            np.testing.assert_array_equal(
                got, [message((a.rank - 1) % size, i) for i in range(count)])


@pytest.mark.anyio
async def test_2000_outstanding_small_sends_per_rank_around_a_ring() -> None:
    # the timeout bounds how long the earliest send waits for its receive, which this
    # program posts only after every send: it must exceed the time to submit them all
    await ring_of_small_sends(2000, 60)


@pytest.mark.slow
@pytest.mark.anyio
async def test_10000_outstanding_small_sends_per_rank_around_a_ring() -> None:
    await ring_of_small_sends(10_000, 120)


@pytest.mark.anyio
async def test_1000_outstanding_allreduces_per_rank() -> None:
    size, calls, n = 4, 1000, 16
    rng = np.random.default_rng(12)
    inputs = rng.integers(-1000, 1000, size=(size, calls, n)).astype(np.float32)
    counts = 1 + np.arange(calls) % n
    async with world(size, timeout=10) as accls:
        dsts = [[a.allocate(n) for _ in range(calls)] for a in accls]
        pending = [a.allreduce(filled(a, inputs[a.rank, i]), dsts[a.rank][i], int(counts[i]),
                               ReduceFunction.SUM)
                   for a in accls for i in range(calls)]
        await finish(pending)
    total = inputs.sum(axis=0)
    for rank in range(size):
        for i, c in enumerate(counts):
            np.testing.assert_array_equal(dsts[rank][i][:c], total[i, :c])
            np.testing.assert_array_equal(dsts[rank][i][c:], 0)


# -- matching: MPI's order, whatever is outstanding -----------------------------------------------

def mpi_match(send_tags: Sequence[int], recv_tags: Sequence[int]) -> list[int]:
    """Which send each receive takes, between one sender and one receiver: in posting
    order, the first send not yet taken whose tag matches (TAG_ANY takes any)."""
    taken = [False] * len(send_tags)
    matched = []
    for want in recv_tags:
        k = next(k for k, tag in enumerate(send_tags)
                 if not taken[k] and want in (TAG_ANY, tag))
        taken[k] = True
        matched.append(k)
    return matched


def tagged_program(seed: int, messages: int) -> tuple[list[int], list[int], list[int]]:
    """Send tags, message sizes (some above the eager threshold, some segmented) and
    receive tags (a third TAG_ANY) such that every receive has a message to take."""
    rng = np.random.default_rng(seed)
    send_tags = [int(t) for t in rng.choice([0, 1, 2, 9], size=messages)]
    sizes = [int(rng.choice([1, 3, 64, 300, 2000])) for _ in range(messages)]
    left = list(range(messages))
    recv_tags = []
    for _ in range(messages):
        want = TAG_ANY if rng.random() < 1 / 3 else send_tags[left[rng.integers(len(left))]]
        recv_tags.append(want)
        left.remove(next(k for k in left if want in (TAG_ANY, send_tags[k])))
    return send_tags, sizes, recv_tags


@pytest.mark.anyio
@pytest.mark.parametrize("order, seed", [("sends first", 1), ("receives first", 2),
                                         ("interleaved", 3)])
async def test_tagged_messages_match_in_mpi_order(order: str, seed: int) -> None:
    messages = 400
    send_tags, sizes, recv_tags = tagged_program(seed, messages)
    matched = mpi_match(send_tags, recv_tags)
    async with world(2, timeout=10) as (a, b):
        data = [np.arange(sizes[k], dtype=np.int32) + k * 10_000 for k in range(messages)]
        srcs = [filled(a, d) for d in data]
        dsts = [filled(b, np.full(sizes[k], -1, np.int32)) for k in matched]

        def send(k: int) -> aaccl.Call:
            return a.send(srcs[k], sizes[k], 1, tag=send_tags[k])

        def recv(j: int) -> aaccl.Call:
            return b.recv(dsts[j], sizes[matched[j]], 0, tag=recv_tags[j])

        if order == "sends first":
            calls = [send(k) for k in range(messages)] + [recv(j) for j in range(messages)]
        elif order == "receives first":
            calls = [recv(j) for j in range(messages)] + [send(k) for k in range(messages)]
        else:
            calls = [c for k in range(messages) for c in (send(k), recv(k))]
        await finish(calls)
    for j, k in enumerate(matched):
        np.testing.assert_array_equal(dsts[j], data[k], err_msg=f"receive {j} (tag "
                                      f"{recv_tags[j]:#x}) should have taken send {k}")


def test_the_matching_model() -> None:
    """The model itself, on a case worked by hand."""
    assert mpi_match([1, 2, 1, 3], [2, TAG_ANY, 3, 1]) == [1, 0, 3, 2]
    assert mpi_match([5, 5, 6], [6, TAG_ANY, TAG_ANY]) == [2, 0, 1]


# -- failures inside the device --------------------------------------------------------------------

class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


class Halt(BaseException):
    """Not an Exception: what a kernel's KeyboardInterrupt or SystemExit would be."""


@pytest.mark.anyio
async def test_a_kernel_that_raises_fails_only_its_call() -> None:
    def broken(buf: np.ndarray) -> None:
        raise ValueError("no good")

    def unprintable(buf: np.ndarray) -> None:
        raise Unprintable()

    def halting(buf: np.ndarray) -> None:
        raise Halt()

    timeout = 0.3
    async with world(2, timeout=timeout) as (a, b):
        buf = b.allocate(4)
        with anyio.fail_after(LIMIT):
            with pytest.raises(KernelError, match="raised ValueError: no good"):
                await b.kernel(broken)(buf)
            with pytest.raises(ACCLError):
                await b.kernel(unprintable)(buf)
            with pytest.raises(ACCLError):
                await b.kernel(halting)(buf)
        await expect_receive_timeout(b, a, timeout)
        await expect_receive_timeout(a, b, timeout)

        async def allreduce(accl: aaccl.ACCL) -> np.ndarray:
            src, dst = filled(accl, np.full(8, accl.rank + 1, np.float32)), accl.allocate(8)
            await finish([accl.allreduce(src, dst, 8, ReduceFunction.SUM)])
            return np.array(dst)

        for got in await run_ranks([a, b], allreduce):
            np.testing.assert_array_equal(got, 3)


# -- in_order: as the firmware runs calls ---------------------------------------------------------

async def receive_then_send_large(a: aaccl.ACCL, b: aaccl.ACCL) -> list[aaccl.Call]:
    """Both ranks post a 64 KiB receive, then a 64 KiB send to each other: it completes
    only if a rank's receive and send overlap."""
    data = {r.rank: np.arange(LARGE, dtype=np.int32) * (r.rank + 1) for r in (a, b)}
    dsts = {r.rank: r.allocate(LARGE, np.int32) for r in (a, b)}
    recvs = [r.recv(dsts[r.rank], LARGE, 1 - r.rank, tag=4) for r in (a, b)]
    sends = [r.send(filled(r, data[r.rank]), LARGE, 1 - r.rank, tag=4) for r in (a, b)]
    calls = recvs + sends
    with anyio.fail_after(LIMIT):
        for call in calls:
            try:
                await call
            except CCLOError:
                pass
    if all(call.exception() is None for call in calls):
        for r in (a, b):
            np.testing.assert_array_equal(dsts[r.rank], data[1 - r.rank])
    return calls


@pytest.mark.anyio
@pytest.mark.parametrize("options", [{}, {"in_order": False}], ids=["default", "in_order=False"])
async def test_receives_before_large_sends_complete_when_calls_may_overlap(options) -> None:
    async with world(2, timeout=5, **options) as (a, b):
        calls = await receive_then_send_large(a, b)
        assert [call.exception() for call in calls] == [None] * 4


@pytest.mark.anyio
async def test_receives_before_large_sends_time_out_in_order() -> None:
    timeout = 0.5
    async with world(2, timeout=timeout, in_order=True) as (a, b):
        began = time.monotonic()
        calls = await receive_then_send_large(a, b)
        took = time.monotonic() - began
        errors = [call.exception() for call in calls]
        # Both receives wait with their sends queued behind them; the first receive to
        # reach its deadline fails, its rank's send then runs and may still meet the
        # other rank's receive, whose send then finds no receive at all. Whatever
        # the race, the program cannot complete, and every failure is a timeout.
        recv_errors = errors[:2]
        assert any(e is not None for e in recv_errors), errors
        assert any(e is not None for e in errors[2:]), errors
        for error in errors:
            assert error is None or (isinstance(error, CCLOError) and error.code & TIMEOUTS), \
                errors
        assert took < 4 * timeout + GRACE  # each rank: its receive's wait, then its send's
        await expect_receive_timeout(a, b, timeout)


@pytest.mark.anyio
async def test_in_order_runs_what_the_firmware_runs() -> None:
    """Sends matched by receives in program order, and a chain of collectives."""
    async with world(2, timeout=5, in_order=True) as accls:
        async def rank(accl: aaccl.ACCL) -> tuple[np.ndarray, np.ndarray]:
            mine = filled(accl, np.arange(LARGE, dtype=np.int32) + accl.rank)
            theirs, total = accl.allocate(LARGE, np.int32), accl.allocate(LARGE, np.int32)
            other = 1 - accl.rank
            if accl.rank == 0:
                calls = [accl.send(mine, LARGE, other), accl.recv(theirs, LARGE, other)]
            else:
                calls = [accl.recv(theirs, LARGE, other), accl.send(mine, LARGE, other)]
            summed = accl.allreduce(mine, total, LARGE, ReduceFunction.SUM, waitfor=calls)
            await finish([*calls, accl.nop(waitfor=[summed]), summed])
            return np.array(theirs), np.array(total)

        results = await run_ranks(accls, rank)
    for r, (theirs, total) in enumerate(results):
        np.testing.assert_array_equal(theirs, np.arange(LARGE) + 1 - r)
        np.testing.assert_array_equal(total, 2 * np.arange(LARGE) + 1)


@pytest.mark.anyio
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("count", [16, LARGE], ids=["small", "large"])
async def test_in_order_a_call_reading_an_earlier_result_keeps_its_place(size: int,
                                                                          count: int) -> None:
    """c2 reads c1's result (a dependency the API adds), c3 is independent: c3 must
    not overtake c2 on the ranks where c1 still runs, or the ranks run their
    collectives in different orders and time out (issue 27)."""
    async with world(size, timeout=2.0, in_order=True) as accls:
        async def rank(accl: aaccl.ACCL) -> tuple[np.ndarray, np.ndarray]:
            a = filled(accl, np.full(count, accl.rank + 1, np.float32))
            b = filled(accl, np.full(count, 10 * (accl.rank + 1), np.float32))
            x, y, z = (accl.allocate(count, np.float32) for _ in range(3))
            c1 = accl.allreduce(a, x, count, ReduceFunction.SUM, to_fpga=True)
            c2 = accl.allreduce(x, y, count, ReduceFunction.SUM, from_fpga=True)
            c3 = accl.allreduce(b, z, count, ReduceFunction.SUM)
            await finish([c3, c2, c1])  # out of order: CCLOError, RECEIVE_TIMEOUT_ERROR
            return np.array(y), np.array(z)

        results = await run_ranks(accls, rank)
    total = size * (size + 1) // 2
    for y, z in results:
        np.testing.assert_array_equal(y, size * total)
        np.testing.assert_array_equal(z, 10 * total)


@pytest.mark.anyio
@pytest.mark.parametrize("sent", [True, False], ids=["released", "timed-out"])
async def test_in_order_a_queued_call_given_up_leaves_the_queue(sent: bool) -> None:
    """A call queued behind a waiting head whose await was cancelled is aborted when
    its rank leaves; the calls behind it still run once the head ends, however it
    ends, and leaving takes no longer than the head (issue 27: it hung)."""
    timeout = 0.5
    async with world(2, timeout=timeout, in_order=True) as (a, b):
        src = resident(a, np.arange(4, dtype=np.int32))
        got, dst, behind_dst = (a.allocate(4, np.int32) for _ in range(3))
        head = a.recv(got, 4, 1, tag=1)  # rank 1 sends only once the call behind is aborted
        given_up = a.copy(src, dst, 4, from_fpga=True, to_fpga=True)
        behind = a.copy(src, behind_dst, 4, from_fpga=True)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await given_up
        assert not given_up.done()

        async def rank1() -> None:
            with anyio.fail_after(LIMIT):
                with pytest.raises(aaccl.Aborted, match="await was cancelled"):
                    await given_up
            if sent:
                await b.send(filled(b, np.full(4, 7, np.int32)), 4, 0, tag=1)

        began = time.monotonic()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(a.aclose)  # leaving waits for head and behind, shielded
            tasks.start_soon(rank1)
        assert time.monotonic() - began < timeout + GRACE
        assert behind.exception() is None
        np.testing.assert_array_equal(behind_dst, np.arange(4))
        if sent:
            assert head.exception() is None
            np.testing.assert_array_equal(got, 7)
        else:
            error = head.exception()
            assert isinstance(error, CCLOError) and error.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
            assert "waited 0.5 s for a message from rank 1" in str(error)
        np.testing.assert_array_equal(on_device(dst), 0)  # the given-up copy never ran


@pytest.mark.anyio
async def test_in_order_a_call_whose_dependency_fails_leaves_the_queue() -> None:
    """A queued call aborted by its failed dependency (a kernel: host work, outside
    the CCLO's queue) before its turn leaves the queue; the calls behind run."""
    async with world(2, timeout=5, in_order=True) as (a, b):
        src = resident(a, np.arange(4, dtype=np.int32))
        got, dst, behind_dst = (a.allocate(4, np.int32) for _ in range(3))
        head = a.recv(got, 4, 1, tag=1)

        def fails(_: Any) -> None:
            raise RuntimeError("kernel fails")

        kernel = a.kernel(fails)(src)
        doomed = a.copy(src, dst, 4, from_fpga=True, to_fpga=True, waitfor=[kernel])
        behind = a.copy(src, behind_dst, 4, from_fpga=True)
        with anyio.fail_after(LIMIT):
            with pytest.raises(DependencyError):
                await doomed
        assert not head.done() and not behind.done()  # behind waits for the head still
        await finish([b.send(filled(b, np.full(4, 7, np.int32)), 4, 0, tag=1), head, behind])
        np.testing.assert_array_equal(got, 7)
        np.testing.assert_array_equal(behind_dst, np.arange(4))
        with pytest.raises(KernelError):
            await kernel


@pytest.mark.anyio
async def test_in_order_a_nop_waits_its_turn() -> None:
    """A nop is a call like any other: it ends after the call before it."""
    timeout = 0.3
    async with world(2, timeout=timeout, in_order=True) as (a, b):
        head = a.recv(a.allocate(4, np.int32), 4, 1, tag=1)  # nobody sends: it times out
        nop = a.nop()
        await finish([nop])
        assert head.done()
        with pytest.raises(CCLOError, match="RECEIVE_TIMEOUT"):
            await head


@pytest.mark.anyio
async def test_in_order_a_program_that_deadlocks_on_a_card_times_out_naming_the_peer() -> None:
    """Each rank receives before it sends: on a card each receive holds its rank's
    queue, so neither send ever runs. Here the first receive to reach its deadline
    fails, naming the rank it waited for; its rank's send then runs (eager: done
    without a receive) and may still meet the other receive before that one's
    deadline. Either way every call ends within about one timeout, and leaving is
    prompt."""
    timeout = 0.5
    async with world(2, timeout=timeout, in_order=True) as accls:
        began = time.monotonic()

        async def rank(accl: aaccl.ACCL) -> tuple[BaseException | None, np.ndarray]:
            other = 1 - accl.rank
            got = accl.allocate(4, np.int32)
            recv = accl.recv(got, 4, other, tag=3)
            send = accl.send(filled(accl, np.full(4, accl.rank + 5, np.int32)), 4, other, tag=3)
            with anyio.fail_after(LIMIT):
                try:
                    await recv
                except CCLOError:
                    pass
                await send
            return recv.exception(), np.array(got)

        results = await run_ranks(accls, rank)
    assert time.monotonic() - began < timeout + GRACE  # both waited at once; left at once
    assert any(error is not None for error, _ in results)
    for r, (error, got) in enumerate(results):
        if error is None:
            np.testing.assert_array_equal(got, 1 - r + 5)
            continue
        assert isinstance(error, CCLOError) and error.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
        assert f"waited {timeout:g} s for a message from rank {1 - r}" in str(error)

# -- a failing head: last, since on a broken engine it may take timeouts down with it -------------

def chained_behind(head: aaccl.Call, accl: aaccl.ACCL, count: int,
                   counter: list[int]) -> list[aaccl.Call]:
    """`count` calls of every kind, each waiting for the one before, behind `head`."""
    buf, other = accl.allocate(4), accl.allocate(4)
    kernel = accl.kernel(lambda _: counter.append(1))
    kinds: list[Callable[[list[aaccl.Call]], aaccl.Call]] = [
        lambda w: accl.nop(waitfor=w),
        lambda w: kernel(buf, waitfor=w),
        lambda w: accl.sync_to_device(buf, waitfor=w),
        lambda w: accl.copy(buf, other, 4, waitfor=w),
        lambda w: accl.sync_from_device(other, waitfor=w),
    ]
    calls = [head]
    for i in range(count):
        calls.append(kinds[i % len(kinds)]([calls[-1]]))
    return calls


@pytest.mark.anyio
async def test_a_chain_of_20000_behind_a_failing_head_fails_call_by_call() -> None:
    timeout = 0.3
    ran: list[int] = []
    async with world(2, timeout=timeout) as (a, b):
        tag = 0xFA11
        head = b.recv(b.allocate(4), 4, 0, tag=tag)  # rank 0 never sends (unless rescuing)
        calls = chained_behind(head, b, CHAIN, ran)
        submitted = time.monotonic()
        with anyio.move_on_after(timeout + GRACE):
            with pytest.raises(CCLOError) as failed:
                await head
        if not head.done():  # release it, so the chain and the world can end
            try:
                await finish([a.send(a.allocate(4), 4, 1, tag=tag), *calls])
            except ACCLError:
                pass
            pytest.fail("the failing head's receive never timed out")
        root = failed.value
        assert root.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
        with anyio.fail_after(LIMIT):
            with pytest.raises(DependencyError, match="did not run"):
                await calls[-1]
        prompt = time.monotonic() - submitted
        assert prompt < timeout + GRACE, f"the chain failed {prompt:.1f} s after it was submitted"
        for call in calls[1:]:
            error = call.exception()
            assert isinstance(error, DependencyError) and error.__cause__ is root, error
            with pytest.raises(DependencyError):
                await call
        assert len(traceback.format_exception(error)) < 40
        assert ran == []
        await expect_receive_timeout(b, a, timeout)
        await expect_receive_timeout(a, b, timeout)
        del calls, head
    async with world(2, timeout=timeout) as (c, d):
        await expect_receive_timeout(d, c, timeout)
