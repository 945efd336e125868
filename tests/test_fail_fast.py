"""Failures that are fast, consistent and explained (in process; tests/test_mpi_* run
the same over MPI): collective fingerprints, abort notices, rejected collectives
that keep their place, world aborts, and errors that name what went wrong."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aaccl
from aaccl import CCLOError, ErrorCode, ReduceFunction

SUM = ReduceFunction.SUM
LONG = 30.0  # every failure below must come long before this timeout
FAST = 2.0

pytestmark = pytest.mark.anyio


async def outcomes(*calls: aaccl.Call) -> list[BaseException | None]:
    """Await every call; its error or None, in order."""
    out: list[BaseException | None] = []
    for call in calls:
        try:
            await call
            out.append(None)
        except aaccl.ACCLError as exc:
            out.append(exc)
    return out


# -- fingerprints ----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["op", "count", "dtype", "root", "function"])
async def test_mismatched_collectives_fail_on_every_rank_at_once_naming_both(case: str) -> None:
    async with aaccl.open_world(3, timeout=LONG) as accls:
        bufs = [a.allocate(64) for a in accls]
        odd = accls[1].allocate(64, np.int32)
        calls = {
            "op": lambda a, b, r: (a.reduce(b, b, 64, 0, SUM) if r == 1 else a.bcast(b, 64, 0)),
            "count": lambda a, b, r: a.allreduce(b, b, 10 if r == 1 else 64, SUM),
            "dtype": lambda a, b, r: a.allreduce(odd if r == 1 else b, odd if r == 1 else b,
                                                 64, SUM),
            "root": lambda a, b, r: a.gather(b[:16], b if a.rank == r % 2 else None, 16, r % 2),
            "function": lambda a, b, r: a.allreduce(b, b, 8, ReduceFunction.MAX if r == 1
                                                    else SUM),
        }[case]
        start = time.monotonic()
        with anyio.fail_after(FAST):
            results = await outcomes(*(calls(a, b, a.rank) for a, b in zip(accls, bufs)))
        failed = [e for e in results if e is not None]
        assert failed, results
        for error in failed:
            assert isinstance(error, CCLOError)
            assert error.code in (ErrorCode.DMA_MISMATCH_ERROR, ErrorCode.DMA_SIZE_ERROR)
            assert "rank 0 called" in str(error) or "rank 1 called" in str(error)
        assert time.monotonic() - start < FAST
        # every rank that still waited learned; a rank whose part was done (a root
        # that only sent) may have finished: never more than that one
        assert len(failed) >= len(accls) - 1
        # and the world is in step: the next collective is right
        for a, b in zip(accls, bufs):
            b[:] = a.rank + 1
        await outcomes(*(a.allreduce(b, b, 64, SUM) for a, b in zip(accls, bufs)))
        for b in bufs:
            np.testing.assert_array_equal(b, 6)


async def test_the_op_mismatch_names_each_side() -> None:
    async with aaccl.open_world(2, timeout=LONG) as (a, b):
        x, y = a.allocate(64), b.allocate(64)
        _, error = await outcomes(a.bcast(x, 64, 0), b.reduce(y, y, 64, 0, SUM))
        assert isinstance(error, CCLOError)
        assert ("rank 0 called bcast(count=64, float32, root=0); "
                "rank 1 called reduce(count=64, float32, root=0, SUM)") in str(error)


async def test_send_and_recv_disagreeing_on_dtype_or_count_fail_naming_both() -> None:
    async with aaccl.open_world(2, timeout=LONG) as (a, b):
        f, i, g = a.allocate(8), b.allocate(8, np.int32), b.allocate(8)
        with anyio.fail_after(FAST):
            _, error = await outcomes(a.send(f, 4, 1, tag=3), b.recv(i, 4, 0, tag=3))
            assert isinstance(error, CCLOError) and error.code == ErrorCode.DMA_MISMATCH_ERROR
            assert "rank 0 sent send(count=4, float32" in str(error)
            assert "rank 1 called recv(count=4, int32" in str(error)
            _, error = await outcomes(a.send(f, 4, 1, tag=3), b.recv(g, 8, 0, tag=3))
            assert isinstance(error, CCLOError) and error.code == ErrorCode.DMA_SIZE_ERROR
            f[:4] = 7
            await outcomes(a.send(f, 4, 1, tag=3), b.recv(g, 4, 0, tag=3))
            np.testing.assert_array_equal(g[:4], 7)


# -- notices -----------------------------------------------------------------------------


async def test_a_timeout_on_one_rank_fails_the_others_at_once_and_says_whom_it_waited_for() -> None:
    """Rank 2 never calls the barrier; ranks 0 and 1 time out, and rank 2's next
    collective learns (it is the one that barrier was), then all are in step."""
    async with aaccl.open_world(3, timeout=0.3) as accls:
        a, b, c = accls
        results = await outcomes(a.barrier(), b.barrier())
        for error in results:
            assert isinstance(error, CCLOError)
            assert error.code == ErrorCode.RECEIVE_TIMEOUT_ERROR
            assert "waited 0.3 s for rank 2" in str(error)
            assert "rank 2 has no call outstanding" in str(error)
        with anyio.fail_after(FAST):
            with pytest.raises(CCLOError, match=r"rank [01]'s barrier\(\) failed"):
                await c.barrier()
        bufs = [x.allocate(4) for x in accls]
        for x, buf in zip(accls, bufs):
            buf[:] = x.rank
        await outcomes(*(x.allreduce(buf, buf, 4, SUM) for x, buf in zip(accls, bufs)))
        for buf in bufs:
            np.testing.assert_array_equal(buf, 3)


async def test_a_rejected_collective_keeps_its_place_and_aborts_the_peers_call() -> None:
    """Only the root rejects its gather: the others' calls fail at once, naming the
    root and its error, and the next collective of every rank lines up."""
    async with aaccl.open_world(3, timeout=LONG) as accls:
        a, b, c = accls
        big = [x.allocate(12) for x in accls]
        peers = [b.allreduce(big[1], big[1], 4, SUM), c.allreduce(big[2], big[2], 4, SUM)]
        with pytest.raises(ValueError):
            a.allreduce(big[0], a.allocate(2), 4, SUM)  # rbuf too small
        with anyio.fail_after(FAST):
            for error in await outcomes(*peers):
                assert isinstance(error, aaccl.Aborted)
                assert "rank 0 rejected its allreduce: ValueError: rbuf holds 2" in str(error)
        for x, buf in zip(accls, big):
            buf[:] = x.rank + 1
        await outcomes(*(x.allreduce(buf, buf, 12, SUM) for x, buf in zip(accls, big)))
        for buf in big:
            np.testing.assert_array_equal(buf, 6)


MUST_FAIL = np.zeros(0)
PROGRAM = st.lists(st.tuples(st.sampled_from(["allreduce", "bcast", "reduce", "allgather",
                                              "barrier"]),
                             st.integers(1, 40), st.integers(0, 2)),
                   min_size=1, max_size=6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(before=PROGRAM, after=PROGRAM, rejecter=st.integers(0, 2), anyio_backend=st.just("asyncio"))
async def test_after_a_rejected_collective_every_result_is_right_or_an_error(
        before: list, after: list, rejecter: int, anyio_backend: str) -> None:
    """One rank rejects one collective (a bad argument) amid random collectives of
    random sizes, all un-awaited: every later call gives numpy's answer or raises
    (the rejected one's peers), never a wrong value."""
    async with aaccl.open_world(3, timeout=LONG) as accls:
        calls: list[tuple[aaccl.Call, aaccl.Buffer, np.ndarray | None]] = []

        def submit(op: str, n: int, root: int, x: aaccl.ACCL) -> None:
            src, dst = x.allocate(n * 3), x.allocate(n * 3)
            src[:] = np.arange(n * 3) + 10 * x.rank
            every = [np.arange(n * 3) + 10 * r for r in range(3)]
            if op == "allreduce":
                call, want = x.allreduce(src, dst, n, SUM), sum(e[:n] for e in every)
            elif op == "bcast":
                call, want, dst = x.bcast(src, n, root), every[root][:n], src
            elif op == "reduce":
                call = x.reduce(src, dst, n, root, SUM)
                want = sum(e[:n] for e in every) if x.rank == root else None
            elif op == "allgather":
                call, want = x.allgather(src, dst, n), np.concatenate([e[:n] for e in every])
            else:
                call, want = x.barrier(), None
            calls.append((call, dst, want))

        for op, n, root in before:
            for x in accls:
                submit(op, n, root, x)
        for x in accls:  # every rank makes the call; one rank's arguments are bad
            if x.rank == rejecter:
                with pytest.raises(ValueError):
                    x.allreduce(x.allocate(1), x.allocate(1), 2, SUM)
            else:
                calls.append((x.allreduce(x.allocate(2), x.allocate(2), 2, SUM), x.allocate(1),
                              MUST_FAIL))
        for op, n, root in after:
            for x in accls:
                submit(op, n, root, x)
        with anyio.fail_after(10):
            for call, dst, want in calls:
                try:
                    await call
                except aaccl.ACCLError:
                    continue
                assert want is not MUST_FAIL, f"{call} succeeded without a rank's part"
                if want is not None:
                    np.testing.assert_array_equal(dst[:want.size], want)


# -- world aborts ----------------------------------------------------------------------------


def run_script(body: str, *, signal_after: str | None = None, timed_from: str | None = None,
               backend: str = "asyncio") -> tuple[int, str, float]:
    """Run a program in a fresh process; (exit code, stderr, seconds). With
    `signal_after`, send SIGINT once the program printed that line; the seconds
    count from then, or from the line `timed_from`."""
    source = textwrap.dedent(body).replace("BACKEND", repr(backend))
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    mark = signal_after or timed_from
    if mark is not None:
        assert proc.stdout is not None
        while proc.stdout.readline().strip() != mark:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        start = time.monotonic()
    if signal_after is not None:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err, time.monotonic() - start


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_raising_rank_ends_run_at_once_with_its_own_error(backend: str) -> None:
    code, err, took = run_script("""
        import aaccl
        async def main(accl):
            if accl.rank == 1:
                raise ValueError("rank 1 gave up")
            b = accl.allocate(4)
            await accl.allreduce(b, b, 4, aaccl.ReduceFunction.SUM)
        aaccl.run(main, 3, timeout=30, backend=BACKEND)
    """, backend=backend)
    assert code == 1
    # the rank's own error, as itself, with a note saying whose it is
    assert err.strip().splitlines()[-2:] == [
        "ValueError: rank 1 gave up", "aaccl.run: rank 1 raised this; ranks 0, 2 were aborted"]
    assert "nobody awaited" not in err
    assert took < 10  # interpreter start-up included; the world itself takes < 1 s


WAITING = """
    import aaccl, anyio
    async def main(accl):
        b = accl.allocate(4)
        if accl.rank == 1:
            print("waiting", flush=True)
            await accl.recv(b, 4, 0, tag=1)
        else:
            await anyio.sleep(3600)  # alive, but never sends
    aaccl.run(main, WORLD timeout=30)
"""
"""Rank 1 waits for a live rank that never sends (WORLD: run's other arguments)."""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_while_a_peer_is_missing_exits_at_once(backend: str) -> None:
    code, err, took = run_script(WAITING.replace("WORLD", "2, backend=BACKEND,"),
                                 signal_after="waiting", backend=backend)
    assert code != 0
    assert "KeyboardInterrupt" in err or code == -signal.SIGINT
    assert took < FAST


async def test_a_cancelled_wait_then_leaving_the_world_takes_no_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        async with aaccl.open_world(2, timeout=LONG) as (a, b):
            with anyio.fail_after(0.3):
                await b.recv(b.allocate(4), 4, 0)
    assert time.monotonic() - start < FAST


async def test_run_raises_the_common_error_once_and_different_ones_as_rank_errors() -> None:
    async def all_bad(accl: aaccl.ACCL) -> None:
        accl.allreduce(accl.allocate(2), accl.allocate(2), 4, SUM)

    async def each_own(accl: aaccl.ACCL) -> None:
        raise KeyError(accl.rank)

    with pytest.raises(ValueError, match="sbuf holds 2 elements"):
        await anyio.to_thread.run_sync(lambda: aaccl.run(all_bad, 3))
    with pytest.raises(aaccl.RankErrors) as group:
        await anyio.to_thread.run_sync(lambda: aaccl.run(each_own, 3))
    assert [(r, e.args[0]) for r, e in group.value.errors.items()] == [(0, 0), (1, 1), (2, 2)]


async def test_aborted_calls_of_a_world_left_by_an_error_name_the_cause() -> None:
    start = time.monotonic()
    with pytest.raises(KeyError):
        async with aaccl.open_world(2, timeout=LONG) as (a, b):
            call = b.recv(b.allocate(4), 4, 0)
            raise KeyError("boom")
    assert time.monotonic() - start < FAST
    with pytest.raises(aaccl.Aborted, match="the world closed after KeyError: 'boom'"):
        await call


async def test_a_rank_that_returns_early_leaves_and_the_others_learn_at_once() -> None:
    async def main(accl: aaccl.ACCL) -> None:
        if accl.rank == 1:
            return
        buf = accl.allocate(4)
        await accl.allreduce(buf, buf, 4, SUM)

    start = time.monotonic()
    with pytest.raises(aaccl.Aborted) as error:  # the same on ranks 0 and 2: raised once
        await anyio.to_thread.run_sync(lambda: aaccl.run(main, 3, timeout=LONG))
    assert time.monotonic() - start < FAST
    assert "rank 1 left the world: its program returned" in str(error.value)


async def test_a_call_given_up_by_wait_for_does_not_hold_the_world_at_exit() -> None:
    start = time.monotonic()
    async with aaccl.open_world(2, timeout=LONG) as (a, b):
        call = b.recv(b.allocate(4), 4, 0)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.3):
                await call
        assert not call.done()  # it goes on: it still owns its buffer ...
    assert time.monotonic() - start < FAST  # ... until the world closes and aborts it
    with pytest.raises(aaccl.Aborted, match="its await was cancelled"):
        await call


needs_mpiexec = pytest.mark.skipif(
    not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")),
    reason="no mpiexec beside this Python (pip install 'aaccl[mpi]')")


@needs_mpiexec
def test_ctrl_c_to_an_aaccl_launch_job_ends_every_rank_at_once(tmp_path) -> None:
    """SIGINT to `aaccl launch` while rank 1 waits (timeout=30) for a live rank
    that never sends: the job ends within 2 s, non-zero, with no rank left."""
    script = tmp_path / "ctrl_c_job.py"
    script.write_text(textwrap.dedent(WAITING.replace("WORLD", "")))
    proc = subprocess.Popen([sys.executable, "-m", "aaccl", "launch", "-n", "2", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        while proc.stdout.readline().strip() != "waiting":
            assert proc.poll() is None, proc.communicate()
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert time.monotonic() - start < FAST, err
        left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True).stdout
        assert not left.strip(), f"ranks left running: {left}"
    finally:  # a failed trial leaves no job behind (rank 0 sleeps for an hour)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@needs_mpiexec
def test_wait_for_then_leaving_takes_no_timeout_over_mpi(tmp_path) -> None:
    """Under MPI (aaccl launch, timeout=30) a rank gives up a receive from a live
    rank with anyio.fail_after and returns: the job ends in seconds, successfully
    (leaving aborts the given-up receive instead of waiting for its timeout)."""
    script = tmp_path / "wait_for_job.py"
    script.write_text(textwrap.dedent("""
        import time, aaccl, anyio
        async def main(accl):
            if accl.rank == 1:
                try:
                    with anyio.fail_after(0.5):
                        await accl.recv(accl.allocate(4), 4, 0, tag=1)
                except TimeoutError:
                    return "gave up"
            else:
                await anyio.sleep(1)  # alive, but never sends
            return "done"
        start = time.monotonic()
        results = aaccl.run(main, timeout=30)
        print(f"took={time.monotonic() - start:.2f} {results}", flush=True)  # one write
    """))
    proc = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "2", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    took = [float(t) for t in re.findall(r"took=(\d+\.\d+)", proc.stdout)]  # two ranks
    assert len(took) == 2 and max(took) < 1 + FAST, proc.stdout
    assert "['done', 'gave up']" in proc.stdout


def _blocked_signals(native_id: int) -> set[int]:
    """The signals thread `native_id` of this process blocks (Linux: its SigBlk)."""
    with open(f"/proc/self/task/{native_id}/status") as status:
        mask = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_aaccls_threads_leave_process_signals_to_the_main_thread() -> None:
    """A Ctrl-C the kernel gives a helper thread never wakes an event loop asleep in
    select() (Python runs handlers in the main thread only): under asyncio it waited
    for the call's timeout, 1 run in about 60 on a loaded machine. Every thread
    aaccl starts or works on blocks the process's signals, so the main one takes
    them: the timers, the data workers, the host-job workers, anyio's workers."""
    import threading

    from aaccl._threads import SIGNALS

    async def main() -> dict[str, set[int]]:
        async with aaccl.open_world(2, timeout=30) as accls:
            big = [(a.allocate(1 << 19), a.allocate(1 << 19)) for a in accls]  # 2 MiB
            for a, (s, _) in zip(accls, big):
                s[:] = a.rank
            calls = [a.allreduce(s, d, 1 << 19, ReduceFunction.SUM)  # data workers
                     for a, (s, d) in zip(accls, big)]
            calls.append(accls[1].recv(accls[1].allocate(4), 4, 0))  # a deadline: timers
            calls.append(accls[0].send(accls[0].allocate(4), 4, 1))
            for call in calls:
                await call
            out = accls[0].allocate(4)
            await accls[0].kernel(lambda x: x)(out)  # a host-job worker
            return {t.name: _blocked_signals(t.native_id)  # type: ignore[arg-type]
                    for t in threading.enumerate() if t is not threading.main_thread()}

    masks = anyio.run(main)
    assert any(name.startswith("soft-cclo-timers") for name in masks), masks
    assert any(name.startswith("soft-cclo-data") for name in masks), masks
    for name, blocked in masks.items():
        assert set(SIGNALS) <= blocked, f"thread {name} takes process signals"
    assert not set(SIGNALS) & _blocked_signals(threading.main_thread().native_id)  # type: ignore[arg-type]


TAKEN_BY_ANOTHER_THREAD = """
    import aaccl, anyio, signal, sys, threading, time
    async def main(accl):
        b = accl.allocate(4)
        if accl.rank == 1:
            stop = threading.Event()  # a thread of the program's own, that takes signals
            other = threading.Thread(target=stop.wait, daemon=True)
            other.start()
            async def interrupt():
                await anyio.sleep(0)  # once the receive waits
                print("interrupting", flush=True)
                signal.pthread_kill(other.ident, signal.SIGINT)
            async with anyio.create_task_group() as tg:
                tg.start_soon(interrupt)
                await accl.recv(b, 4, 0, tag=1)
        else:
            await anyio.sleep(3600)
    aaccl.run(main, 2, backend=BACKEND, timeout=30)
"""
"""Rank 1 waits for a message that never comes; a Ctrl-C lands on a thread that is
not the main one (as the kernel may give a process's signal to any thread that does
not block it: numpy's OpenBLAS pool's, a program's own)."""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_taken_by_another_thread_still_ends_the_program_at_once(backend: str) -> None:
    code, err, took = run_script(TAKEN_BY_ANOTHER_THREAD, timed_from="interrupting",
                                 backend=backend)
    assert "KeyboardInterrupt" in err or code == -signal.SIGINT, err
    assert took < FAST, f"took {took:.1f} s: the loop slept through the signal"


def test_worlds_open_at_once_share_the_signal_wakeup_and_the_last_removes_it() -> None:
    """The wakeup that makes a Ctrl-C any thread takes wake the loop stays while any
    world of the loop is open (the first to close does not take it from the other),
    and is gone once the last closed; a program's own wakeup fd is left alone."""
    import asyncio

    def wakeup() -> int:
        fd = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(fd)
        return fd

    async def main() -> list[bool]:
        seen = []
        first = aaccl.open_world(2)
        await first.__aenter__()
        seen.append(wakeup() != -1)
        async with aaccl.open_world(2):
            seen.append(wakeup() != -1)
            await first.__aexit__(None, None, None)
            seen.append(wakeup() != -1)  # the second world still wakes on signals
        seen.append(wakeup() == -1)
        return seen

    assert asyncio.run(main()) == [True, True, True, True]
    mine, theirs = __import__("socket").socketpair()
    mine.setblocking(False)
    signal.set_wakeup_fd(mine.fileno())
    try:
        async def own() -> None:
            async with aaccl.open_world(2):
                assert wakeup() == mine.fileno()
        asyncio.run(own())
        assert wakeup() == mine.fileno()
    finally:
        signal.set_wakeup_fd(-1)
        mine.close()
        theirs.close()
