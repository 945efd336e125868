"""Host-resolved dependencies (`start_after`), host jobs (`HostJobs`) and the
device-memory heap, as pure logic.

`start_after` runs on devices that cannot take a wait list (XRT 2.11+, ACCL's
emulator): the dependencies here are plain `DeviceCall`s completed from other
threads, as device completion threads would.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, rule

from aaccl.devices import CallArgs, DeviceCall
from aaccl.devices._heap import Heap
from aaccl.devices._jobs import JOB_WORKERS, HostJobs
from aaccl.devices._hostdeps import start_after


def new_call(tag: int = 0) -> DeviceCall:
    return DeviceCall(CallArgs(255, 0, 0, 0, 0, tag, 0, 0, 0, 0, 0, 0))


class Recorder:
    """A `start` that records each call it gets and the thread it ran on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[tuple[DeviceCall, threading.Thread]] = []

    def __call__(self, call: DeviceCall) -> None:
        with self.lock:
            self.started.append((call, threading.current_thread()))


def completions(call: DeviceCall) -> list[DeviceCall]:
    """Every time `call` completes (a second completion would raise in `complete`)."""
    seen: list[DeviceCall] = []
    call.add_done_callback(seen.append)
    return seen


def on_thread(fn: Callable[[], object]) -> threading.Thread:
    """Run `fn` on a new thread to its end; return the thread (re-raising its error)."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as error:  # surfaced below
            errors.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    if errors:
        raise errors[0]
    return thread


# -- start_after ---------------------------------------------------------------------------

def test_no_dependencies_start_at_once_on_the_callers_thread() -> None:
    call, start = new_call(), Recorder()
    assert start_after(call, [], start) is call
    assert start.started == [(call, threading.current_thread())]
    assert not call.done()  # starting is the device's business; it completes later


def test_all_succeed_start_once_from_the_thread_completing_the_last() -> None:
    deps = [new_call(i) for i in range(3)]
    call, start = new_call(9), Recorder()
    start_after(call, deps, start)
    on_thread(deps[1].complete)
    on_thread(deps[0].complete)
    assert start.started == []
    last = on_thread(deps[2].complete)
    assert start.started == [(call, last)]
    assert not call.done()


@pytest.mark.parametrize("failure", [{"retcode": 0x800}, {"aborted": True},
                                     {"error": RuntimeError("device gone")}])
def test_one_failed_dependency_aborts_once_and_never_starts(failure: dict) -> None:
    deps = [new_call(i) for i in range(3)]
    call, start = new_call(9), Recorder()
    start_after(call, deps, start)
    done = completions(call)
    on_thread(lambda: deps[1].complete(**failure))
    assert call.done() and call.aborted and done == [call]  # while the others are pending
    on_thread(deps[0].complete)
    on_thread(lambda: deps[2].complete(retcode=1))  # a second failure changes nothing
    assert start.started == [] and done == [call]
    assert call.retcode == 0 and call.error is None


def test_failure_of_the_last_dependency_aborts() -> None:
    deps = [new_call(i) for i in range(3)]
    call, start = new_call(9), Recorder()
    start_after(call, deps, start)
    done = completions(call)
    on_thread(deps[0].complete)
    on_thread(deps[1].complete)
    on_thread(lambda: deps[2].complete(retcode=4))
    assert call.aborted and done == [call] and start.started == []


def test_dependencies_done_already() -> None:
    ok = [new_call(i) for i in range(2)]
    for dep in ok:
        dep.complete()
    call, start = new_call(9), Recorder()
    start_after(call, ok, start)
    assert start.started == [(call, threading.current_thread())]

    failed, pending = new_call(1), new_call(2)
    failed.complete(retcode=2)
    call, start = new_call(9), Recorder()
    start_after(call, [pending, failed, *ok], start)
    assert call.aborted  # at once, with a dependency still pending
    on_thread(pending.complete)
    assert start.started == []


def test_the_same_dependency_twice() -> None:
    dep = new_call()
    call, start = new_call(9), Recorder()
    start_after(call, [dep, dep], start)
    on_thread(dep.complete)
    assert len(start.started) == 1


@pytest.fixture
def eager_switching() -> Iterator[None]:
    """Switch threads as often as possible, so that unlocked read-modify-writes race."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def race(deps: list[DeviceCall], retcodes: list[int], call: DeviceCall, start: Recorder,
         register_first: bool) -> list[BaseException]:
    """Complete every dep on its own thread, all released at once, while `start_after`
    registers before (or races with) them; return what the threads raised."""
    gate = threading.Barrier(len(deps) + 1)
    errors: list[BaseException] = []

    def finish(dep: DeviceCall, retcode: int) -> None:
        gate.wait()
        try:
            dep.complete(retcode=retcode)
        except BaseException as error:  # e.g. "device call completed twice"
            errors.append(error)

    threads = [threading.Thread(target=finish, args=pair) for pair in zip(deps, retcodes)]
    for thread in threads:
        thread.start()
    if register_first:
        start_after(call, deps, start)
        gate.wait()
    else:
        gate.wait()
        start_after(call, deps, start)
    for thread in threads:
        thread.join(10)
    assert all(dep.done() for dep in deps)
    return errors


def test_many_concurrent_completions_start_exactly_once(eager_switching: None) -> None:
    for round_ in range(30):
        deps = [new_call(i) for i in range(32)]
        call, start = new_call(99), Recorder()
        assert race(deps, [0] * 32, call, start, register_first=round_ % 2 == 0) == []
        assert len(start.started) == 1, f"round {round_}: started {len(start.started)} times"
        assert not call.done()


def test_concurrent_completions_with_failures_abort_exactly_once(eager_switching: None) -> None:
    for round_ in range(30):
        deps = [new_call(i) for i in range(32)]
        call, start = new_call(99), Recorder()
        done = completions(call)
        retcodes = [1 if i % 5 == round_ % 5 else 0 for i in range(32)]
        assert race(deps, retcodes, call, start, register_first=round_ % 2 == 0) == []
        assert start.started == [] and done == [call] and call.aborted, f"round {round_}"


# -- HostJobs ----------------------------------------------------------------------------

@pytest.fixture
def jobs() -> Iterator[HostJobs]:
    jobs = HostJobs("test-jobs")
    yield jobs
    jobs.close()


def workers(name: str = "test-jobs") -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_a_job_never_waits_for_workers_that_blocked_jobs_hold(jobs: HostJobs) -> None:
    release = threading.Event()
    blocked = [jobs.run(lambda: release.wait(30)) for _ in range(2 * JOB_WORKERS)]
    try:
        transfer = jobs.run(lambda: None)
        assert transfer.block(10) and not transfer.failed  # while all 16 still block
        assert not any(call.done() for call in blocked)
    finally:
        release.set()
    assert all(call.block(10) and not call.failed for call in blocked)


def test_a_job_waiting_for_one_submitted_after_many_blocked_jobs_finishes(
        jobs: HostJobs) -> None:
    release, first, second = threading.Event(), threading.Event(), threading.Event()
    blocked = [jobs.run(lambda: release.wait(30)) for _ in range(JOB_WORKERS)]
    try:
        waiting = jobs.run(lambda: first.wait(30) and second.set())
        setting = jobs.run(first.set)
        assert setting.block(10) and waiting.block(10) and second.is_set()
    finally:
        release.set()
    assert all(call.block(10) for call in blocked)


def test_workers_are_reused_and_idle_ones_beyond_the_keep_end(jobs: HostJobs) -> None:
    release = threading.Event()
    ran_on: set[int] = set()

    def job() -> None:
        ran_on.add(threading.get_ident())
        release.wait(30)

    burst = [jobs.run(job) for _ in range(3 * JOB_WORKERS)]
    release.set()
    assert all(call.block(10) for call in burst)
    assert len(ran_on) == 3 * JOB_WORKERS  # one thread each while they all blocked
    deadline = time.monotonic() + 10  # the extras end once they find the queue empty
    while len(workers()) > JOB_WORKERS and time.monotonic() < deadline:
        workers()[-1].join(0.05)
    assert len(workers()) <= JOB_WORKERS
    again: list[int] = []
    for _ in range(50):  # one at a time: an idle worker takes each, no new thread
        assert jobs.run(lambda: again.append(threading.get_ident())).block(10)
    assert set(again) <= ran_on


def test_a_chain_of_jobs_runs_on_one_thread(jobs: HostJobs) -> None:
    """A job made ready by another's completion is that worker's next job: no
    hand-off to another thread (and no new thread) per link of a chain."""
    go = threading.Event()
    ran_on: list[int] = []

    def link() -> None:
        ran_on.append(threading.get_ident())

    first = jobs.run(lambda: go.wait(30) and link())
    last = first
    for _ in range(20):
        last = jobs.run(link, [last])
    fan = [jobs.run(link, [last]) for _ in range(3)]  # one keeps the thread, two go
    go.set()
    assert all(call.block(10) and not call.failed for call in fan)
    assert len(set(ran_on[:21])) == 1
    assert len(ran_on) == 24


def test_closing_refuses_new_jobs_runs_ready_ones_and_ends_every_worker() -> None:
    jobs = HostJobs("closing-jobs")
    release = threading.Event()
    running = [jobs.run(lambda: release.wait(30)) for _ in range(3)]
    assert jobs.run(lambda: None).block(10)
    jobs.close()
    refused = jobs.run(lambda: None)
    assert refused.block(10) and "closed" in str(refused.error)
    release.set()
    assert all(call.block(10) and not call.failed for call in running)
    for thread in workers("closing-jobs"):
        thread.join(10)
        assert not thread.is_alive()


def test_a_raising_job_fails_its_call_with_its_exception(jobs: HostJobs) -> None:
    error = ValueError("no good")

    def job() -> None:
        raise error

    call = jobs.run(job)
    assert call.block(10) and call.error is error
    assert jobs.run(lambda: None).block(10)  # the worker lives on


# -- Heap ----------------------------------------------------------------------------------

def test_ranges_are_aligned_and_rounded_up() -> None:
    heap = Heap(base=128, size=64 * 100, alignment=64)
    sizes = [0, 1, 63, 64, 65, 200, 1000]
    addresses = [heap.alloc(n) for n in sizes]
    for address, n in zip(addresses, sizes):
        assert address % 64 == 0
        assert heap.size_of(address) == max(64, -(-n // 64) * 64)
    assert addresses[0] == 128  # first fit from the base
    assert heap.in_use == sum(heap.size_of(a) for a in addresses)


def test_default_alignment_is_a_page() -> None:
    heap = Heap()
    a, b = heap.alloc(1), heap.alloc(4097)
    assert a % 4096 == 0 and b == a + 4096 and heap.size_of(b) == 8192


def test_unaligned_base_is_refused() -> None:
    with pytest.raises(ValueError, match="aligned"):
        Heap(base=100, alignment=64)


def test_no_overlap() -> None:
    heap = Heap(base=0, size=64 * 256, alignment=64)
    ranges = sorted((a, a + heap.size_of(a)) for a in (heap.alloc(n) for n in range(1, 600, 37)))
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start


def test_first_fit_reuses_a_freed_range() -> None:
    heap = Heap(base=0, size=64 * 10, alignment=64)
    a, b, c = heap.alloc(64), heap.alloc(128), heap.alloc(64)
    heap.free(b)
    assert heap.alloc(200) == c + 64  # does not fit b's hole
    assert heap.alloc(64) == b  # the first hole that fits
    assert heap.alloc(64) == b + 64
    assert a == 0


def test_free_coalesces_with_both_neighbours() -> None:
    heap = Heap(base=0, size=64 * 4, alignment=64)
    a, b, c, d = (heap.alloc(64) for _ in range(4))
    heap.free(a)
    heap.free(c)
    heap.free(b)  # joins a's range before and c's after
    assert heap.alloc(192) == a
    heap.free(a)
    heap.free(d)  # joins the range before
    assert heap.alloc(256) == 0  # the whole heap in one piece again
    heap.free(0)
    for x in (heap.alloc(64) for _ in range(4)):
        heap.free(x)  # each joins its left neighbour; the last also the right
    assert heap.alloc(256) == 0


def test_free_of_unknown_or_freed_address() -> None:
    heap = Heap(base=0, size=64 * 4, alignment=64)
    a = heap.alloc(64)
    with pytest.raises(ValueError, match="no device allocation"):
        heap.free(a + 64)
    with pytest.raises(ValueError):
        heap.free(a + 1)  # inside an allocation, not its start
    heap.free(a)
    with pytest.raises(ValueError):
        heap.free(a)
    with pytest.raises(KeyError):
        heap.size_of(a)
    assert heap.in_use == 0


def test_memory_error_when_full() -> None:
    heap = Heap(base=64, size=64 * 3, alignment=64)
    with pytest.raises(MemoryError):
        heap.alloc(64 * 3 + 1)
    addresses = [heap.alloc(1) for _ in range(3)]
    with pytest.raises(MemoryError):
        heap.alloc(1)
    heap.free(addresses[1])
    with pytest.raises(MemoryError):
        heap.alloc(65)  # room for 64 bytes, not 128
    assert heap.alloc(64) == addresses[1]
    assert heap.in_use == 3 * 64


def test_threads_never_get_overlapping_ranges() -> None:
    heap = Heap(base=0, size=64 * 4096, alignment=64)
    owned: list[list[int]] = [[] for _ in range(8)]
    gate = threading.Barrier(8)

    def worker(mine: list[int]) -> None:
        gate.wait()
        for i in range(300):
            mine.append(heap.alloc(64 * (1 + i % 3)))
            if i % 2:
                heap.free(mine.pop(0))

    threads = [threading.Thread(target=worker, args=(mine,)) for mine in owned]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    ranges = sorted((a, a + heap.size_of(a)) for mine in owned for a in mine)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))
    assert heap.in_use == sum(end - start for start, end in ranges)


class HeapMachine(RuleBasedStateMachine):
    """Random allocs and frees against a model: the live ranges themselves.

    First fit over a fully coalesced free list means: the lowest gap between live
    ranges that is long enough. Any missed merge or overlap shows up as a different
    address, a spurious MemoryError, or a broken invariant.
    """

    ALIGN, BASE, SIZE = 64, 192, 64 * 32
    addresses = Bundle("addresses")

    def __init__(self) -> None:
        super().__init__()
        self.heap = Heap(base=self.BASE, size=self.SIZE, alignment=self.ALIGN)
        self.live: dict[int, int] = {}

    def first_fit(self, length: int) -> int | None:
        cursor = self.BASE
        for start in sorted(self.live):
            if start - cursor >= length:
                return cursor
            cursor = start + self.live[start]
        return cursor if self.BASE + self.SIZE - cursor >= length else None

    @rule(target=addresses, nbytes=st.integers(0, 64 * 12))
    def alloc(self, nbytes: int) -> object:  # an address, or multiple() for none
        length = max(self.ALIGN, -(-nbytes // self.ALIGN) * self.ALIGN)
        expected = self.first_fit(length)
        if expected is None:
            with pytest.raises(MemoryError):
                self.heap.alloc(nbytes)
            return multiple()
        address = self.heap.alloc(nbytes)
        assert address == expected
        self.live[address] = length
        return address

    @rule(address=consumes(addresses))
    def free(self, address: int) -> None:
        self.heap.free(address)
        del self.live[address]

    @rule(offset=st.integers(0, 64 * 40))
    def free_unknown(self, offset: int) -> None:
        address = self.BASE + offset
        if address not in self.live:
            with pytest.raises(ValueError):
                self.heap.free(address)

    @invariant()
    def ranges_disjoint_aligned_and_in_bounds(self) -> None:
        end = self.BASE
        for start in sorted(self.live):
            assert start >= end and start % self.ALIGN == 0
            assert self.heap.size_of(start) == self.live[start]
            end = start + self.live[start]
        assert end <= self.BASE + self.SIZE
        assert self.heap.in_use == sum(self.live.values())

    def teardown(self) -> None:
        for address in list(self.live):
            self.heap.free(address)
        assert self.heap.alloc(self.SIZE) == self.BASE  # everything merged back


TestHeapMachine = HeapMachine.TestCase
TestHeapMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
