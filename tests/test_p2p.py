"""Point-to-point send/recv on the soft CCLO, checked against numpy.

Covers the semantics DESIGN.md promises: eager sends, flow control when the rx
buffers are full, segmentation, rendezvous, ordering, tag matching, sub-communicators,
timeouts that leave the rank usable, and compression on the wire.
"""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import TAG_ANY, CCLOError, ErrorCode

from conftest import DTYPES, reference_inputs

pytestmark = pytest.mark.anyio

# stack="tcp" (the default) makes every message eager; stack="rdma" sends messages up to
# one rx buffer (BUFSIZE bytes) eager, larger ones rendezvous.
NBUFS, BUFSIZE = 16, 256
QUARTER = BUFSIZE * (NBUFS // 4)  # a message size: a quarter of the rx buffers


def filled(accl: aaccl.ACCL, values: np.ndarray) -> aaccl.Buffer:
    """A buffer of `accl` holding `values`."""
    buf = accl.allocate(values.shape, values.dtype)
    buf[:] = values
    return buf


def message(i: int, count: int, dtype: type = np.float32) -> np.ndarray:
    """The i-th distinct test message of `count` elements."""
    return (np.arange(count) % 97 + 100 * i).astype(dtype)


# -- data and dtypes ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("nbytes", [8, BUFSIZE * 3 - 8, QUARTER * 4],
                         ids=["eager", "segmented", "rendezvous"])
async def test_send_recv_every_dtype(dtype: type, nbytes: int) -> None:
    count = nbytes // np.dtype(dtype).itemsize
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=5) as (a, b):
        data = reference_inputs(0, count, dtype, seed=3)
        src = filled(a, data)
        dst = b.allocate(count + 5, dtype)
        dst[:] = 7
        sent = a.send(src, count, 1)
        await b.recv(dst, count, 0)
        await sent
        assert dst.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(dst[:count], data)
        np.testing.assert_array_equal(dst[count:], 7)  # nothing past `count` is written
        np.testing.assert_array_equal(src, data)  # the sender's data is left alone


async def test_send_recv_zero_elements() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        src, dst = a.allocate(4, np.int32), b.allocate(4, np.int32)
        dst[:] = 9
        sent = a.send(src, 0, 1)
        await b.recv(dst, 0, 0)
        await sent
        np.testing.assert_array_equal(dst, 9)


# -- eager, flow control, segmentation, rendezvous ----------------------------------

async def test_eager_send_completes_before_the_receive_is_posted() -> None:
    # timeout=1: a send that waited for its receive would fail instead of completing.
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=1) as (a, b):
        count = BUFSIZE // 4
        srcs = [filled(a, message(i, count)) for i in range(NBUFS)]  # fills every rx buffer
        for src in srcs:
            await a.send(src, count, 1)
        for src in srcs:  # the data left with the send: changing the source changes nothing
            src[:] = -1
            src.sync_to_device()
        for i in range(NBUFS):
            dst = b.allocate(count, np.float32)
            await b.recv(dst, count, 0)
            np.testing.assert_array_equal(dst, message(i, count))


async def test_segmented_eager_send_completes_before_the_receive_is_posted() -> None:
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=1) as (a, b):
        counts = [BUFSIZE // 8 + 1, QUARTER // 8, BUFSIZE // 8 * 3 - 1]  # 2..4 rx buffers
        for i, count in enumerate(counts):
            await a.send(filled(a, message(i, count, np.float64)), count, 1)
        for i, count in enumerate(counts):
            dst = b.allocate(count, np.float64)
            await b.recv(dst, count, 0)
            np.testing.assert_array_equal(dst, message(i, count, np.float64))


@pytest.mark.parametrize("count", [BUFSIZE // 4 * 2 + 3, QUARTER, QUARTER * 8 + 1])
async def test_large_messages_arrive_whole(count: int) -> None:
    """Larger than one rx buffer (segmented) and larger than the eager threshold."""
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=5) as (a, b):
        data = np.random.default_rng(count).standard_normal(count).astype(np.float32)
        src, dst = filled(a, data), b.allocate(count, np.float32)
        sent = a.send(src, count, 1)
        await b.recv(dst, count, 0)
        await sent
        np.testing.assert_array_equal(dst, data)


async def test_rendezvous_send_completes_only_after_the_receive() -> None:
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=5,
                                stack="rdma") as (a, b):
        count = BUFSIZE // 4 + 1  # one element more than an rx buffer: rendezvous
        src, dst = filled(a, message(1, count)), b.allocate(count, np.float32)
        sent = a.send(src, count, 1)
        with anyio.move_on_after(0.1):
            await sent
        assert not sent.done()
        await b.recv(dst, count, 0)
        await sent
        np.testing.assert_array_equal(dst, message(1, count))


@pytest.mark.parametrize("stack", ["tcp", "udp"])
async def test_an_eager_only_stack_sends_what_the_rx_buffers_hold_without_a_receive(
        stack: str) -> None:
    """As on ACCL's TCP and UDP stacks: "send 16 KiB, await it, then receive" works
    with 16 rx buffers of 1 KiB (on RDMA it would wait for the receive, below)."""
    async with aaccl.open_world(2, nbufs=16, bufsize=1024, timeout=1, stack=stack) as (a, b):
        count = 16 * 1024 // 4
        await a.send(filled(a, message(1, count)), count, 1)
        dst = b.allocate(count, np.float32)
        await b.recv(dst, count, 0)
        np.testing.assert_array_equal(dst, message(1, count))


async def test_on_rdma_the_same_send_waits_for_its_receive() -> None:
    async with aaccl.open_world(2, nbufs=16, bufsize=1024, timeout=0.3, stack="rdma") as (a, b):
        count = 16 * 1024 // 4
        with pytest.raises(CCLOError) as failed:
            await a.send(filled(a, message(1, count)), count, 1)
        assert failed.value.code & ErrorCode.DEQUEUE_BUFFER_TIMEOUT_ERROR
        sent = a.send(filled(a, message(2, count)), count, 1)
        dst = b.allocate(count, np.float32)
        await b.recv(dst, count, 0)
        await sent
        np.testing.assert_array_equal(dst, message(2, count))


async def test_an_eager_message_larger_than_every_rx_buffer_waits_for_its_receive() -> None:
    """Eager, but the rx buffers cannot hold it whole: the send completes once the
    receive takes it (on a card, the network's own buffers may hold more)."""
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=0.3) as (a, b):
        count = NBUFS * BUFSIZE // 4 + 1
        with pytest.raises(CCLOError) as failed:
            await a.send(filled(a, message(1, count)), count, 1)
        assert failed.value.code & ErrorCode.DEQUEUE_BUFFER_TIMEOUT_ERROR
        sent = a.send(filled(a, message(2, count)), count, 1)
        dst = b.allocate(count, np.float32)
        await b.recv(dst, count, 0)
        await sent
        np.testing.assert_array_equal(dst, message(2, count))


def rx_model(nbufs: int, bufsize: int, sizes: list[int], stored_first: int
             ) -> list[set[int]]:
    """Which sends are done after each receive, on a card: the rx buffers take
    messages in arrival order while they have room (one that does not fit stalls
    those behind it; one larger than all of them stays out until its receive takes
    it), a send is done once its message is in the rx buffers or received, and
    receive i frees message i's buffers. `sizes` in bytes; the first `stored_first`
    sit in the rx buffers from the start."""
    slots = [-(-n // bufsize) for n in sizes]
    free = nbufs - sum(slots[:stored_first])
    stored, waiting = set(range(stored_first)), list(range(stored_first, len(sizes)))
    done_after = []
    for i in range(len(sizes)):
        if i in stored:
            free += slots[i]
        else:
            waiting.remove(i)  # its receive took it from the sender
        while waiting and slots[waiting[0]] <= free:
            free -= slots[waiting[0]]
            stored.add(waiting.pop(0))
        done_after.append(stored | set(range(i + 1)))
    return done_after


async def test_flow_control_delivers_everything_in_order() -> None:
    """A send the rx buffers have no room for waits for room, as on a card: freed
    buffers take the waiting messages in order, completing their sends, and no
    message jumps one that waits (one larger than all of them waits for its receive)."""
    # Two rx buffers of 64 bytes (16 float32 each); every message eager (stack="tcp").
    async with aaccl.open_world(2, nbufs=2, bufsize=64, timeout=5) as (a, b):
        counts = [16, 16, 16, 5, 16, 40, 1, 16, 300, 16, 16, 2, 16]
        sends = [a.send(filled(a, message(i, n)), n, 1) for i, n in enumerate(counts[:2])]
        await sends[0]
        await sends[1]  # both fit the rx buffers: eager
        # the rest, submitted at once without awaiting
        sends += [a.send(filled(a, message(i, n)), n, 1) for i, n in enumerate(counts) if i >= 2]
        with anyio.move_on_after(0.1):
            await sends[2]
        assert not sends[2].done()  # no room left: it waits
        expected = rx_model(2, 64, [4 * n for n in counts], stored_first=2)
        for i, n in enumerate(counts):
            dst = b.allocate(n, np.float32)
            await b.recv(dst, n, 0)
            np.testing.assert_array_equal(dst, message(i, n))
            assert {j for j, sent in enumerate(sends) if sent.done()} == expected[i], \
                f"after receive {i}"
        for sent in sends:
            await sent


async def test_a_send_waiting_for_room_completes_when_earlier_messages_are_received() -> None:
    """Rank 0 fills rank 1's rx buffers, then sends B, which has no room; once B's
    send is done it sends C, which rank 1 receives before B. On a card, B's send
    completes as soon as rank 1's receive of the first message frees its buffers;
    were B's send to wait for B's own receive, both ranks would wait forever."""
    async with aaccl.open_world(2, nbufs=2, bufsize=64, timeout=2) as (a, b):
        waiting = anyio.Event()

        async def rank0() -> None:
            await a.send(filled(a, message(0, 32)), 32, 1, tag=1)  # both rx buffers
            sent = a.send(filled(a, message(1, 16)), 16, 1, tag=2)
            assert not sent.done()  # no room
            waiting.set()
            await sent
            await a.send(filled(a, message(2, 16)), 16, 1, tag=3)

        got = []

        async def rank1() -> None:
            await waiting.wait()  # (a receive posted earlier would take A at once)
            for tag, n in ((1, 32), (3, 16), (2, 16)):
                dst = b.allocate(n, np.float32)
                await b.recv(dst, n, 0, tag=tag)
                got.append(np.array(dst))

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(rank1)
            tasks.start_soon(rank0)
        for have, (i, n) in zip(got, ((0, 32), (2, 16), (1, 16))):
            np.testing.assert_array_equal(have, message(i, n))


async def test_flow_control_with_ranks_as_tasks() -> None:
    counts = [16, 3, 64, 16, 16, 200, 16, 8, 16, 1000, 16, 16, 16, 16, 33]
    received: list[np.ndarray] = []

    async def sender(accl: aaccl.ACCL) -> None:
        for i, n in enumerate(counts):
            await accl.send(filled(accl, message(i, n)), n, 1)

    async def receiver(accl: aaccl.ACCL) -> None:
        for n in counts:
            dst = accl.allocate(n, np.float32)
            await accl.recv(dst, n, 0)
            received.append(np.array(dst))

    async with aaccl.open_world(2, nbufs=2, bufsize=64, timeout=5) as (a, b):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(receiver, b)
            tasks.start_soon(sender, a)
    assert len(received) == len(counts)
    for i, (got, n) in enumerate(zip(received, counts)):
        np.testing.assert_array_equal(got, message(i, n))


async def test_blocked_send_does_not_hold_up_other_peers() -> None:
    async with aaccl.open_world(3, nbufs=2, bufsize=64, timeout=5) as (a, b, c):
        blocked = [a.send(filled(a, message(i, 16)), 16, 1) for i in range(4)]
        other = c.allocate(16, np.float32)
        sent = a.send(filled(a, message(9, 16)), 16, 2)
        await c.recv(other, 16, 0)
        await sent
        np.testing.assert_array_equal(other, message(9, 16))
        assert sum(sent.done() for sent in blocked) <= 2  # two rx buffers: the rest wait
        for i in range(4):
            dst = b.allocate(16, np.float32)
            await b.recv(dst, 16, 0)
            np.testing.assert_array_equal(dst, message(i, 16))
        for sent in blocked:
            await sent


# -- ordering and matching --------------------------------------------------------------

@pytest.mark.parametrize("recvs_first", [False, True], ids=["sends-first", "recvs-first"])
async def test_many_messages_one_tag_arrive_in_order(recvs_first: bool) -> None:
    counts = [1, 16, 64, 5, 200, 64, 3, 700, 2, 64] * 4  # eager, segmented and rendezvous mixed
    async with aaccl.open_world(2, nbufs=4, bufsize=128, timeout=5) as (a, b):
        dsts = [b.allocate(n, np.int32) for n in counts]
        srcs = [filled(a, message(i, n, np.int32)) for i, n in enumerate(counts)]

        def post_recvs() -> list[aaccl.Call]:
            return [b.recv(d, n, 0, tag=5) for d, n in zip(dsts, counts)]

        def post_sends() -> list[aaccl.Call]:
            return [a.send(s, n, 1, tag=5) for s, n in zip(srcs, counts)]

        if recvs_first:
            recvs = post_recvs()
            sends = post_sends()
        else:
            sends = post_sends()
            recvs = post_recvs()
        for call in sends + recvs:
            await call
        for i, (dst, n) in enumerate(zip(dsts, counts)):
            np.testing.assert_array_equal(dst, message(i, n, np.int32))


async def test_messages_from_two_senders_keep_their_own_order() -> None:
    async with aaccl.open_world(3, timeout=5) as (a, b, c):
        sends = []
        for i in range(10):
            sends.append(a.send(filled(a, message(i, 8)), 8, 2, tag=1))
            sends.append(b.send(filled(b, message(50 + i, 8)), 8, 2, tag=1))
        for i in range(10):
            from_b, from_a = c.allocate(8, np.float32), c.allocate(8, np.float32)
            await c.recv(from_b, 8, 1, tag=1)
            await c.recv(from_a, 8, 0, tag=1)
            np.testing.assert_array_equal(from_a, message(i, 8))
            np.testing.assert_array_equal(from_b, message(50 + i, 8))
        for sent in sends:
            await sent


async def test_recv_with_a_tag_skips_other_tags() -> None:
    tags = [1, 2, 1, 3, 2, 1]
    async with aaccl.open_world(2, timeout=5) as (a, b):
        for i, tag in enumerate(tags):
            await a.send(filled(a, message(i, 4)), 4, 1, tag=tag)  # eager: all in rx buffers

        async def recv(tag: int) -> np.ndarray:
            dst = b.allocate(4, np.float32)
            await b.recv(dst, 4, 0, tag=tag)
            return np.array(dst)

        np.testing.assert_array_equal(await recv(3), message(3, 4))  # skips 0, 1, 2
        np.testing.assert_array_equal(await recv(2), message(1, 4))
        np.testing.assert_array_equal(await recv(1), message(0, 4))
        np.testing.assert_array_equal(await recv(2), message(4, 4))
        np.testing.assert_array_equal(await recv(1), message(2, 4))
        np.testing.assert_array_equal(await recv(1), message(5, 4))


async def test_posted_recv_with_a_tag_waits_for_its_tag() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        want, other = b.allocate(4, np.float32), b.allocate(4, np.float32)
        r_want = b.recv(want, 4, 0, tag=8)
        await a.send(filled(a, message(0, 4)), 4, 1, tag=9)
        await a.send(filled(a, message(1, 4)), 4, 1, tag=8)
        await r_want
        np.testing.assert_array_equal(want, message(1, 4))
        await b.recv(other, 4, 0, tag=9)
        np.testing.assert_array_equal(other, message(0, 4))


async def test_tag_any_matches_any_tag_in_order() -> None:
    tags = [4, 0, 123456, TAG_ANY - 1, 4]
    async with aaccl.open_world(2, timeout=5) as (a, b):
        sends = [a.send(filled(a, message(i, 6, np.int64)), 6, 1, tag=t)
                 for i, t in enumerate(tags)]
        for i in range(len(tags)):
            dst = b.allocate(6, np.int64)
            await b.recv(dst, 6, 0, tag=TAG_ANY)
            np.testing.assert_array_equal(dst, message(i, 6, np.int64))
        for sent in sends:
            await sent


async def test_send_with_default_tag_matches_a_specific_recv_tag() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        dst = b.allocate(3, np.float32)
        await a.send(filled(a, message(2, 3)), 3, 1)  # tag defaults to TAG_ANY
        await b.recv(dst, 3, 0, tag=17)
        np.testing.assert_array_equal(dst, message(2, 3))


# -- self, sub-communicators --------------------------------------------------------------

@pytest.mark.parametrize("count", [10, QUARTER // 4 * 3])
async def test_send_to_self(count: int) -> None:
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=5) as (a, b):
        src, dst = filled(b, message(3, count)), b.allocate(count, np.float32)
        sent = b.send(src, count, 1, tag=2)
        await b.recv(dst, count, 1, tag=2)
        await sent
        np.testing.assert_array_equal(dst, message(3, count))


async def test_send_to_self_in_a_world_of_one() -> None:
    async with aaccl.open_world(1, timeout=5) as (a,):
        src, dst = filled(a, message(1, 20, np.int64)), a.allocate(20, np.int64)
        await a.send(src, 20, 0)
        await a.recv(dst, 20, 0)
        np.testing.assert_array_equal(dst, message(1, 20, np.int64))


async def test_sub_communicator_renumbers_ranks() -> None:
    async with aaccl.open_world(4, timeout=5) as accls:
        members = [3, 1]  # local rank 0 is global rank 3
        comms = {g: accls[g].split_communicator(members) for g in members}
        g1, g3 = accls[1], accls[3]
        # global 1 -> global 3 twice: once on the world, once on the sub-communicator
        on_world = g1.send(filled(g1, message(0, 8)), 8, 3, tag=1)
        on_sub = g1.send(filled(g1, message(1, 8)), 8, 0, tag=1, comm_id=comms[1])
        sub_dst, world_dst = g3.allocate(8, np.float32), g3.allocate(8, np.float32)
        await g3.recv(sub_dst, 8, 1, tag=1, comm_id=comms[3])  # local rank 1 is global 1
        await g3.recv(world_dst, 8, 1, tag=1)
        await on_world
        await on_sub
        np.testing.assert_array_equal(sub_dst, message(1, 8))
        np.testing.assert_array_equal(world_dst, message(0, 8))
        # and back: local 0 (global 3) -> local 1 (global 1)
        back = g1.allocate(8, np.float32)
        sent = g3.send(filled(g3, message(2, 8)), 8, 1, comm_id=comms[3])
        await g1.recv(back, 8, 0, comm_id=comms[1])
        await sent
        np.testing.assert_array_equal(back, message(2, 8))


async def test_sub_communicator_checks_ranks() -> None:
    async with aaccl.open_world(4, timeout=5) as accls:
        comm = accls[0].split_communicator([0, 2])
        buf = accls[0].allocate(4)
        with pytest.raises(ValueError):
            accls[0].send(buf, 4, 2, comm_id=comm)  # only local ranks 0 and 1 exist
        with pytest.raises(ValueError):
            accls[0].recv(buf, 4, 2, comm_id=comm)
        with pytest.raises(ValueError):
            accls[1].split_communicator([0, 2])  # not a member
        with pytest.raises(ValueError):
            accls[0].send(buf, 4, 1, comm_id=comm + 5)


# -- timeouts -------------------------------------------------------------------------------

async def test_recv_without_a_sender_times_out_and_the_rank_stays_usable() -> None:
    timeout = 0.2
    async with aaccl.open_world(2, timeout=timeout) as (a, b):
        dst = b.allocate(8, np.float32)
        dst[:] = 5
        started = time.monotonic()
        with pytest.raises(CCLOError) as failed:
            await b.recv(dst, 8, 0)
        assert time.monotonic() - started >= timeout * 0.9
        assert failed.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR
        assert "RECEIVE_TIMEOUT_ERROR" in str(failed.value)
        np.testing.assert_array_equal(dst, 5)
        # a message sent now goes to the next receive, not to the one that gave up
        sent = a.send(filled(a, message(4, 8)), 8, 1)
        await b.recv(dst, 8, 0)
        await sent
        np.testing.assert_array_equal(dst, message(4, 8))
        # and the other direction works too
        back = a.allocate(8, np.float32)
        sent = b.send(dst, 8, 0)
        await a.recv(back, 8, 1)
        await sent
        np.testing.assert_array_equal(back, message(4, 8))


async def test_recv_timeout_on_a_sub_communicator() -> None:
    async with aaccl.open_world(3, timeout=0.2) as (a, b, c):
        comm = c.split_communicator([1, 2])
        b.split_communicator([1, 2])
        with pytest.raises(CCLOError) as failed:
            await c.recv(c.allocate(2), 2, 0, comm_id=comm)
        assert failed.value.code & ErrorCode.RECEIVE_TIMEOUT_ERROR


async def test_rendezvous_send_without_a_receiver_fails_and_is_withdrawn() -> None:
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=0.2,
                                stack="rdma") as (a, b):
        count = BUFSIZE // 4 * 2
        with pytest.raises(CCLOError) as failed:
            await a.send(filled(a, message(1, count)), count, 1)
        assert failed.value.code != ErrorCode.COLLECTIVE_OP_SUCCESS
        # the failed message is never delivered: the next receive gets the next message
        dst = b.allocate(count, np.float32)
        sent = a.send(filled(a, message(2, count)), count, 1)
        await b.recv(dst, count, 0)
        await sent
        np.testing.assert_array_equal(dst, message(2, count))


async def test_send_blocked_on_full_rx_buffers_fails_after_the_timeout() -> None:
    async with aaccl.open_world(2, nbufs=2, bufsize=64, timeout=0.2) as (a, b):
        first = [a.send(filled(a, message(i, 16)), 16, 1) for i in range(2)]
        for sent in first:
            await sent
        with pytest.raises(CCLOError):
            await a.send(filled(a, message(2, 16)), 16, 1)  # no room and no receive
        sent = a.send(filled(a, message(3, 16)), 16, 1)
        for i in (0, 1, 3):
            dst = b.allocate(16, np.float32)
            await b.recv(dst, 16, 0)
            np.testing.assert_array_equal(dst, message(i, 16))
        await sent


# -- compression ----------------------------------------------------------------------------

@pytest.mark.parametrize("count", [50, QUARTER])
async def test_compressed_send_recv_rounds_to_float16(count: int) -> None:
    async with aaccl.open_world(2, nbufs=NBUFS, bufsize=BUFSIZE, timeout=5) as (a, b):
        data = np.random.default_rng(7).standard_normal(count).astype(np.float32) * 100
        expected = data.astype(np.float16).astype(np.float32)
        assert not np.array_equal(expected, data)  # the test would show no rounding otherwise
        src, dst = filled(a, data), b.allocate(count, np.float32)
        sent = a.send(src, count, 1, compress_dtype=np.float16)
        await b.recv(dst, count, 0, compress_dtype=np.float16)
        await sent
        np.testing.assert_array_equal(dst, expected)
        np.testing.assert_array_equal(src, data)


async def test_compression_halves_the_bytes_on_the_wire() -> None:
    # 2 rx buffers of 64 bytes: 32 float32 fit only when compressed to float16.
    async with aaccl.open_world(2, nbufs=2, bufsize=64, timeout=1) as (a, b):
        data = np.linspace(-3, 3, 32, dtype=np.float32)
        await a.send(filled(a, data), 32, 1, compress_dtype=np.float16)  # eager: completes
        dst = b.allocate(32, np.float32)
        await b.recv(dst, 32, 0, compress_dtype=np.float16)
        np.testing.assert_array_equal(dst, data.astype(np.float16).astype(np.float32))


async def test_unsupported_compression_is_rejected_before_the_device() -> None:
    async with aaccl.open_world(2, timeout=5) as (a, b):
        with pytest.raises(ValueError):
            a.send(a.allocate(4, np.float64), 4, 1, compress_dtype=np.float16)
        with pytest.raises(ValueError):
            b.recv(b.allocate(4, np.int32), 4, 0, compress_dtype=np.float16)


async def test_a_waits_deadline_ends_with_the_wait() -> None:
    """Receives posted before their sends wait with a deadline, parked in their soft
    CCLO's alarm (a dict entry each): every entry goes when its wait ends, met or
    timed out, so 1,000 waits leave nothing behind."""
    async with aaccl.open_world(2, timeout=0.5) as (a, b):
        k = 1_000
        dst = b.allocate(k, np.float32)
        recvs = [b.recv(dst[i:i + 1], 1, 0, tag=i) for i in range(k)]
        alarm = b._driver.device.alarm
        src = filled(a, np.arange(k, dtype=np.float32))
        sends = [a.send(src[i:i + 1], 1, 1, tag=i) for i in range(k)]
        for call in (*sends, *recvs):
            await call
        np.testing.assert_array_equal(dst, np.arange(k, dtype=np.float32))
        assert not alarm.parked
        with pytest.raises(CCLOError):
            await b.recv(dst[:1], 1, 0, tag=k)  # nobody sends it: its deadline fails it
        assert not alarm.parked


async def test_a_negative_peer_fails_on_the_cclo_instead_of_wrapping_to_the_last_rank() -> None:
    """The API refuses a negative dst; a call that reaches the soft CCLO with one (a
    raw driver call) fails to decode, as one past the communicator does, instead of
    Python's indexing sending it to the last rank."""
    from aaccl._constants import Scenario

    async with aaccl.open_world(3, timeout=0.5) as (a, b, c):
        src = a.allocate(1, np.float32)
        src.sync_to_device()
        for peer in (-1, 3):
            call = a._driver.start(Scenario.SEND, 1, 0, peer, 0, 5, np.dtype(np.float32),
                                   None, None, 0, (src.device_address, 0, 0))
            assert call.block(5)
            assert call.retcode & ErrorCode.DMA_DECODE_ERROR, hex(call.retcode)
        await a.send(src, 1, 2, tag=6)  # the rank goes on
        dst = c.allocate(1, np.float32)
        await c.recv(dst, 1, 0, tag=6)
