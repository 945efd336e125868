"""Memory stays flat: nothing a message, a collective or an await creates outlives it.

Measured where it shows: the matching queues against a model of MPI's matching
(O(live) entries after any mix), the process's RSS over long send/recv rings of
mixed tags, communicators and sizes, the rx buffers and per-collective records
after rejected and failed collectives, and a call's wakers under cancelled awaits.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Callable

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import TAG_ANY, ACCLError, ReduceFunction, StreamFlags
from aaccl.soft.fabric._matching import PostedRecv, Stream, _Queue
from aaccl.soft.fabric._message import Message
from conftest import wait_until

MiB = 1 << 20
NBUFS, BUFSIZE = 16, 256
SMALL, LARGE = 16, 200  # float32 elements: below one rx buffer, and above it


def rss() -> int:
    """This process's resident set size, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


# -- the matching queues, against a model of MPI's matching -----------------------------------

class Model:
    """MPI's matching written plainly: lists, oldest first, searched from the front."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.recvs: list[PostedRecv] = []

    def arrive(self, msg: Message) -> tuple[PostedRecv, Message] | None:
        recv = next((r for r in self.recvs if TAG_ANY in (r.tag, msg.tag)
                     or r.tag == msg.tag), None)
        if recv is None:
            self.messages.append(msg)
            self.messages.sort(key=lambda m: m.seq)
            return None
        self.recvs.remove(recv)
        return recv, msg

    def post(self, recv: PostedRecv) -> Message | None:
        msg = next((m for m in self.messages if TAG_ANY in (recv.tag, m.tag)
                    or m.tag == recv.tag), None)
        if msg is None:
            self.recvs.append(recv)
        else:
            self.messages.remove(msg)
        return msg


def bounded(queue: _Queue) -> None:
    """A queue's entries are counted right and O(live)."""
    held = len(queue.all) + sum(len(q) for q in queue.by_tag.values())
    assert queue.entries == held
    assert held <= 4 * len(queue.live) + 8
    assert all(queue.by_tag.values()), "a tag's queue stays after it emptied"


@pytest.mark.parametrize("seed", range(6))
def test_stream_matches_as_mpi_and_holds_o_live_entries(seed: int) -> None:
    """Any mix of arrivals, receives (by tag and TAG_ANY, from both sides), cancelled
    receives, withdrawn messages and receives that give their message back."""
    rng = random.Random(seed)
    tags = [0, 1, 2, 7, 1000 + seed] + [TAG_ANY]
    stream, model = Stream(), Model()
    seq = order = 0
    posted: list[PostedRecv] = []  # unmatched receives
    waiting: list[Message] = []  # unmatched messages
    matched: list[tuple[PostedRecv, Message]] = []  # matched, their receive not run yet
    for step in range(6000):
        what = rng.random()
        if what < 0.35:
            msg = Message(0, ("p2p", 0), seq, rng.choice(tags[:-1] if rng.random() < 0.9
                                                        else tags), None, eager=True)
            seq += 1
            got, want = stream.arrive(msg), model.arrive(msg)
            assert list(got) == ([] if want is None else [want])
            if want is None:
                waiting.append(msg)
            else:
                posted.remove(want[0])
                matched.append(want)
        elif what < 0.7:
            recv = PostedRecv(rng.choice(tags), order, 0)
            order += 1
            got, want = stream.post(recv), model.post(recv)
            assert got is want
            if want is None:
                posted.append(recv)
            else:
                waiting.remove(want)
                matched.append((recv, want))
        elif what < 0.8 and matched:  # a matched receive runs: both are done
            matched.pop(rng.randrange(len(matched)))
        elif what < 0.87 and posted:
            recv = posted.pop(rng.randrange(len(posted)))
            stream.cancel(recv)
            model.recvs.remove(recv)
        elif what < 0.93 and waiting:
            msg = waiting.pop(rng.randrange(len(waiting)))
            assert stream.withdraw(msg)
            model.messages.remove(msg)
        elif matched:  # a receive that will not run gives its message back
            _, msg = matched.pop(rng.randrange(len(matched)))
            got_pair = stream.unmatch(msg)
            want_pair = model.arrive(msg)
            assert got_pair == want_pair
            if want_pair is None:
                waiting.append(msg)
            else:
                posted.remove(want_pair[0])
                matched.append(want_pair)
        bounded(stream._messages)
        bounded(stream._recvs)
        assert len(stream._messages.live) == len(model.messages) == len(waiting)
        assert len(stream._recvs.live) == len(model.recvs) == len(posted)


PATTERNS = {  # tag of the i-th item, and the tag the i-th lookup asks for
    "by tag": (lambda i: i % 3, lambda i: i % 3),
    "TAG_ANY": (lambda i: i % 3, lambda i: TAG_ANY),
    "alternating": (lambda i: i % 3, lambda i: TAG_ANY if i % 2 else i % 3),
    "fresh tags by tag": (lambda i: 10 + i, lambda i: 6 + i),
    "fresh tags, TAG_ANY": (lambda i: 10 + i, lambda i: TAG_ANY),
}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_queue_holds_no_dead_entries_across_a_long_run(pattern: str) -> None:
    """A queue never empty (a few items stay live all along) whose lookups go by tag
    (which never trims the queue of all) or TAG_ANY (which never trims the tags'
    queues): it holds O(live) entries all along, and matches as the model does."""
    tag_of, take_of = PATTERNS[pattern]
    queue: _Queue[PostedRecv] = _Queue()
    model: list[PostedRecv] = []
    for i in range(20_000):
        item = PostedRecv(tag_of(i), i, 0)
        queue.add(item)
        model.append(item)
        if i >= 4:
            take = take_of(i)
            want = next((r for r in model if take in (TAG_ANY, r.tag)), None)
            assert queue.pop_oldest(take) is want
            if want is not None:
                model.remove(want)
        bounded(queue)
    assert sorted(queue.live, key=lambda r: r.order) == model


def test_queue_rebuild_keeps_the_matching_order() -> None:
    """Many live items, most of the queue dead: a rebuild keeps each tag's order and
    the order across tags."""
    queue: _Queue[PostedRecv] = _Queue()
    items = [PostedRecv(i % 4, i, 0) for i in range(400)]
    for i, item in enumerate(items):
        queue.add(item)
    left = [item for i, item in enumerate(items) if i % 8 in (1, 6)]
    for item in items:  # most go through `remove` (cancelled receives): a rebuild
        if item not in left:
            assert queue.remove(item)
            bounded(queue)
    assert not queue.remove(items[0])
    assert queue.entries < 2 * len(items)  # rebuilt on the way
    out = [queue.pop_oldest(TAG_ANY if k % 3 == 0 else left[k].tag) for k in range(len(left))]
    # tags alternate 1, 2, 1, 2...: by tag or TAG_ANY, each takes the oldest left
    assert out == left
    assert not queue.live and queue.entries <= 8


# -- send/recv rings: RSS flat -----------------------------------------------------------------

def two_comms(accls: list[aaccl.ACCL], n: int | None = None) -> dict[int, tuple[int, int]]:
    """Each rank's world communicator and one of the same `n` ranks in reverse order."""
    n = len(accls) if n is None else n
    return {a.rank: (aaccl.GLOBAL_COMM, a.split_communicator(list(range(n))[::-1]))
            for a in accls}


async def ring_rank(accl: aaccl.ACCL, n: int, comms: tuple[int, int], rounds: int,
                    window: int, warmup: int, measure: list[int], large: int = LARGE,
                    mixed: bool = True) -> None:
    """One rank's part of `ring` (of `n` ranks); its RSS after `warmup` rounds goes
    into `measure` (rank 0's alone)."""
    srcs = {c: accl.allocate(c, np.float32) for c in (SMALL, large)}
    dsts = [accl.allocate(large, np.float32) for _ in range(window)]
    for r in range(rounds):
        if r == warmup and accl.rank == 0:
            measure.append(rss())
        which = r % 2
        comm = comms[which]
        me = accl.rank if which == 0 else n - 1 - accl.rank
        nxt, prv = (me + 1) % n, (me - 1) % n
        count = large if r % 4 >= 2 else SMALL
        src = srcs[count]
        src[:] = r * 100 + accl.rank
        if mixed:  # specific receives first, TAG_ANY after: each has its message
            send_tags = [TAG_ANY if k % 5 == 4 else k % 3 for k in range(window)]
            recv_tags = [k % 3 for k in range(window) if k % 5 != 4 and k % 2 == 0]
            recv_tags += [TAG_ANY] * (window - len(recv_tags))
        else:  # by tag alone: nothing ever looks at the queue of all
            send_tags = recv_tags = [k % 3 for k in range(window)]
        calls = [accl.send(src, count, nxt, tag=t, comm_id=comm) for t in send_tags]
        calls += [accl.recv(dsts[k], count, prv, tag=t, comm_id=comm)
                  for k, t in enumerate(recv_tags)]
        for call in calls:
            await call
        sender = prv if which == 0 else n - 1 - prv  # its global rank
        got = np.stack([dst[:count] for dst in dsts])
        assert (got == r * 100 + sender).all(), f"round {r}: {got}"


async def ring(accls: list[aaccl.ACCL], rounds: int, window: int,
               measure: list[int], warmup: int,
               comms: dict[int, tuple[int, int]] | None = None, mixed: bool = True) -> None:
    """Each round, every rank sends `window` messages to the next rank and receives
    as many from the previous one, un-awaited, on the world's communicator or a
    reversed one, small (eager) or large (over an rx buffer), tags specific or
    (`mixed`) TAG_ANY on either side; checks every receive's data. RSS after
    `warmup` rounds and at the end go into `measure`."""
    comms = comms or two_comms(accls)
    async with anyio.create_task_group() as tasks:
        for accl in accls:
            tasks.start_soon(ring_rank, accl, len(accls), comms[accl.rank], rounds, window,
                             warmup, measure, LARGE, mixed)
    measure.append(rss())


@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ring_over_mpi_keeps_memory_flat(nprocs: int) -> None:
    """Over MPI the receiver holds its own copy of a payload: it goes with its
    message (tests/mpi/matching.py: every rank's RSS grows by under 8 MiB)."""
    pytest.importorskip("mpi4py")
    from test_mpi_fabric import MPIEXEC, assert_passed, launch
    if MPIEXEC is None:
        pytest.skip("no mpiexec (pip install 'aaccl[mpi]')")
    assert_passed(launch(nprocs, "matching.py", "ring"), nprocs)


def queues_bounded(accls: list[aaccl.ACCL]) -> None:
    """Every matching queue of every rank is empty of live items, and of dead ones
    but a few."""
    for accl in accls:
        for stream in accl._driver.device.inbox._streams.values():
            for queue in (stream._messages, stream._recvs):
                bounded(queue)
                assert not queue.live and queue.entries <= 8
            assert not stream.early


@pytest.mark.anyio
@pytest.mark.parametrize("stack, mixed", [("tcp", True), ("rdma", False)],
                         ids=["tcp-mixed tags", "rdma-by tag"])
async def test_ring_keeps_memory_flat(stack: str, mixed: bool) -> None:
    """About 7,000 messages on 3 ranks: the queues hold no matched message, and RSS
    grows by under 4 MiB after warm-up."""
    measure: list[int] = []
    async with aaccl.open_world(3, nbufs=NBUFS, bufsize=BUFSIZE, stack=stack,
                                timeout=10) as accls:
        with anyio.fail_after(60):
            await ring(accls, rounds=240, window=10, measure=measure, warmup=40,
                       mixed=mixed)
        queues_bounded(accls)
    grew = measure[1] - measure[0]
    assert grew < 4 * MiB, f"RSS grew by {grew / MiB:.1f} MiB over the ring"


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_60000_message_ring_keeps_memory_flat(anyio_backend: str) -> None:
    """60,000 messages on 2 ranks, by tag alone: RSS grows by under 10 MiB after
    warm-up (the queues kept every message before). For longer runs, run this file."""
    measure: list[int] = []
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=10) as accls:
        with anyio.fail_after(120):
            await ring(accls, rounds=600, window=50, measure=measure, warmup=40, mixed=False)
        queues_bounded(accls)
    grew = measure[1] - measure[0]
    assert grew < 10 * MiB, f"RSS grew by {grew / MiB:.1f} MiB over the ring"


# -- collectives: rx buffers and records end with their collective ----------------------------

def records(accls: list[aaccl.ACCL]) -> dict[str, int]:
    """How many per-collective records the ranks' inboxes and their fabric hold."""
    counts = {"steps": 0, "step_waits": 0, "seen": 0, "failed": 0, "members": 0}
    for accl in accls:
        inbox = accl._driver.device.inbox
        for name in counts:
            # (the members are read in line on the small-call path: a public name)
            counts[name] += len(getattr(inbox, "members" if name == "members" else f"_{name}"))
    fabric = accls[0]._driver.device.port.fabric
    counts["roll"] = len(fabric.roll)  # (every collective's entry, its meeting)
    return counts


def rx_free(accl: aaccl.ACCL) -> int:
    """The rx buffers the exchange memory lists as free (status 0), checked against
    the inbox's pool."""
    from aaccl import _exchmem as xm
    device = accl._driver.device
    free = sum(device.mmio_read(xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * i) == 0
               for i in range(NBUFS))
    assert len(device.inbox.rx.free) == free
    return free


@pytest.mark.anyio
async def test_rejected_collectives_free_the_rx_buffers_they_were_sent() -> None:
    """100 bcasts and small allreduces that rank 1's host rejects (before or after
    the root's data came): afterwards an eager send to rank 1 completes on its own,
    every rx buffer is free again, and no record of those collectives is left."""
    timeout = 5.0
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=timeout) as (a, b):
        buf = {r.rank: r.allocate(SMALL, np.float32) for r in (a, b)}
        out = {r.rank: r.allocate(SMALL, np.float32) for r in (a, b)}
        too_small = b.allocate(1, np.float32)
        with anyio.fail_after(30):
            for i in range(100):
                def good() -> aaccl.Call:
                    if i % 4 < 2:
                        return a.bcast(buf[0], SMALL, root=0)
                    return a.allreduce(buf[0], out[0], SMALL, ReduceFunction.SUM)

                def rejected() -> None:
                    with pytest.raises(ValueError, match="holds 1 elements"):
                        if i % 4 < 2:
                            b.bcast(too_small, SMALL, root=0)
                        else:
                            b.allreduce(too_small, out[1], SMALL, ReduceFunction.SUM)

                if i % 2:  # the root's data comes first, or the rejection
                    call = good()
                    rejected()
                else:
                    rejected()
                    call = good()
                try:  # a root's bcast may be over (its data in rank 1's rx buffers) first
                    await call
                except ACCLError as error:
                    assert "rank 1 rejected" in str(error)
            # nobody receives yet: the send completes as the data is in rank 1's rx buffers
            src = a.allocate(SMALL, np.float32)
            src[:] = np.arange(SMALL)
            await a.send(src, SMALL, 1, tag=5)
            assert rx_free(b) == NBUFS - 1
            await b.recv(out[1], SMALL, 0, tag=5)
            np.testing.assert_array_equal(out[1], np.arange(SMALL))
            # and the communicator's collectives go on, numbered alike on both ranks
            await run_both(a, b, lambda r: r.bcast(buf[r.rank], SMALL, root=0))
        assert rx_free(a) == rx_free(b) == NBUFS
        assert records([a, b]) == dict.fromkeys(records([a, b]), 0)


async def run_both(a: aaccl.ACCL, b: aaccl.ACCL, submit) -> None:
    calls = [submit(a), submit(b)]
    for call in calls:
        await call


# (the reduce reads on the host what the bcast writes: only the records count here)
@pytest.mark.filterwarnings("ignore:this .* reads its input from host memory:RuntimeWarning")
@pytest.mark.anyio
async def test_records_end_with_their_collectives() -> None:
    """Collectives that succeed, fail on a mismatch, or are rejected by one host, on
    the world's communicator and a sub-communicator, small (meeting in shared
    memory) and large: once all ended, no inbox or fabric holds a record of any."""
    async with aaccl.open_world(3, nbufs=NBUFS, bufsize=BUFSIZE, timeout=5) as accls:
        sub = {a.rank: a.split_communicator([2, 0]) for a in accls if a.rank != 1}

        async def rank(accl: aaccl.ACCL) -> None:
            small = accl.allocate(SMALL, np.float32)
            other = accl.allocate(LARGE * 4, np.float32)
            large_src = accl.allocate(LARGE * 4, np.float32)
            large_dst = accl.allocate(LARGE * 4, np.float32)
            for i in range(30):
                small[:] = 1
                large_src[:] = accl.rank + i
                calls = [accl.allreduce(small, small, SMALL, ReduceFunction.SUM),
                         accl.allreduce(large_src, large_dst, LARGE * 4, ReduceFunction.SUM),
                         accl.bcast(large_src, LARGE * 4, root=i % 3)]
                # a count mismatch: every rank's call fails
                calls.append(accl.allreduce(other, other, LARGE * 4 - (accl.rank == 2),
                                            ReduceFunction.SUM))
                if accl.rank in sub:
                    calls.append(accl.reduce(large_src, large_dst, LARGE, 0, ReduceFunction.MAX,
                                             comm_id=sub[accl.rank]))
                    if accl.rank == 2:
                        with pytest.raises(ValueError):
                            accl.bcast(small, SMALL, root=5, comm_id=sub[accl.rank])
                    else:
                        calls.append(accl.bcast(small, SMALL, root=0, comm_id=sub[accl.rank]))
                for k, call in enumerate(calls):
                    if k < 3 or k == 4:
                        await call
                    else:
                        with pytest.raises(ACCLError):
                            await call
                assert (small == 3).all()
                assert (large_src == i % 3 + i).all()  # the bcast's root's
                assert (large_dst[LARGE:] == 3 * i + 3).all()  # the allreduce's sum

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tasks:
                for accl in accls:
                    tasks.start_soon(rank, accl)
        assert records(accls) == dict.fromkeys(records(accls), 0)
        for accl in accls:
            assert rx_free(accl) == NBUFS


# -- a finished call ----------------------------------------------------------------------------

@pytest.mark.anyio
async def test_a_finished_call_is_held_by_nothing_once_dropped() -> None:
    """A call is one object from the device to the user: once it ended and the user
    let go of it, nothing keeps it (no device's last call, no stream's turn, no
    message order's last collective), so its memory goes and an unused one warns
    at once. Every kind of call, each one's last reference dropped in turn."""
    # (a device thread that completed a call lets go once its job returned: waited for)
    async with aaccl.open_world(2, timeout=5) as (a, b):
        src, dst = a.allocate(8, np.float32), a.allocate(16, np.float32)
        peer_src, peer_dst = b.allocate(8, np.float32), b.allocate(16, np.float32)
        stream = StreamFlags.RES_STREAM

        sum_ = ReduceFunction.SUM
        makers: list[Callable[[], tuple[aaccl.Call, aaccl.Call | None]]] = [
            lambda: (a.nop(), None),
            lambda: (a.copy(src, dst, 8), None),
            lambda: (a.combine(8, sum_, src, src, dst), None),
            lambda: (a.copy(src, dst, 8, stream_flags=stream), None),
            lambda: (a.copy(src, dst, 8, stream_flags=StreamFlags.OP0_STREAM), None),
            lambda: (a.kernel(lambda x: None)(src), None),
            lambda: (a.sync_to_device(src), None),
            lambda: (a.send(src, 8, 1, tag=4), b.recv(peer_src, 8, 0, tag=4)),
            lambda: (a.allreduce(src, dst, 1, sum_), b.allreduce(peer_src, peer_dst, 1, sum_)),
            lambda: (a.allreduce(src, dst, 8, sum_), b.allreduce(peer_src, peer_dst, 8, sum_)),
            lambda: (a.bcast(src, 8, 0), b.bcast(peer_src, 8, 0)),
            lambda: (a.allgather(src, dst, 8), b.allgather(peer_src, peer_dst, 8)),
            lambda: (a.barrier(), b.barrier()),
        ]

        for make in makers:
            mine, theirs = make()
            await mine
            if theirs is not None:
                await theirs
            gone = weakref.ref(mine)
            del mine, theirs
            await wait_until(lambda: gone() is None)


def test_a_finished_call_on_the_emulator_protocol_is_held_by_nothing() -> None:
    """The same on a device whose calls run one at a time on its own thread (ACCL's
    emulator protocol, faked): that thread lets go of a call once it ended."""
    pytest.importorskip("zmq", reason="the emulator device needs pyzmq")
    from test_emulator_protocol import FakeEmulator

    fake = FakeEmulator()

    async def main(accl: aaccl.ACCL) -> None:
        src, dst = accl.allocate(8, np.float32), accl.allocate(8, np.float32)
        for make in (lambda: accl.copy(src, dst, 8), lambda: accl.nop(),
                     lambda: accl.sync_to_device(src)):
            call = make()
            await call
            gone = weakref.ref(call)
            del call
            await wait_until(lambda: gone() is None)

    try:
        aaccl.run(main, 1, device="emulator", emulator_port=fake.port, timeout=5)
    finally:
        fake.close()


# -- a call's wakers ---------------------------------------------------------------------------

@pytest.mark.anyio
async def test_cancelled_awaits_leave_no_waker() -> None:
    """A call awaited again and again under a timeout that fires: its wakers do not
    pile up (nor under `wait(timeout)` from a thread), and it still completes."""
    async with aaccl.open_world(2, timeout=30) as (a, b):
        dst = b.allocate(4, np.float32)
        recv = b.recv(dst, 4, 0, tag=1)
        for _ in range(20_000):
            with anyio.move_on_after(0):
                await recv
            assert not recv._wakers
        for _ in range(50):
            with pytest.raises(TimeoutError):
                await anyio.to_thread.run_sync(recv.wait, 0.0001)
        assert not recv._wakers
        # two tasks await it at once; one gives up, the other still wakes
        woke = threading.Event()

        async def patient() -> None:
            await recv
            woke.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(patient)
            with anyio.move_on_after(0.01):
                await recv
            src = a.allocate(4, np.float32)
            src[:] = 3
            await a.send(src, 4, 1, tag=1)
        assert woke.is_set() and not recv._wakers
        np.testing.assert_array_equal(dst, 3)


@pytest.mark.slow
@pytest.mark.anyio
async def test_100000_cancelled_awaits_leave_no_waker() -> None:
    async with aaccl.open_world(2, timeout=60) as (a, b):
        dst = b.allocate(4, np.float32)
        recv = b.recv(dst, 4, 0, tag=1)
        for _ in range(100_000):
            with anyio.move_on_after(0):
                await recv
        assert not recv._wakers
        src = a.allocate(4, np.float32)
        await a.send(src, 4, 1, tag=1)
        await recv


async def _collectives(accls: list[aaccl.ACCL], times: int) -> None:
    """Small and large allreduces, bcasts, and a bcast the last rank rejects."""
    async def rank(accl: aaccl.ACCL) -> None:
        small, large = accl.allocate(SMALL, np.float32), accl.allocate(LARGE * 4, np.float32)
        for i in range(times):
            calls = [accl.allreduce(small, small, SMALL, ReduceFunction.SUM),
                     accl.allreduce(large, large, LARGE * 4, ReduceFunction.MAX),
                     accl.bcast(large, LARGE * 4, root=i % len(accls))]
            for call in calls:
                await call
            if accl.rank == len(accls) - 1:
                with pytest.raises(ValueError):
                    accl.bcast(small, SMALL, root=len(accls))
            else:
                try:
                    await accl.bcast(small, SMALL, root=0)
                except ACCLError:
                    pass

    async with anyio.create_task_group() as tasks:
        for accl in accls:
            tasks.start_soon(rank, accl)


async def _watch(seconds: float, ranks: int) -> None:
    """The mixed ring and collectives for `seconds`, RSS every 10 s (a run by hand)."""
    import time
    async with aaccl.open_world(ranks, nbufs=NBUFS, bufsize=BUFSIZE, timeout=10) as accls:
        comms, began, rounds, last = two_comms(accls), time.monotonic(), 0, 0.0
        while time.monotonic() - began < seconds:
            measure: list[int] = []
            await ring(accls, rounds=200, window=10, measure=measure, warmup=0, comms=comms,
                       mixed=rounds % 400 == 0)
            await _collectives(accls, 20)
            rounds += 200
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                print(f"{last - began:6.0f} s  {rounds * 10 * ranks:9,} messages  "
                      f"{rounds // 10 * 4:7,} collectives  RSS {rss() / MiB:7.1f} MiB  "
                      f"records {sum(records(accls).values())}", flush=True)


if __name__ == "__main__":  # python tests/test_memory.py [seconds [ranks]]
    import sys
    anyio.run(_watch, float(sys.argv[1]) if len(sys.argv) > 1 else 180,
              int(sys.argv[2]) if len(sys.argv) > 2 else 3)


def test_freeing_device_memory_does_not_scan_every_allocation() -> None:
    """Freeing one of n live allocations looks its base up by bisection: list.remove
    compared it with every base before it, so freeing the buffers of 20,000
    outstanding calls (40,000 allocations) took time n**2, longer than the calls."""
    from aaccl.soft._memory import DeviceMemory

    compared = [0]

    class Counted(int):  # its comparisons run first: it subclasses the bases' int
        def __eq__(self, other: object) -> bool:
            compared[0] += 1
            return int(self) == other

        def __lt__(self, other: int) -> bool:
            compared[0] += 1
            return int(self) < other

        def __gt__(self, other: int) -> bool:
            compared[0] += 1
            return int(self) > other

        __hash__ = int.__hash__

    memory = DeviceMemory()
    addresses = [memory.alloc(8) for _ in range(10_000)]
    memory.free(Counted(addresses[-1]))
    assert compared[0] < 100, compared[0]
    for address in addresses[:-1:2]:
        memory.free(address)
    with pytest.raises(KeyError):
        memory.view(addresses[0], 8)
    assert memory.view(addresses[1], 8).nbytes == 8


def test_a_buffer_of_a_closed_rank_says_so_when_synced() -> None:
    """Once its rank closed (its device memory released), a Buffer's syncs raise,
    instead of copying nothing, or another program's memory on a card; its host
    elements stay readable. A call still outstanding when the world closes syncs its
    result in as before: the rank releases its memory after its calls ended."""
    import anyio

    import aaccl

    async def main() -> tuple[aaccl.Buffer, aaccl.Buffer]:
        async with aaccl.open_world(2) as accls:
            srcs = [a.allocate(4) for a in accls]
            dsts = [a.allocate(4) for a in accls]
            for a, s in zip(accls, srcs):
                s[:] = a.rank + 1
            calls = [a.allreduce(s, d, 4, aaccl.ReduceFunction.SUM)  # (awaited by closing)
                     for a, s, d in zip(accls, srcs, dsts)]
            for call in calls:
                call._used = True  # (left to the world's closing on purpose)
        return srcs[0], dsts[0]

    src, dst = anyio.run(main)
    assert dst.tolist() == [3.0] * 4  # synced in while the world closed
    for sync in (src.sync_to_device, dst.sync_from_device, dst[1:3].sync_to_device):
        with pytest.raises(RuntimeError, match="is closed: its device memory is released"):
            sync()
    assert src.tolist() == [1.0] * 4
