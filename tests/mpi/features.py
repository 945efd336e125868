"""The MPI fabric's semantics, one rank per process: point-to-point protocol, matching,
timeouts, sub-communicators, waitfor chains and compression.

    mpiexec -n N python tests/mpi/features.py SUITE [nbufs=.. bufsize=.. timeout=..]

Suites (the options the pytest side passes are in brackets):
  p2p           N >= 2 [nbufs=16 bufsize=256 timeout=1.0, or nbufs=8 bufsize=8192 with
                N == 2, where eager messages are large enough for MPI to read them
                from the sender's memory after the send]: every dtype eager, segmented
                and rendezvous; eager sends that complete before their receive is
                posted; tags, TAG_ANY and in-order matching; two senders' own orders;
                a receive that times out and a rank that stays usable; a rendezvous
                send nobody receives, withdrawn; compression on the wire; send to self.
  flow          N >= 2 [nbufs=2 bufsize=64 timeout=5.0]: flow control: sends beyond the
                receiver's rx buffers wait for it, and everything arrives in order.
  communicators N == 4: split_communicator shapes, side by side and interleaved.
  chains        N == 4: waitfor graphs with from_fpga/to_fpga, one await each.
  compression   N == 4: compress_dtype=float16 on float32, every collective.

Synchronisation between ranks goes through aaccl itself (barriers, messages): a rank
waits for an event, never for a length of time.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from _harness import OPTIONS, Checks, run_suite
from conftest import DTYPES, reference_inputs
from test_chaining import on_device
from test_communicators import DTYPE as COMM_DTYPE
from test_communicators import check_collectives
from test_communicators import data as comm_data
from test_compression import (
    CHUNKED_IN,
    CHUNKED_OUT,
    EPS16,
    F16,
    F32,
    ROOT,
    SIZE,
    half,
    moved_reference,
    reduced_reference,
)
from test_compression import inputs_of as f32_inputs

import aaccl
from aaccl import TAG_ANY, CCLOError, ErrorCode, ReduceFunction

SUM, MAX = ReduceFunction.SUM, ReduceFunction.MAX
SENDER, RECEIVER = 0, 1
GO = 77  # the tag of "you may go on" messages


def message(i: int, count: int, dtype: Any = np.float32) -> np.ndarray:
    """The i-th distinct test message of `count` elements."""
    return (np.arange(count) % 97 + 100 * i).astype(dtype)


def filled(accl: aaccl.ACCL, values: np.ndarray) -> aaccl.Buffer:
    buf = accl.allocate(values.shape, values.dtype)
    buf[:] = values
    return buf


async def receive(accl: aaccl.ACCL, count: int, src: int, dtype: Any = np.float32,
                  **kw: Any) -> np.ndarray:
    dst = accl.allocate(count, dtype)
    await accl.recv(dst, count, src, **kw)
    return np.array(dst)


def same(got: np.ndarray, want: Any, what: str) -> None:
    np.testing.assert_array_equal(got, want, err_msg=what)


async def wait_for_go(accl: aaccl.ACCL, src: int) -> None:
    """Receive `src`'s GO message, which it sends once something on its side has
    timed out (so this receive may time out first: try again, a bounded number of times)."""
    for attempt in range(3):
        try:
            await receive(accl, 1, src, tag=GO)
            return
        except CCLOError as failed:
            if not failed.code & ErrorCode.RECEIVE_TIMEOUT_ERROR or attempt == 2:
                raise


async def send_go(accl: aaccl.ACCL, dsts: list[int]) -> None:
    for dst in dsts:
        await accl.send(filled(accl, message(0, 1)), 1, dst, tag=GO)


# -- point to point ----------------------------------------------------------------------

async def p2p(checks: Checks, accl: aaccl.ACCL) -> None:
    """Run with timeout=1.0 (and nbufs >= 8); ranks past 1 join in some checks."""
    nbufs, bufsize = OPTIONS.get("nbufs", 16), OPTIONS.get("bufsize", 1024)
    window = nbufs // (accl.size - 1)  # rx buffers each sender may fill
    eager_bytes = bufsize * (nbufs // 4)
    rank = accl.rank

    # every dtype: eager (one rx buffer), segmented (three), rendezvous (past eager)
    for dtype in DTYPES:
        for nbytes in (8, bufsize * 3 - 8, eager_bytes * 4):
            count = nbytes // np.dtype(dtype).itemsize
            data = reference_inputs(0, count, dtype, seed=3)
            if rank == SENDER:
                src = filled(accl, data)
                await accl.send(src, count, RECEIVER)
                same(src, data, "the sender's data is left alone")
            elif rank == RECEIVER:
                dst = accl.allocate(count + 5, dtype)
                dst[:] = 7
                await accl.recv(dst, count, SENDER)
                same(dst[:count], data, f"{np.dtype(dtype).name} {nbytes} bytes")
                same(dst[count:], np.full(5, 7, dtype), "nothing past count is written")
            checks()

    # eager sends complete with no receive posted (a send that waited would time out);
    # the window starts empty only once the receiver released the messages above
    # (with stack="tcp" all of them are eager, and the last fills the window)
    await accl.barrier()
    most = min(3, nbufs // 4)  # rx buffers of the largest eager message used here
    phases = [[bufsize // 4] * window,  # one rx buffer each, filling the window
              [bufsize // 8 + 1, bufsize // 8 * most - 1]]  # 2 and `most` rx buffers (float64)
    phases[1] += [1] * (window - 2 - most)
    for phase, counts in enumerate(phases):
        dtype = np.float32 if phase == 0 else np.float64
        if rank == SENDER:
            srcs = [filled(accl, message(i, n, dtype)) for i, n in enumerate(counts)]
            for src, n in zip(srcs, counts):
                await accl.send(src, n, RECEIVER, tag=phase)
                src[:] = -1  # the data left with the send: changing it changes nothing
                src.sync_to_device()
        await accl.barrier()  # the receiver posts its receives only now
        if rank == RECEIVER:
            for i, n in enumerate(counts):
                same(await receive(accl, n, SENDER, dtype, tag=phase), message(i, n, dtype),
                     f"eager message {i} of phase {phase}")
        await accl.barrier()  # every rx buffer acknowledged: the next phase has the window
        checks()

    # matching: a tag skips other tags; TAG_ANY takes any tag, in order
    tags = [1, 2, 1, 3, 2, 1]
    sends = [accl.send(filled(accl, message(i, 4)), 4, RECEIVER, tag=tag)
             for i, tag in enumerate(tags)] if rank == SENDER else []
    await accl.barrier()
    if rank == RECEIVER:
        for tag, i in ((3, 3), (2, 1), (1, 0), (2, 4), (1, 2), (1, 5)):
            same(await receive(accl, 4, SENDER, tag=tag), message(i, 4), f"tag {tag}")
    for sent in sends:
        await sent
    checks()
    anytags = [4, 0, 123456, TAG_ANY - 1, 4]
    if rank == SENDER:
        for i, tag in enumerate(anytags):
            await accl.send(filled(accl, message(i, 6, np.int64)), 6, RECEIVER, tag=tag)
    elif rank == RECEIVER:
        for i in range(len(anytags)):
            same(await receive(accl, 6, SENDER, np.int64, tag=TAG_ANY), message(i, 6, np.int64),
                 f"TAG_ANY message {i}")
    checks()
    # a posted receive with a tag waits for its tag; a TAG_ANY send matches any receive
    if rank == RECEIVER:
        want = accl.allocate(4, np.float32)
        r_want = accl.recv(want, 4, SENDER, tag=8)
        await accl.barrier()
        await r_want
        same(want, message(1, 4), "posted receive with tag 8")
        same(await receive(accl, 4, SENDER, tag=9), message(0, 4), "then tag 9")
        same(await receive(accl, 3, SENDER, tag=17), message(2, 3), "TAG_ANY send")
    else:
        await accl.barrier()
        if rank == SENDER:
            await accl.send(filled(accl, message(0, 4)), 4, RECEIVER, tag=9)
            await accl.send(filled(accl, message(1, 4)), 4, RECEIVER, tag=8)
            await accl.send(filled(accl, message(2, 3)), 3, RECEIVER)
    checks()

    # many messages of one tag, eager, segmented and rendezvous mixed, in order,
    # with the receives posted before and after the sends
    counts = [1, 16, 64, 5, 200, 64, 3, 700, 2, 64] * 3
    for recvs_first in (True, False):
        if rank == SENDER:
            if recvs_first:
                await accl.barrier()
            sends = [accl.send(filled(accl, message(i, n, np.int32)), n, RECEIVER, tag=5)
                     for i, n in enumerate(counts)]
            if not recvs_first:
                await accl.barrier()
            for sent in sends:
                await sent
        elif rank == RECEIVER:
            dsts = [accl.allocate(n, np.int32) for n in counts]
            if not recvs_first:
                await accl.barrier()
            recvs = [accl.recv(d, n, SENDER, tag=5) for d, n in zip(dsts, counts)]
            if recvs_first:
                await accl.barrier()
            for call in recvs:
                await call
            for i, (dst, n) in enumerate(zip(dsts, counts)):
                same(dst, message(i, n, np.int32), f"message {i} (receives first: {recvs_first})")
        else:
            await accl.barrier()
        checks()

    # two senders to one receiver: each sender's messages keep their own order
    if accl.size >= 3:
        if rank in (0, 2):
            sends = [accl.send(filled(accl, message(i + 50 * rank, 8)), 8, RECEIVER, tag=1)
                     for i in range(10)]
            for sent in sends:
                await sent
        elif rank == RECEIVER:
            for i in range(10):
                same(await receive(accl, 8, 2, tag=1), message(i + 100, 8), "from rank 2")
                same(await receive(accl, 8, 0, tag=1), message(i, 8), "from rank 0")
        checks()

    # a receive nobody sends to times out; the rank stays usable and the next message
    # goes to the next receive. Ranks past 1 wait for the receiver to say it timed out.
    timeout, idle = 1.0, list(range(2, accl.size))
    if rank == RECEIVER:
        dst = accl.allocate(8, np.float32)
        dst[:] = 5
        started = time.monotonic()
        try:
            await accl.recv(dst, 8, SENDER, tag=11)
        except CCLOError as failed:
            waited = time.monotonic() - started
            assert failed.code & ErrorCode.RECEIVE_TIMEOUT_ERROR, failed
            assert "RECEIVE_TIMEOUT_ERROR" in str(failed)
            assert timeout * 0.9 <= waited <= timeout * 3, f"timed out after {waited:.2f} s"
        else:
            raise AssertionError("a receive with no sender did not time out")
        same(dst, np.full(8, 5, np.float32), "a timed-out receive writes nothing")
        await send_go(accl, [SENDER] + idle)
        same(await receive(accl, 8, SENDER, tag=11), message(4, 8), "after the timeout")
        await accl.send(filled(accl, message(5, 8)), 8, SENDER)
    elif rank == SENDER:
        await wait_for_go(accl, RECEIVER)  # the receive above has timed out
        await accl.send(filled(accl, message(4, 8)), 8, RECEIVER, tag=11)
        same(await receive(accl, 8, RECEIVER), message(5, 8), "the other direction")
    else:
        await wait_for_go(accl, RECEIVER)
    checks()

    # a send that needs its receive (larger than every rx buffer: it cannot complete
    # eagerly, on any stack) that nobody receives fails and is withdrawn: never delivered
    count = nbufs * bufsize // 4 + 1
    if rank == SENDER:
        try:
            await accl.send(filled(accl, message(1, count)), count, RECEIVER, tag=12)
        except CCLOError as failed:
            assert failed.code != ErrorCode.COLLECTIVE_OP_SUCCESS
        else:
            raise AssertionError("a send larger than the rx buffers, with no receiver, "
                                 "completed")
        await send_go(accl, [RECEIVER] + idle)
        await accl.send(filled(accl, message(2, count)), count, RECEIVER, tag=12)
    elif rank == RECEIVER:
        await wait_for_go(accl, SENDER)  # the send above has failed
        same(await receive(accl, count, SENDER, tag=12), message(2, count),
             "the withdrawn message was not delivered")
    else:
        await wait_for_go(accl, SENDER)
    checks()

    # compression: float16 on the wire, eager and rendezvous
    for count in (50, eager_bytes):
        data = np.random.default_rng(7).standard_normal(count).astype(np.float32) * 100
        if rank == SENDER:
            src = filled(accl, data)
            await accl.send(src, count, RECEIVER, compress_dtype=np.float16)
            same(src, data, "compressed send leaves its source alone")
        elif rank == RECEIVER:
            got = await receive(accl, count, SENDER, compress_dtype=np.float16)
            rounded = data.astype(np.float16).astype(np.float32)
            assert not np.array_equal(rounded, data)
            same(got, rounded, f"compressed message of {count}")
        checks()

    # send to self, eager and rendezvous
    for count in (10, eager_bytes // 4 * 3):
        src = filled(accl, message(3 + rank, count))
        sent = accl.send(src, count, rank, tag=2)
        same(await receive(accl, count, rank, tag=2), message(3 + rank, count), "to self")
        await sent
        checks()
    await accl.barrier()


async def flow(checks: Checks, accl: aaccl.ACCL) -> None:
    """Run with nbufs=2, bufsize=64: the eager threshold is 64 bytes (16 float32), and
    a sender's share of the receiver's rx buffers is 2 // (size - 1) of them."""
    window = 2 // (accl.size - 1)
    counts = [16] * window + [16, 5, 16, 40, 1, 16, 300, 16, 2, 16]
    if accl.rank == SENDER:
        sends = [accl.send(filled(accl, message(i, n)), n, RECEIVER)
                 for i, n in enumerate(counts)]
        for sent in sends[:window]:
            await sent  # they fit the receiver's rx buffers: eager, done without it
        await accl.barrier()  # a round trip: a send that could complete early has
        for i, sent in enumerate(sends[window:]):
            assert not sent.done(), f"send {window + i} completed before its receive"
        await accl.barrier()  # ... and only now does the receiver take anything
        for sent in sends:
            await sent
    elif accl.rank == RECEIVER:
        await accl.barrier()
        await accl.barrier()
        for i, n in enumerate(counts):
            same(await receive(accl, n, SENDER), message(i, n), f"message {i}")
    else:
        await accl.barrier()
        await accl.barrier()
    checks()

    # a send with no room waits for room, as on a card: the receive of the message
    # that filled the window makes room for it, so its sender goes on to send C,
    # which the receiver takes before it (a send that waited for its own receive
    # would leave both ranks waiting)
    if accl.rank == SENDER:
        await accl.send(filled(accl, message(0, 16 * window)), 16 * window, RECEIVER, tag=1)
        sent = accl.send(filled(accl, message(1, 16)), 16, RECEIVER, tag=2)
        await accl.barrier()  # (the receiver takes nothing before it)
        await sent
        await accl.send(filled(accl, message(2, 16)), 16, RECEIVER, tag=3)
    else:
        await accl.barrier()
        if accl.rank == RECEIVER:
            for i, tag, n in ((0, 1, 16 * window), (2, 3, 16), (1, 2, 16)):
                same(await receive(accl, n, SENDER, tag=tag), message(i, n), f"tag {tag}")
    checks()

    # sends blocked on one receiver do not hold up another
    if accl.size >= 3:
        if accl.rank == SENDER:
            blocked = [accl.send(filled(accl, message(i, 16)), 16, RECEIVER) for i in range(4)]
            await accl.send(filled(accl, message(9, 16)), 16, 2)
            await accl.barrier()
            assert sum(sent.done() for sent in blocked) <= window
            await accl.barrier()
            for sent in blocked:
                await sent
        elif accl.rank == 2:
            same(await receive(accl, 16, SENDER), message(9, 16), "past a blocked peer")
            await accl.barrier()
            await accl.barrier()
        else:
            await accl.barrier()
            await accl.barrier()
            if accl.rank == RECEIVER:
                for i in range(4):
                    same(await receive(accl, 16, SENDER), message(i, 16), f"blocked {i}")
        checks()

    # ranks as free-running tasks: the receiver keeps up, everything arrives in order
    counts = [16, 3, 64, 16, 16, 200, 16, 8, 16, 1000, 16, 16, 16, 16, 33]
    if accl.rank == SENDER:
        for i, n in enumerate(counts):
            await accl.send(filled(accl, message(i, n)), n, RECEIVER)
    elif accl.rank == RECEIVER:
        for i, n in enumerate(counts):
            same(await receive(accl, n, SENDER), message(i, n), f"free-running {i}")
    checks()


# -- sub-communicators ---------------------------------------------------------------------

async def communicators(checks: Checks, accl: aaccl.ACCL) -> None:
    assert accl.size == 4, "run with 4 processes"
    rank = accl.rank
    # disjoint pairs, busy at the same time; counts within and past one rx buffer
    members = [[0, 2], [1, 3]][rank % 2]
    pair = accl.split_communicator(members)
    for count in (5, 1500):
        await check_collectives(accl, pair, members, count)
        checks()
    # a subset in a renumbering order, while rank 0 does nothing
    subset = [3, 1, 2]
    if rank in subset:
        await check_collectives(accl, accl.split_communicator(subset), subset, 7)
        checks()
    await accl.barrier()
    # a communicator of one, and the whole world in reverse order
    await check_collectives(accl, accl.split_communicator([rank]), [rank], 6)
    reverse = [3, 2, 1, 0]
    await check_collectives(accl, accl.split_communicator(reverse), reverse, 4)
    checks(2)
    # global and sub-communicator collectives submitted all at once
    count = 9
    src = filled(accl, comm_data(rank, count))
    g_sum, s_sum = accl.allocate(count, COMM_DTYPE), accl.allocate(count, COMM_DTYPE)
    g_bcast = filled(accl, comm_data(rank, count, 1))
    s_bcast = filled(accl, comm_data(rank, count, 2))
    g_gather = accl.allocate(count * 4, COMM_DTYPE)
    s_gather = accl.allocate(count * 2, COMM_DTYPE)
    calls = [accl.allreduce(src, g_sum, count, SUM),
             accl.allreduce(src, s_sum, count, SUM, comm_id=pair),
             accl.bcast(s_bcast, count, 1, comm_id=pair),
             accl.bcast(g_bcast, count, 3),
             accl.allgather(src, s_gather, count, comm_id=pair),
             accl.allgather(src, g_gather, count),
             accl.barrier(comm_id=pair),
             accl.barrier()]
    for call in calls:
        await call
    same(g_sum, sum(comm_data(r, count) for r in range(4)), "global allreduce")
    same(s_sum, sum(comm_data(r, count) for r in members), "pair allreduce")
    same(s_bcast, comm_data(members[1], count, 2), "pair bcast")
    same(g_bcast, comm_data(3, count, 1), "global bcast")
    same(g_gather, np.concatenate([comm_data(r, count) for r in range(4)]), "global allgather")
    same(s_gather, np.concatenate([comm_data(r, count) for r in members]), "pair allgather")
    checks()


# -- waitfor chains -----------------------------------------------------------------------

async def chains(checks: Checks, accl: aaccl.ACCL) -> None:
    assert accl.size == 4, "run with 4 processes"
    rank, size = accl.rank, accl.size

    # copy -> allreduce -> bcast, one await
    n, root = 100, 2
    inputs = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(size)]
    src = filled(accl, inputs[rank])
    staged, reduced = accl.allocate(n), accl.allocate(n)
    copied = accl.copy(src, staged, n, to_fpga=True)
    summed = accl.allreduce(staged, reduced, n, SUM, from_fpga=True, to_fpga=True,
                            waitfor=[copied])
    last = accl.bcast(reduced, n, root, from_fpga=True, waitfor=[summed])
    await last
    assert copied.done() and summed.done()
    same(staged, np.zeros(n, np.float32), "to_fpga leaves the host copy alone")
    same(on_device(staged), inputs[rank], "staged on the device")
    same(reduced, sum(inputs), "copy -> allreduce -> bcast")
    checks()

    # allreduce -> bcast -> copy -> combine, all on the device
    n = 300
    data = [np.random.default_rng([3, r]).integers(-99, 99, n).astype(np.float64)
            for r in range(size)]
    src, red, cpy, out = (accl.allocate(n, np.float64) for _ in range(4))
    src[:] = data[rank]
    a = accl.allreduce(src, red, n, MAX, to_fpga=True)
    if rank == size - 1:
        red[:] = -777  # the host copy is stale: bcast must send the device's
    b = accl.bcast(red, n, size - 1, from_fpga=True, to_fpga=True, waitfor=[a])
    c = accl.copy(red, cpy, n, from_fpga=True, to_fpga=True, waitfor=[b])
    d = accl.combine(n, SUM, red, cpy, out, val1_from_fpga=True, val2_from_fpga=True,
                     waitfor=[c])
    await d
    want = 2 * np.maximum.reduce(data)
    same(out, want, "allreduce -> bcast -> copy -> combine")
    same(cpy, np.zeros(n), "never synced back")
    checks()

    # only the root computes before the bcast
    n, root = 33, 1
    src = filled(accl, np.full(n, rank + 1, np.int64))
    reduced, out = accl.allocate(n, np.int64), accl.allocate(n, np.int64)
    summed = accl.allreduce(src, reduced, n, SUM, to_fpga=True)
    before = [accl.combine(n, SUM, reduced, reduced, out, val1_from_fpga=True,
                           val2_from_fpga=True, to_fpga=True, waitfor=[summed])] \
        if rank == root else [summed]
    await accl.bcast(out, n, root, from_fpga=True, waitfor=before)
    same(out, np.full(n, 2 * (1 + 2 + 3 + 4)), "root-only combine before bcast")
    checks()

    # a diamond of collectives joined by a nop
    n = 16
    src = filled(accl, np.arange(n, dtype=np.int32) + 100 * rank)
    x = accl.allocate(n, np.int32)
    total, gathered = accl.allocate(n, np.int32), accl.allocate(n * size, np.int32)
    top = accl.copy(src, x, n, to_fpga=True)
    left = accl.allreduce(x, total, n, SUM, from_fpga=True, waitfor=[top])
    right = accl.allgather(x, gathered, n, from_fpga=True, waitfor=[top])
    await accl.nop(waitfor=[left, right])
    ins = [np.arange(n, dtype=np.int32) + 100 * r for r in range(size)]
    same(total, sum(ins), "diamond allreduce")
    same(gathered, np.concatenate(ins), "diamond allgather")
    checks()

    # recv -> combine(+1) -> send around the ring, one graph and one await per rank
    n = 8
    token, one = accl.allocate(n, np.int64), filled(accl, np.ones(n, np.int64))
    left_rank, right_rank = (rank - 1) % size, (rank + 1) % size
    if rank == 0:
        sent = accl.send(token, n, right_rank, tag=3)
        last = accl.recv(token, n, left_rank, tag=3, waitfor=[sent])
    else:
        got = accl.recv(token, n, left_rank, tag=3, to_fpga=True)
        bumped = accl.combine(n, SUM, token, one, token, val1_from_fpga=True, to_fpga=True,
                              waitfor=[got])
        last = accl.send(token, n, right_rank, tag=3, from_fpga=True, waitfor=[bumped])
    await last
    if rank == 0:
        same(token, np.full(n, size - 1), "token ring")
    checks()

    # a compressed allreduce feeding a compressed bcast on the device
    n = 50
    src, dst = accl.allocate(n, F32), accl.allocate(n, F32)
    src[:] = f32_inputs(rank, n)
    first = accl.allreduce(src, dst, n, MAX, to_fpga=True, compress_dtype=F16)
    await accl.bcast(dst, n, 2, from_fpga=True, compress_dtype=F16, waitfor=[first])
    same(dst, half(np.max([f32_inputs(r, n) for r in range(size)], axis=0)), "compressed chain")
    checks()


# -- compression ------------------------------------------------------------------------

async def one_op(accl: aaccl.ACCL, op: str, count: int, func: ReduceFunction,
                 compress: bool) -> np.ndarray:
    """This rank's output of `op` on test_compression's inputs."""
    kw: dict[str, Any] = {"compress_dtype": F16} if compress else {}
    n_in = count * (SIZE if op in CHUNKED_IN else 1)
    n_out = count * (SIZE if op in CHUNKED_OUT else 1)
    src = accl.allocate(n_in, F32)
    src[:] = f32_inputs(accl.rank, n_in)
    dst = accl.allocate(n_out, F32)
    dst[:] = np.nan
    if op == "bcast":
        await accl.bcast(src, count, ROOT, **kw)
        return np.array(src)
    if op in ("scatter", "gather"):
        await getattr(accl, op)(src, dst, count, ROOT, **kw)
    elif op == "reduce":
        await accl.reduce(src, dst, count, ROOT, func, **kw)
    elif op in ("allreduce", "reduce_scatter"):
        await getattr(accl, op)(src, dst, count, func, **kw)
    else:
        await getattr(accl, op)(src, dst, count, **kw)
    return np.array(dst)


async def compression(checks: Checks, accl: aaccl.ACCL) -> dict[str, bytes]:
    assert accl.size == SIZE, f"run with {SIZE} processes"
    rank, out = accl.rank, {}
    for count in (7, 3000):  # eager, and past the eager threshold
        for op in ("bcast", "scatter", "gather", "allgather", "alltoall"):
            got = await one_op(accl, op, count, SUM, compress=True)
            plain = await one_op(accl, op, count, SUM, compress=False)
            ref = moved_reference(op, rank, count)
            if ref is not None:
                exact, remote = ref
                what = f"compressed {op} {count}"
                same(plain, exact, what + " (uncompressed)")
                same(got[remote], half(exact)[remote], what + ": float16 from peers")
                np.testing.assert_allclose(got, exact, rtol=EPS16, atol=0, err_msg=what)
                if remote.any():
                    assert np.all(got[remote] != exact[remote]), what + ": not rounded"
            checks()
        for op in ("reduce", "allreduce", "reduce_scatter"):
            for func in (SUM, MAX):
                got = (await one_op(accl, op, count, func, compress=True))[:count]
                plain = (await one_op(accl, op, count, func, compress=False))[:count]
                ref = reduced_reference(op, rank, count, func)
                if ref is not None:
                    exact, rounded = ref
                    what = f"compressed {op} {func.name} {count}"
                    np.testing.assert_allclose(plain, exact, rtol=SIZE * 1e-6, atol=1e-5,
                                               err_msg=what)
                    same(got, half(got), what + ": float16 values")
                    if func == MAX:
                        same(got, rounded, what)
                    else:
                        magnitude = np.abs(rounded) + 8 * SIZE
                        assert np.all(np.abs(got - rounded) <= SIZE * EPS16 * magnitude), what
                    assert np.any(got != plain), what + ": not rounded"
                if op == "allreduce":
                    out[f"{func.name} {count}"] = got.tobytes()
                checks()
    return out


def verify(name: str, results: list[Any]) -> None:
    if name == "compression":  # every rank folds the same float16 values
        for rank, got in enumerate(results):
            assert got == results[0], f"rank {rank}'s compressed allreduce differs from rank 0's"


if __name__ == "__main__":
    run_suite({"p2p": p2p, "flow": flow, "communicators": communicators, "chains": chains,
               "compression": compression}, verify)
