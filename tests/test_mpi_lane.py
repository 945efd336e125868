"""The world's collectives over MPI as MPI's own collectives (aaccl/soft/fabric/_lane.py),
past the happy path, with real processes (tests/mpi/lane.py says what each suite
does). The happy path — every collective, dtype, size and root, checked against
numpy — is tests/test_mpi_fabric.py's `collectives` suites, which run here too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_mpi_fabric import MPIEXEC, assert_passed, launch

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")
ROOT = Path(__file__).resolve().parents[1]


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
def test_one_float_summed_from_the_opening_is_bitwise_numpys_fold(nprocs: int) -> None:
    """A 1-element float sum that rides in the opening folds as numpy's scalars: the
    same bits as numpy's ufunc in rank order (3 ranks: the rows after the first two)."""
    assert_passed(launch(nprocs, "lane.py", "one", "timeout=10"), nprocs)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_persistent_opening_made_afresh(nprocs: int) -> None:
    """The lane makes its persistent opening afresh every RENEW_EVERY openings (MPICH
    keeps a persistent collective's tag for good, and hands nonblocking ones tags from
    a counter that wraps without looking at it): here every 4, with collectives one at
    a time and 200 outstanding, every result checked."""
    assert_passed(launch(nprocs, "lane.py", "renew", "timeout=10"), nprocs)


KEPT = '''
import os
from aaccl.soft._engine import Engine
from aaccl.soft.fabric._lane import Lane, Op


class Comm:  # (no Allgather_init: the lane opens with Iallgather, never called here)
    def Get_size(self):
        return 2


class Memory:  # what a transfer MPI may still write into holds (device memory)
    def __del__(self, write=os.write):
        write(1, b"freed\\n")


lane = Lane(Comm(), Engine("kept"))
op, memory = Op(0, None), Memory()
op.transfer = lambda memory=memory: memory  # (holds it, as `transfer` does)
lane._graveyard.append((object(), op))  # a peer left while MPI moved its data
lane.close(free=False)
del lane, op, memory
print("exiting", flush=True)
'''


RECEIVING = '''
import os
from aaccl.soft.fabric._mpi import MPIFabric


class Memory:  # a payload's buffer, which a posted receive may still write into
    def __del__(self, write=os.write):
        write(1, b"freed\\n")


fabric = MPIFabric.__new__(MPIFabric)  # (its state after an unclean close: no MPI here)
fabric._fetches, fabric._arriving = {(1, 7): (None, Memory())}, {}
fabric._keep_receiving()
done = MPIFabric.__new__(MPIFabric)  # nothing posted: nothing kept
done._fetches, done._arriving = {}, {}
done._keep_receiving()
done.memory = Memory()
del fabric, done
print("exiting", flush=True)
'''


def _run(tmp_path: Path, program: str) -> str:
    script = tmp_path / "kept.py"
    script.write_text(program)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    job = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert job.returncode == 0, job.stderr
    return job.stdout


def test_a_fabric_closed_with_receives_posted_outlives_the_teardown(tmp_path: Path) -> None:
    """The same for a fabric that closes with payloads' receives still posted (a
    peer gone): its buffers stay to the process's end; one with none posted goes."""
    assert _run(tmp_path, RECEIVING) == "freed\nexiting\n"


def test_what_mpi_may_write_into_outlives_the_interpreters_teardown(tmp_path: Path) -> None:
    """A closed lane's unfinished collective keeps its memory past the interpreter's
    teardown: mpi4py finalizes MPI only after that (Py_AtExit), and MPI_Finalize
    still delivers what a peer sends to it. A module's list of such lanes was emptied
    by the teardown first: under `aaccl launch`, a Ctrl-C then ended a rank whose
    peer's leaving had left its allreduce unfinished in "malloc(): unsorted double
    linked list corrupted" (6 of 40 runs of test_mpi_faults.py's
    test_ctrl_c_under_aaccl_launch_exits_130[trio], its core showing the peer's 4 KiB
    written into the freed device memory)."""
    assert _run(tmp_path, KEPT) == "exiting\n"
