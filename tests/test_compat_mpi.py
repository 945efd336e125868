"""`aaccl.compat` as pyaccl's programs run: one rank per process, under mpiexec.

Real processes: a pyaccl-style script (tests/mpi/compat_prog.py) and a pyaccl-style
pytest suite (tests/mpi/compat_suite.py), each process making `accl(N, its MPI rank,
sim_mode=True)` with pyaccl's constructor, under `mpiexec -n N` and `aaccl launch`.
The programs check their results against numpy themselves; here we assert on exit
codes and output. Constructors that cannot form a world fail on every process at
once with a clear error; every job has a hard time limit.
"""

from __future__ import annotations

import re
import sys

import pytest
from test_mpi_fabric import MPIEXEC, WORKERS, Job, run_job

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")

LIMIT = 90.0  # seconds a job may take before its processes are killed


def program(nprocs: int, suite: str, launcher: str = "mpiexec") -> Job:
    script = [sys.executable, str(WORKERS / "compat_prog.py"), suite]
    if launcher == "mpiexec":
        assert MPIEXEC is not None
        return run_job([MPIEXEC, "-n", str(nprocs), *script], LIMIT)
    return run_job([sys.executable, "-m", "aaccl", "launch", "-n", str(nprocs), *script[1:]],
                   LIMIT)


def oks(job: Job) -> dict[int, int]:
    """rank -> checks, of the processes that reported success."""
    return {int(r): int(c) for r, c in re.findall(r"compat-ok rank=(\d+) size=\d+ checks=(\d+)",
                                                  job.stdout)}


def errors(job: Job) -> dict[tuple[int, str], tuple[float, str]]:
    """(rank, case) -> (seconds the constructor took, its error), as reported."""
    return {(int(r), case): (float(s), error) for r, case, s, error in re.findall(
        r"compat-error rank=(\d+) case=(\w+) seconds=([\d.]+) error=(.*)", job.stdout)}


@pytest.mark.parametrize(("nprocs", "launcher"), [(2, "mpiexec"), (3, "mpiexec"),
                                                  (2, "aaccl launch")])
def test_a_pyaccl_program_forms_one_world_across_processes(nprocs: int, launcher: str) -> None:
    """send/recv around a ring, allreduce, bcast, allgather, reduce_scatter and a split
    communicator, against numpy; then a second world in the same processes."""
    job = program(nprocs, "ok", launcher)
    assert job.returncode == 0, job.explain()
    assert sorted(oks(job)) == list(range(nprocs)), job.explain()
    assert all(checks >= 10 for checks in oks(job).values()), job.explain()


def test_worlds_one_after_another_in_the_same_processes() -> None:
    """Each world's last messages (its ranks' leave notices) stay in that world."""
    job = program(3, "worlds")
    assert job.returncode == 0, job.explain()
    assert oks(job) == {0: 40, 1: 40, 2: 40}, job.explain()


def test_constructors_that_cannot_form_a_world_fail_at_once_on_every_process() -> None:
    nprocs = 3
    job = program(nprocs, "mismatches")
    assert job.returncode == 0, job.explain()
    assert sorted(oks(job)) == list(range(nprocs)), job.explain()  # then a world formed
    found = errors(job)
    expected = {
        "local_rank": "ValueError: the MPI job's world cannot form: local_rank must be the "
                      "process's MPI rank, but process 0 passed 1, process 1 passed 2, "
                      "process 2 passed 0",
        "nranks": "ValueError: the MPI job's world cannot form: nranks must be 3, the job's "
                  "number of processes (under mpiexec each process is one rank), but every "
                  "process passed 4",
    }
    for rank in range(nprocs):
        for case, error in expected.items():
            assert found[(rank, case)][1] == error, job.explain()
        # a process's own bad argument: its own error there, and the others name it
        own = {"bufsize": (1, "ValueError: bufsize must be a multiple of 8 bytes, got 7"),
               "nbufs": (2, "ValueError: nbufs must be a positive integer, got 0")}
        for case, (culprit, error) in own.items():
            got = found[(rank, case)][1]
            assert got == error if rank == culprit else got == (
                "ValueError: the MPI job's world cannot form: process "
                f"{culprit}'s arguments were rejected ({error})"), job.explain()
    assert max(seconds for seconds, _ in found.values()) < 5, job.explain()  # no timeouts


def test_a_program_that_ends_without_deinit_leaves_its_world_saying_so() -> None:
    job = program(3, "leave")
    assert job.returncode == 0, job.explain()
    assert oks(job) == {0: 1, 1: 2, 2: 2}, job.explain()
    for rank in (1, 2):
        seconds, error = errors(job)[(rank, "leave")]
        assert error == (f"Aborted: recv (rank {rank}, call 2) was aborted: rank 0 left the "
                         "world: its accl was closed (deinit)"), job.explain()
        assert seconds < 5, job.explain()  # not the 10 s timeout


def test_a_process_that_never_makes_its_instance_fails_the_others_saying_why() -> None:
    """(FORM_TIMEOUT is 2 s in this program instead of a minute.)"""
    job = program(3, "absent")
    assert job.returncode == 0, job.explain()
    found = errors(job)
    for rank in (0, 1):
        seconds, error = found[(rank, "absent")]
        assert error == ("ACCLError: the MPI job's world cannot form: not every process came "
                         f"to make its accl(...) within 2 s of process {rank} (each process of "
                         "`mpiexec -n N` makes one accl(N, its rank, sim_mode=True))"), \
            job.explain()
        assert 1.9 < seconds < 10, job.explain()


def test_a_pyaccl_pytest_suite_runs_under_mpiexec() -> None:
    """Each process runs the suite, a world per test (3 processes cost 3 s more)."""
    nprocs = 2
    assert MPIEXEC is not None
    job = run_job([MPIEXEC, "-n", str(nprocs), sys.executable, "-m", "pytest", "-q",
                   "-p", "no:cacheprovider", str(WORKERS / "compat_suite.py")], LIMIT)
    assert job.returncode == 0, job.explain()
    # (not anchored at a line's start: mpiexec may join two ranks' last lines in one)
    assert len(re.findall(r"(?<!\d)6 passed", job.stdout)) == nprocs, job.explain()
