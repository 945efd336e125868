"""`aaccl.run`'s one predictable error: the same error on every rank raised once, as
itself; different errors as `aaccl.RankErrors`, short at any number of ranks; the
process's rank and size outside `main`."""

from __future__ import annotations

import pickle
import traceback

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import CCLOError, ErrorCode, RankErrors, ReduceFunction
from aaccl._errors import RemoteError, same_error
from aaccl._ranks import ranges, without_ranks
from aaccl.api._world import _failure, _portable, _rebuilt

REPEATS = 50
SUM = ReduceFunction.SUM


def notes(error: BaseException) -> list[str]:
    return list(getattr(error, "__notes__", []))


async def dtype_mismatch(accl: aaccl.ACCL) -> None:
    buf = accl.allocate(8, np.float32 if accl.rank == 0 else np.float64)
    await accl.allreduce(buf, buf, 8, SUM)


def test_the_same_mismatch_on_every_rank_is_one_ccloerror_every_time() -> None:
    for _ in range(REPEATS):
        with pytest.raises(CCLOError) as caught:
            aaccl.run(dtype_mismatch, 4, timeout=5)
        assert type(caught.value) is CCLOError
        assert caught.value.code == ErrorCode.DMA_MISMATCH_ERROR
        assert "rank 0 called allreduce(count=8, float32, SUM)" in str(caught.value)
        (note,) = notes(caught.value)
        assert note.startswith("aaccl.run: ")


async def one_rank_missing(accl: aaccl.ACCL, op: str) -> None:
    if accl.rank == 2:
        await anyio.sleep_forever()  # never takes part: the others time out
    buf = accl.allocate(4)
    await (accl.barrier() if op == "barrier" else accl.allreduce(buf, buf, 4, SUM))


@pytest.mark.parametrize("op", ["allreduce", "barrier"])
def test_a_timeout_with_one_rank_missing_is_one_ccloerror_every_time(op: str) -> None:
    """The ranks that wait time out on their own, or learn of another's timeout
    first, or are aborted or cancelled once one raised: which, depends on timing.
    What run raises does not."""
    for _ in range(REPEATS):
        with pytest.raises(CCLOError) as caught:
            aaccl.run(lambda accl: one_rank_missing(accl, op), 4, timeout=0.05)
        assert type(caught.value) is CCLOError
        assert caught.value.code == ErrorCode.RECEIVE_TIMEOUT_ERROR


def test_different_errors_raise_rank_errors_with_every_ranks_error() -> None:
    async def main(accl: aaccl.ACCL) -> None:
        if accl.rank in (0, 1, 2, 4):
            raise ValueError(f"rank {accl.rank} has no data")  # alike but for the rank
        raise KeyError("missing")

    for _ in range(REPEATS):
        with pytest.raises(aaccl.ACCLError) as caught:
            aaccl.run(main, 6)
        error = caught.value
        assert isinstance(error, RankErrors)
        assert sorted(error.errors) == list(range(6))
        assert [(ranks, type(e)) for ranks, e in error.groups] == \
            [([0, 1, 2, 4], ValueError), ([3, 5], KeyError)]
        assert str(error).splitlines() == [
            "6 ranks failed with 2 different errors:",
            "  ranks 0-2, 4: ValueError: rank 0 has no data",
            "  ranks 3, 5: KeyError: 'missing'"]
        assert error.__cause__ is error.errors[0]  # a traceback shows one of them


def test_at_64_ranks_the_text_stays_short() -> None:
    async def own(accl: aaccl.ACCL) -> None:
        raise KeyError(accl.rank)  # 64 different errors

    with pytest.raises(RankErrors) as caught:
        aaccl.run(own, 64)
    lines = str(caught.value).splitlines()
    assert len(lines) == 2 + RankErrors.SHOWN
    assert lines[-1] == "  and 56 more different errors, on ranks 8-63"
    shown = "".join(traceback.format_exception(caught.value))
    assert len(shown.splitlines()) < 40, shown

    async def alternate(accl: aaccl.ACCL) -> None:
        raise (ValueError if accl.rank % 2 else RuntimeError)(f"rank {accl.rank} failed")

    with pytest.raises(RankErrors) as caught:
        aaccl.run(alternate, 64)
    assert str(caught.value).splitlines()[1] == \
        "  ranks 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, ..., 62 (32 ranks): RuntimeError: " \
        "rank 0 failed"

    with pytest.raises(CCLOError) as same:
        aaccl.run(dtype_mismatch, 64, timeout=10)
    (note,) = notes(same.value)  # (which ranks got as far as their own error varies)
    assert note.startswith("aaccl.run: ranks 0") and len(note) < 200, note


def test_a_user_error_on_every_rank_is_raised_as_itself() -> None:
    async def main(accl: aaccl.ACCL) -> None:
        raise ValueError(f"config for rank {accl.rank}: no such file") from OSError("gone")

    with pytest.raises(ValueError, match="config for rank 0") as caught:
        aaccl.run(main, 3)
    assert notes(caught.value) == ["aaccl.run: ranks 0-2 raised this error (the same but "
                                   "for rank numbers); this is rank 0's"]
    assert isinstance(caught.value.__cause__, OSError)  # its own cause stays


def test_one_rank_failing_while_the_others_return_or_wait() -> None:
    async def main(accl: aaccl.ACCL) -> int:
        if accl.rank == 1:
            raise ValueError("rank 1 gave up")
        if accl.rank == 2:
            buf = accl.allocate(4)
            await accl.recv(buf, 4, 1)  # aborted when rank 1 raises
        return accl.rank

    with pytest.raises(ValueError, match="rank 1 gave up") as caught:
        aaccl.run(main, 4, timeout=30)
    assert notes(caught.value)[0].startswith("aaccl.run: rank 1 raised this")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_keyboardinterrupt_and_systemexit_propagate_as_themselves(
        stop: type[BaseException], backend: str) -> None:
    if backend == "trio":
        pytest.importorskip("trio")

    async def main(accl: aaccl.ACCL) -> None:
        if accl.rank == 1:
            raise stop(3)
        if accl.rank == 2:
            raise ValueError("an error elsewhere does not hide it")
        await anyio.sleep_forever()

    with pytest.raises(stop) as caught:
        aaccl.run(main, 3, backend=backend)
    assert caught.value.args == (3,)


def test_same_error_takes_the_rank_numbers_out() -> None:
    assert without_ranks("allreduce (rank 3, call 1) failed: waited 1 s for rank 12; "
                         "rank 12 is in recv(count=4, src=3, any tag); ranks 0, 1 and 2-5") \
        == "allreduce (rank #, call 1) failed: waited 1 s for rank #; rank # is in " \
           "recv(count=4, src=#, any tag); rank #"
    # CCLOError: its error bits, whatever each rank saw of the failure
    own = CCLOError("barrier (rank 1, call 1)", ErrorCode.RECEIVE_TIMEOUT_ERROR,
                    "waited 1 s for rank 3; rank 3 is in barrier()")
    told = CCLOError("barrier (rank 0, call 1)", ErrorCode.RECEIVE_TIMEOUT_ERROR,
                     "rank 1's barrier() failed (RECEIVE_TIMEOUT_ERROR): waited 1 s for rank 3")
    other = CCLOError("barrier (rank 0, call 1)", ErrorCode.DMA_MISMATCH_ERROR)
    assert same_error(own) == same_error(told) != same_error(other)
    # Aborted: its first cause, also when it came through a peer's aborted call
    assert same_error(aaccl.Aborted("allreduce (rank 0, call 1) was aborted: rank 1 left the "
                                    "world: its program returned")) == \
        same_error(aaccl.Aborted("allreduce (rank 2, call 1) was aborted: rank 0's allreduce("
                                 "count=4) was aborted: rank 1 left the world: its program "
                                 "returned"))
    assert same_error(ValueError("x")) != same_error(TypeError("x"))
    assert same_error(KeyError(1)) != same_error(KeyError(2))  # not a "rank N"


def test_ranges() -> None:
    assert ranges([3]) == "rank 3"
    assert ranges([1, 0]) == "ranks 0, 1"
    assert ranges([*range(37), *range(38, 64)]) == "ranks 0-36, 38-63"
    assert ranges(range(0, 64, 2)) == \
        "ranks 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, ..., 62 (32 ranks)"


def test_the_rule_is_the_same_for_errors_from_other_processes() -> None:
    """Under MPI, each process gets the others' errors pickled, or as their text and
    kind: the verdict is the same in every process, its own error raised as itself."""
    mine = CCLOError("allreduce (rank 1, call 1)", ErrorCode.DMA_MISMATCH_ERROR, "rank 0 called x")
    theirs = pickle.loads(pickle.dumps(CCLOError("allreduce (rank 0, call 1)",
                                                 ErrorCode.DMA_MISMATCH_ERROR)))
    assert _failure({0: theirs, 1: mine}, mine=1) is mine
    unpicklable = RemoteError("Weird: rank 2 broke", same_error(ValueError("rank 2 broke")))
    raised = _failure({0: ValueError("rank 0 broke"), 2: unpicklable}, mine=1)
    assert isinstance(raised, ValueError)
    assert "rank 1, this process's, returned" in notes(raised)[0]
    differing = _failure({0: KeyError(0), 1: mine}, mine=1)
    assert isinstance(differing, RankErrors)
    copy = pickle.loads(pickle.dumps(differing))
    assert str(copy) == str(differing) and sorted(copy.errors) == [0, 1]


def test_what_an_abort_did_to_a_chain_is_the_abort_in_every_process() -> None:
    """A rank that awaited the end of a chain when another rank raised fails with a
    DependencyError whose root is the Aborted its first call got (over MPI): that is
    the abort, not an error of its own, in its process and once it travelled to
    another (pickling leaves an error's `__cause__` behind: the root travels along)."""
    for travelled in (False, True):
        aborted = aaccl.Aborted("allreduce (rank 0, call 1) was aborted: rank 2 left")
        chained = aaccl.DependencyError("allreduce (rank 0, call 2) did not run")
        chained.__cause__ = aborted
        if travelled:
            chained = _rebuilt(*_portable(chained))  # type: ignore[assignment]
            assert isinstance(chained, aaccl.DependencyError)
            assert isinstance(chained.__cause__, aaccl.Aborted)
        boom = RuntimeError("boom")
        error = _failure({0: chained, 1: aaccl.Aborted("rank 2 left"), 2: boom},
                         mine=2 if travelled else None)
        assert error is boom
        assert "rank 2 raised this; ranks 0, 1 were aborted" in notes(error)[0]
    # where every rank was aborted, the aborts are all there is to say
    every = _failure({0: chained, 1: aaccl.Aborted("rank 2 left")})
    assert isinstance(every, RankErrors) and sorted(every.errors) == [0, 1]


def test_process_rank_and_count_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (aaccl.process_rank(), aaccl.process_count()) == (0, 1)  # every rank is here
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "5")
    assert (aaccl.process_rank(), aaccl.process_count()) == (2, 5)
