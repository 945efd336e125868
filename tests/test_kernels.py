"""Compute kernels and transfers as calls (`ACCL.kernel`, `ACCL.sync_to_device`,
`ACCL.sync_from_device`) on the soft CCLO.

Kernels chained with collectives and costing one await, the device memory a kernel
works in, kernels running in parallel, a kernel's exception as KernelError and its
dependents' DependencyError, cancellation, argument checks, and tracing.
"""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import DependencyError, ErrorCode, KernelError, ReduceFunction
from conftest import DTYPES, on_device, reference_inputs, run_ranks

pytestmark = pytest.mark.anyio


def scale(x: np.ndarray, factor: float) -> None:
    x *= factor


def add_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    np.add(a, b, out=out)


# -- chains --------------------------------------------------------------------------------

@pytest.mark.parametrize("size, n", [(1, 7), (3, 1001), (4, 4096)])
async def test_upload_kernel_allreduce_kernel_download_is_one_await(size: int, n: int) -> None:
    inputs = [reference_inputs(r, n, np.float32) for r in range(size)]
    expected = (sum(2 * x for x in inputs) + 1).astype(np.float32)

    async def rank(accl: aaccl.ACCL) -> np.ndarray:
        src, dst = accl.allocate(n), accl.allocate(n)
        src[:] = inputs[accl.rank]
        times_two, plus_one = accl.kernel(scale), accl.kernel(np.add, name="plus_one")
        up = accl.sync_to_device(src)
        doubled = times_two(src, 2.0, waitfor=[up])
        summed = accl.allreduce(src, dst, n, ReduceFunction.SUM, from_fpga=True, to_fpga=True,
                                waitfor=[doubled])
        shifted = plus_one(dst, 1.0, dst, waitfor=[summed])
        down = accl.sync_from_device(dst, waitfor=[shifted])
        await down  # the only await of the chain
        assert up.done() and doubled.done() and summed.done() and shifted.done()
        return np.array(dst)

    async with aaccl.open_world(size, timeout=5) as accls:
        for result in await run_ranks(accls, rank):
            np.testing.assert_array_equal(result, expected)


async def test_a_kernel_works_in_device_memory_not_host_memory() -> None:
    async with aaccl.open_world(1) as (accl,):
        buf = accl.allocate(5, np.int32)
        buf[:] = 1
        await accl.sync_to_device(buf)
        buf[:] = 100  # host only: the kernel must not see it
        await accl.kernel(scale)(buf, 3)
        np.testing.assert_array_equal(buf, 100)  # host copy untouched
        np.testing.assert_array_equal(on_device(buf), 3)
        await accl.sync_from_device(buf)
        np.testing.assert_array_equal(buf, 3)


async def test_kernel_arguments_keep_their_shape_and_pass_other_values_as_they_are() -> None:
    seen: list[tuple] = []

    def record(grid: np.ndarray, label: str, table: dict) -> None:
        seen.append((grid.shape, grid.dtype, label, table))
        grid[1, 2] = 42

    async with aaccl.open_world(1) as (accl,):
        grid = accl.allocate((3, 4), np.float64)
        table = {"x": 1}
        await accl.kernel(record)(grid, "label", table)
        assert seen == [((3, 4), np.dtype(np.float64), "label", table)]
        await accl.sync_from_device(grid)
        assert grid[1, 2] == 42 and grid.sum() == 42


async def test_keyword_arguments_and_one_buffer_passed_twice() -> None:
    def axpy(y: np.ndarray, *, x: np.ndarray, a: float) -> None:
        y += a * x

    async with aaccl.open_world(1) as (accl,):
        x, y = accl.allocate(5), accl.allocate(5)
        x[:], y[:] = np.arange(5), 1
        up = [accl.sync_to_device(x), accl.sync_to_device(y)]
        done = accl.kernel(axpy)(y, x=x, a=2.0, waitfor=up)
        doubled = accl.kernel(np.add)(y, y, out=y, waitfor=[done])
        await accl.sync_from_device(y, waitfor=[doubled])
        np.testing.assert_array_equal(y, 2 * (1 + 2 * np.arange(5)))
        with pytest.raises(ValueError, match="argument out of add belongs to another rank"):
            async with aaccl.open_world(1) as (other,):
                accl.kernel(np.add)(y, y, out=other.allocate(5))


async def test_transfers_of_slices_move_just_their_elements() -> None:
    async with aaccl.open_world(1) as (accl,):
        buf = accl.allocate(10, np.float32)
        buf[:] = np.arange(10)
        await accl.sync_to_device(buf[2:5])
        np.testing.assert_array_equal(on_device(buf), [0, 0, 2, 3, 4, 0, 0, 0, 0, 0])
        await accl.kernel(scale)(buf, -1.0)
        buf[:] = 7
        await accl.sync_from_device(buf[3:4])
        np.testing.assert_array_equal(buf, [7, 7, 7, -3, 7, 7, 7, 7, 7, 7])


@pytest.mark.parametrize("dtype", DTYPES)
async def test_every_dtype_through_kernel_and_collective(dtype: type) -> None:
    size, n = 3, 33
    inputs = [reference_inputs(r, n, dtype) for r in range(size)]
    expected = np.maximum.reduce([x * 2 for x in inputs])

    async def rank(accl: aaccl.ACCL) -> np.ndarray:
        src, dst = accl.allocate(n, dtype), accl.allocate(n, dtype)
        src[:] = inputs[accl.rank]
        up = accl.sync_to_device(src)
        doubled = accl.kernel(add_into)(src, src, src, waitfor=[up])
        await accl.allreduce(src, dst, n, ReduceFunction.MAX, from_fpga=True, waitfor=[doubled])
        return np.array(dst)

    async with aaccl.open_world(size, timeout=5) as accls:
        for result in await run_ranks(accls, rank):
            np.testing.assert_array_equal(result, expected)
            assert result.dtype == np.dtype(dtype)


async def test_a_message_larger_than_the_rx_buffers_between_kernels() -> None:
    n = 5000  # 20 kB through 256-byte rx buffers

    async def rank(accl: aaccl.ACCL) -> np.ndarray:
        buf = accl.allocate(n, np.float32)
        if accl.rank == 0:
            buf[:] = np.arange(n)
            up = accl.sync_to_device(buf)
            made = accl.kernel(scale)(buf, 0.5, waitfor=[up])
            await accl.send(buf, n, 1, tag=3, from_fpga=True, waitfor=[made])
        else:
            got = accl.recv(buf, n, 0, tag=3, to_fpga=True)
            await accl.sync_from_device(buf, waitfor=[accl.kernel(scale)(buf, 4.0, waitfor=[got])])
        return np.array(buf)

    async with aaccl.open_world(2, nbufs=4, bufsize=256, timeout=5) as accls:
        _, received = await run_ranks(accls, rank)
    np.testing.assert_array_equal(received, np.arange(n, dtype=np.float32) * 2)


async def test_kernels_without_dependencies_run_in_parallel() -> None:
    """Two kernels that can only finish together: if the device ran them one after
    the other, the first would wait alone at the barrier and break it."""
    meeting = threading.Barrier(2, timeout=10)

    def meet(buf: np.ndarray) -> None:
        buf[:] = meeting.wait()

    async with aaccl.open_world(1) as (accl,):
        a, b = accl.allocate(1, np.int32), accl.allocate(1, np.int32)
        kernel = accl.kernel(meet)
        first, second = kernel(a), kernel(b)
        await accl.nop(waitfor=[first, second])
        await accl.sync_from_device(a)
        await accl.sync_from_device(b)
        assert sorted([int(a[0]), int(b[0])]) == [0, 1]


async def test_the_event_loop_runs_while_a_kernel_does() -> None:
    release = threading.Event()

    def hold(_: np.ndarray) -> None:
        if not release.wait(10):
            raise TimeoutError("the event loop never let the kernel go")

    async with aaccl.open_world(1) as (accl,):
        buf = accl.allocate(4)
        run = accl.kernel(hold)(buf)
        assert not run.done()
        release.set()  # only possible because submitting did not wait for the kernel
        await run


async def test_blocked_kernels_hold_back_neither_transfers_nor_other_kernels() -> None:
    """More kernels than a device keeps workers, all blocked: a transfer of another
    buffer and a kernel that meets one submitted after it still run at once."""
    release, met = threading.Event(), threading.Barrier(2, timeout=10)

    def hold(_: np.ndarray) -> None:
        if not release.wait(30):
            raise TimeoutError("never released")

    async with aaccl.open_world(1) as (accl,):
        held = [accl.allocate(4) for _ in range(16)]
        other, one, two = accl.allocate(1000), accl.allocate(1), accl.allocate(1)
        other[:] = np.arange(1000)
        try:
            blocked = [accl.kernel(hold)(buf) for buf in held]
            with anyio.fail_after(10):  # before: behind the 8 workers the kernels hold
                await accl.sync_to_device(other)
                meeting = accl.kernel(lambda _: met.wait())
                await accl.nop(waitfor=[meeting(one), meeting(two)])  # disjoint: unordered
            assert not any(run.done() for run in blocked)  # they still block
            other[:] = 0
            await accl.sync_from_device(other)
            np.testing.assert_array_equal(other, np.arange(1000))
        finally:
            release.set()
        await accl.nop(waitfor=blocked)


# -- failures ------------------------------------------------------------------------------

async def test_a_kernel_that_raises_fails_with_kernel_error_and_its_dependents_never_run() -> None:
    ran: list[str] = []

    def broken(buf: np.ndarray) -> None:
        raise ValueError("no good")

    def note(buf: np.ndarray) -> None:
        ran.append("note")

    async with aaccl.open_world(2, timeout=5) as accls:
        async def rank(accl: aaccl.ACCL) -> None:
            buf = accl.allocate(8)
            bad = accl.kernel(broken)(buf)
            after = accl.kernel(note)(buf, waitfor=[bad])
            reduced = accl.allreduce(buf, buf, 8, ReduceFunction.SUM, waitfor=[after])
            with pytest.raises(DependencyError, match="did not run") as info:
                await reduced
            assert isinstance(info.value.__cause__, KernelError)  # the root: bad's, not after's
            with pytest.raises(KernelError, match=r"kernel broken .* raised ValueError: no good") \
                    as error:
                await bad
            assert isinstance(error.value.__cause__, ValueError)
            assert error.value.__cause__.__traceback__ is not None  # where the kernel raised
            # the rank stays usable
            buf[:] = accl.rank + 1
            await accl.allreduce(buf, buf, 8, ReduceFunction.SUM)
            np.testing.assert_array_equal(buf, 3)

        await run_ranks(accls, rank)
    assert ran == []


class _CodedError(aaccl.ACCLError):  # a constructor that takes more than a message
    def __init__(self, code: int, where: str) -> None:
        super().__init__(f"code {code} at {where}")
        self.code, self.where = code, where


@pytest.mark.parametrize("make", [
    lambda: aaccl.CCLOError("my check", ErrorCode.RECEIVE_TIMEOUT_ERROR, "no data"),
    lambda: _CodedError(7, "stage 2"),
    lambda: aaccl.DeviceError("my own"),
], ids=["CCLOError", "custom", "DeviceError"])
async def test_a_kernel_raising_an_accl_error_fails_its_call_with_that_very_error(make) -> None:
    raised = make()

    def broken(buf: np.ndarray) -> None:
        raise raised

    async with aaccl.open_world(1, timeout=5) as (accl,):
        buf = accl.allocate(4)
        bad = accl.kernel(broken)(buf)
        after = accl.sync_from_device(buf, waitfor=[bad])
        with pytest.raises(type(raised)) as error:
            await bad
        assert error.value is raised  # not rebuilt: type, message and attributes intact
        assert vars(error.value) == vars(raised) and str(error.value) == str(raised)
        note = ["raised by kernel broken (rank 0, call 1)"]
        assert error.value.__notes__ == note  # the context, added without rebuilding it
        assert error.value.__traceback__ is not None
        with pytest.raises(DependencyError) as dependent:
            await after
        assert dependent.value.__cause__ is raised
        with pytest.raises(type(raised)):  # awaited again: the same error, noted once
            await bad
        assert error.value.__notes__ == note
    if isinstance(raised, aaccl.CCLOError):
        assert raised.code == ErrorCode.RECEIVE_TIMEOUT_ERROR and raised.detail == "no data"


async def test_a_kernel_waiting_for_a_failed_cclo_call_never_runs() -> None:
    ran: list[int] = []
    async with aaccl.open_world(2, timeout=0.2) as (a, _):
        buf = a.allocate(4)
        lost = a.recv(buf, 4, 1)  # rank 1 never sends
        after = a.kernel(lambda x: ran.append(1))(buf, waitfor=[lost])
        with pytest.raises(DependencyError):
            await after
        with pytest.raises(aaccl.CCLOError) as error:
            await lost
        assert error.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
        assert ran == []
        await a.kernel(lambda x: ran.append(2))(buf)
        assert ran == [2]


async def test_cancelling_the_awaiting_task_leaves_the_chain_running() -> None:
    release = threading.Event()

    def hold(buf: np.ndarray) -> None:
        if not release.wait(10):
            raise TimeoutError("never released")
        buf += 1

    async with aaccl.open_world(2, timeout=5) as accls:
        async def rank(accl: aaccl.ACCL) -> tuple[aaccl.Call, aaccl.Buffer]:
            src, dst = accl.allocate(6), accl.allocate(6)
            held = accl.kernel(hold)(src)
            summed = accl.allreduce(src, dst, 6, ReduceFunction.SUM, from_fpga=True,
                                    waitfor=[held])
            with anyio.move_on_after(0.05) as scope:  # gives up waiting, not the chain
                await summed
            assert scope.cancelled_caught and not held.done() and not summed.done()
            return summed, dst

        chains = await run_ranks(accls, rank)
        release.set()
        for summed, dst in chains:
            await summed
            np.testing.assert_array_equal(dst, 2)  # each rank's kernel added 1
        # and the ranks stay usable
        async def again(accl: aaccl.ACCL) -> None:
            buf = accl.allocate(6)
            buf[:] = 1
            await accl.allreduce(buf, buf, 6, ReduceFunction.SUM)
            np.testing.assert_array_equal(buf, 2)

        await run_ranks(accls, again)


@pytest.mark.filterwarnings("ignore:Call .* was never awaited:RuntimeWarning")
async def test_closing_waits_for_outstanding_kernels() -> None:
    release = threading.Event()
    finished: list[bool] = []

    def hold(buf: np.ndarray) -> None:
        release.wait(10)
        finished.append(True)

    async with aaccl.open_world(1) as (accl,):
        run = accl.kernel(hold)(accl.allocate(2))

        async def close() -> None:
            await accl.aclose()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(close)
            await anyio.wait_all_tasks_blocked()
            assert not run.done()  # aclose is waiting for it
            release.set()
        assert finished == [True] and run.done()


# -- checks --------------------------------------------------------------------------------

async def test_kernels_and_transfers_take_buffers_of_any_plain_dtype() -> None:
    async with aaccl.open_world(1) as (accl,):
        raw = accl.allocate(6, np.uint8)
        flags = accl.allocate((2, 3), np.bool_)
        raw[:] = np.arange(6)
        up = accl.sync_to_device(raw)
        moved = accl.kernel(lambda r, f: np.greater(r.reshape(2, 3), 2, out=f))(
            raw, flags, waitfor=[up])
        await accl.sync_from_device(flags, waitfor=[moved])
        np.testing.assert_array_equal(flags, [[False, False, False], [True, True, True]])
        with pytest.raises(TypeError, match="holds Python objects"):
            accl.allocate(3, object)
        with pytest.raises(TypeError, match="uint8, which the CCLO does not move"):
            accl.copy(raw, raw, 6)


async def test_bad_kernels_and_arguments_fail_before_anything_runs() -> None:
    ran: list[int] = []
    async with aaccl.open_world(2) as (a, b):
        with pytest.raises(TypeError, match="a kernel is a Python callable"):
            a.kernel(42)
        with pytest.raises(TypeError, match="kernels by name are an overlay's"):
            a.kernel("vadd_1")
        kernel = a.kernel(lambda *args: ran.append(1))
        with pytest.raises(ValueError, match="argument 0 of <lambda> belongs to another rank"):
            kernel(b.allocate(3))
        theirs = b.nop()
        with pytest.raises(ValueError, match="belongs to another rank"):
            kernel(a.allocate(3), waitfor=[theirs])
        await theirs
        with pytest.raises(TypeError, match="waitfor takes Calls"):
            kernel(waitfor=[object()])
        with pytest.raises(TypeError, match="Buffer from ACCL.allocate"):
            a.sync_to_device(np.zeros(3))
        with pytest.raises(ValueError, match="belongs to another rank"):
            a.sync_from_device(b.allocate(3))
        assert ran == []
        await kernel(a.allocate(3), np.zeros(2))  # plain arrays pass as they are
        assert ran == [1]
    with pytest.raises(RuntimeError, match="closed"):
        kernel()
    with pytest.raises(RuntimeError, match="closed"):
        a.kernel(scale)


async def test_kernel_repr_and_names() -> None:
    async with aaccl.open_world(2) as (_, b):
        assert repr(b.kernel(scale)) == "<Kernel scale of rank 1>"
        assert b.kernel(np.add, name="plus").name == "plus"
        run = b.kernel(scale)(b.allocate(1), 2)
        assert run.name.startswith("kernel scale (rank 1, call ")
        await run


# -- tracing -------------------------------------------------------------------------------

async def test_kernels_and_transfers_have_lanes_of_their_own() -> None:
    async with aaccl.open_world(1) as (accl,):
        buf = accl.allocate(16)
        with aaccl.tracing() as trace:
            up = accl.sync_to_device(buf)
            run = accl.kernel(scale)(buf, 2, waitfor=[up])
            await accl.sync_from_device(buf, waitfor=[accl.nop(waitfor=[run])])
        lanes = {(span.engine, span.name) for span in trace.spans if span.engine != "host"}
        assert lanes == {("dma", "sync_to_device"), ("kernel", "kernel scale"),
                         ("cclo", "nop"), ("dma", "sync_from_device")}
        spans = {span.name: span for span in trace.spans if span.engine != "host"}
        assert spans["sync_to_device"].end <= spans["kernel scale"].start
        assert spans["kernel scale"].end <= spans["sync_from_device"].start
