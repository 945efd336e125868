"""The world's collectives over MPI as MPI's own collectives (aaccl/soft/fabric/_lane.py),
past the happy path, with real processes (tests/mpi/lane.py says what each suite
does). The happy path — every collective, dtype, size and root, checked against
numpy — is tests/test_mpi_fabric.py's `collectives` suites, which run here too."""

from __future__ import annotations

import pytest
from test_mpi_fabric import MPIEXEC, assert_passed, launch

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_verdicts_reach_every_rank_at_once(nprocs: int) -> None:
    """Mismatches, an aborted call, a rejected call: every rank fails at once (well
    inside the 10 s timeout), in words naming both sides, and the world goes on."""
    assert_passed(launch(nprocs, "lane.py", "verdicts", "timeout=10"), nprocs)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_late_peer(backend: str) -> None:
    """The collective MPI still matches after a timeout fails the calls queued behind
    it at once; once the late rank has come, the world works again."""
    assert_passed(launch(2, "lane.py", "late", "timeout=0.5", f"backend={backend}"), 2)


def test_a_collective_waiting_for_a_recv_lets_later_ones_run() -> None:
    """A collective still waiting for its dependencies holds back no later one (issue
    27): the program of test_chaining's test of that name completes as in process."""
    assert_passed(launch(2, "lane.py", "waitfor", "timeout=3", limit=60), 2)


def test_gathers_with_different_roots_on_a_sub_communicator() -> None:
    """On a sub-communicator (messages, no opening), gathers whose ranks name
    different roots fail at once on every rank still in them, as in process (the
    program of test_communicators' test), and leave nothing behind: the allreduce
    after each is right (issue 27: it timed out, its peer still waiting out the
    gather)."""
    assert_passed(launch(3, "lane.py", "roots", "timeout=5", "nbufs=4", limit=90), 3)


def test_twenty_thousand_outstanding() -> None:
    assert_passed(launch(2, "lane.py", "many", "timeout=10", limit=240), 2)


def test_a_rank_that_gave_up_and_ended() -> None:
    """Rank 0's program ends with its timeout while rank 1 sleeps: when rank 1 comes,
    it fails with rank 0's reason, and both processes end within seconds (MPI's
    collective that rank 0 left behind must hold up neither its exit nor rank 1)."""
    job = launch(2, "lane.py", "gave_up", "timeout=0.5", limit=60)
    assert job.returncode != 0, job.explain()
    assert job.seconds < 20, job.explain()
    out = job.stdout + job.stderr
    assert "rank=0 suite=gave_up" in out and "waited 0.5 s for MPI's allgather" in out, job.explain()
    assert "rank=1 suite=gave_up" in out and "rank 0's allreduce" in out, job.explain()


def test_a_rank_that_left_fails_every_later_collective_at_once() -> None:
    """Rank 0's program raises with a collective pending: rank 1's collectives from
    then on fail at once with Aborted naming rank 0 (those MPI can never complete are
    not started), and both processes end."""
    job = launch(2, "lane.py", "left", "timeout=10", limit=60)
    assert job.returncode != 0, job.explain()
    out = job.stdout + job.stderr
    assert "rank 0 gives up" in out, job.explain()
    for i in range(3):
        assert f"lane-left rank=1 call={i} " in out, job.explain()
    assert job.seconds < 20, job.explain()


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_persistent_opening_made_afresh(nprocs: int) -> None:
    """The lane makes its persistent opening afresh every RENEW_EVERY openings (MPICH
    keeps a persistent collective's tag for good, and hands nonblocking ones tags from
    a counter that wraps without looking at it): here every 4, with collectives one at
    a time and 200 outstanding, every result checked."""
    assert_passed(launch(nprocs, "lane.py", "renew", "timeout=10"), nprocs)
