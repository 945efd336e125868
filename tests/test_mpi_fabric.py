"""The MPI fabric as real processes: `mpiexec -n N python tests/mpi/<worker>.py SUITE`.

Each launch runs one suite of a worker script on N ranks, one per process, through
`aaccl.run` with no world_size (the MPI fabric). The workers check every result
against numpy themselves (with the in-process tests' references) and exit non-zero
with a clear message on any mismatch, so here we assert on exit codes and output.
A launch does hundreds of checks: starting N processes costs about half a second.

Faults: a rank SIGKILLed in the middle of a collective, ranks calling different
collectives, a rank whose own code raises. Nothing may hang: every launch has a hard
time limit, past which its whole process tree is killed and the test fails.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import aaccl
from conftest import benchmark_module

procs = benchmark_module("_procs")
pytest.importorskip("mpi4py")  # the package only: MPI itself starts in the workers

WORKERS = Path(__file__).resolve().parent / "mpi"
ROOT = Path(__file__).resolve().parents[1]
HARD_LIMIT = 120.0  # seconds any launch may take before its processes are killed
FAULT_LIMIT = 60.0
TIMEOUT = 1.0  # aaccl's timeout in the fault scenarios


def _mpiexec() -> str | None:
    """The mpiexec beside this Python (the `mpich` wheel), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")


@functools.cache
def _is_hydra() -> bool:
    assert MPIEXEC is not None
    out = subprocess.run([MPIEXEC, "--version"], check=False, capture_output=True, text=True, timeout=30)
    return "HYDRA" in (out.stdout + out.stderr).upper()


needs_hydra = pytest.mark.skipif(MPIEXEC is None or not _is_hydra(),
                                 reason="needs MPICH's mpiexec (hydra) options")


# -- launching --------------------------------------------------------------------------

@dataclass
class Job:
    cmd: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def explain(self) -> str:
        def tail(text: str) -> str:
            return text if len(text) < 6000 else "...\n" + text[-6000:]

        return (f"\n$ {' '.join(self.cmd)}\nexit status {self.returncode} after "
                f"{self.seconds:.1f} s\n--- stdout\n{tail(self.stdout)}\n--- stderr\n"
                f"{tail(self.stderr)}")

    def oks(self) -> dict[int, int]:
        """rank -> checks, from the ranks that reported success."""
        return {int(rank): int(checks) for rank, checks in re.findall(
            r"aaccl-mpi-ok suite=\w+ rank=(\d+) size=\d+ checks=(\d+)", self.stdout)}

    def faults(self) -> dict[int, tuple[float, str, str]]:
        """rank -> (seconds its call waited, error kind, call), from FAULT lines."""
        return {int(rank): (float(after), kind, call) for rank, after, kind, call in re.findall(
            r"aaccl-mpi-fault rank=(\d+) after=(\d+\.\d\d) error=(\S+) call=\[([^\]]*)\]",
            self.stdout)}


def _kill_tree(pid: int) -> None:
    """Kill a job: its launcher, every process below (hydra puts ranks in sessions of
    their own, so a process group does not reach them) and its session."""
    procs.kill({pid} | (procs.descendants(pid) if os.path.isdir("/proc") else set()))
    try:
        os.killpg(pid, signal.SIGKILL)  # mpiexec leads a session of its own
    except (ProcessLookupError, PermissionError):
        pass


def launch(nprocs: int, worker: str, suite: str, *options: str,
           mpiexec_options: tuple[str, ...] = (), env: dict[str, str] | None = None,
           limit: float = HARD_LIMIT) -> Job:
    """Run `worker` SUITE on `nprocs` ranks; kill everything after `limit` seconds."""
    assert MPIEXEC is not None
    return run_job([MPIEXEC, *mpiexec_options, "-n", str(nprocs), sys.executable,
                    str(WORKERS / worker), suite, *options], limit, env)


def run_job(cmd: list[str], limit: float = HARD_LIMIT, env: dict[str, str] | None = None) -> Job:
    """Run a job (mpiexec, `aaccl launch`) from the repository with aaccl importable;
    kill its whole process tree, and fail the test, if it outlasts `limit` seconds."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(paths),
                   "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        job = Job(cmd, proc.returncode, out, err, time.monotonic() - started)
        pytest.fail(f"the job did not end within {limit} s: it hangs{job.explain()}")
    return Job(cmd, proc.returncode, out, err, time.monotonic() - started)


def assert_passed(job: Job, nprocs: int) -> None:
    assert job.returncode == 0, job.explain()
    oks = job.oks()
    assert sorted(oks) == list(range(nprocs)), f"not every rank reported success{job.explain()}"
    assert all(checks > 0 for checks in oks.values()), job.explain()


def test_world_size_is_needed_outside_mpiexec(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mpiexec, run(main) with no world_size says what is missing (under
    `mpiexec -n 1` it runs a world of one process: test_every_collective[1])."""
    for name in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)

    async def main(accl: object) -> None:
        raise AssertionError("no rank should run")

    with pytest.raises(ValueError, match="world_size"):
        aaccl.run(main)


# -- every operation, every dtype, both backends ------------------------------------------

@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_every_collective(nprocs: int) -> None:
    """All collectives x all dtypes x counts 0, 1, 7, 301, 1031 x first and last root x
    SUM/MAX; device-resident data; in place; 70 000-element allreduce; barrier;
    copy/combine; a send/recv ring. world_size is omitted, or equal to the job's."""
    options = ("world_size=4",) if nprocs == 4 else ()
    assert_passed(launch(nprocs, "collectives.py", "all", *options), nprocs)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_small_rx_buffers(nprocs: int) -> None:
    """4 rx buffers of 64 bytes: segmented eager messages and rendezvous."""
    assert_passed(launch(nprocs, "collectives.py", "small", "nbufs=4", "bufsize=64"), nprocs)


@pytest.mark.parametrize(("nprocs", "worker", "suite", "options"), [
    (2, "collectives.py", "all", ()),
    (3, "collectives.py", "small", ("nbufs=4", "bufsize=64")),
    (4, "features.py", "chains", ()),
    (2, "features.py", "p2p", ("nbufs=16", "bufsize=256", "timeout=1.0")),
], ids=["all-2", "small-3", "chains-4", "p2p-2"])
def test_trio_backend(nprocs: int, worker: str, suite: str, options: tuple[str, ...]) -> None:
    assert_passed(launch(nprocs, worker, suite, "backend=trio", *options), nprocs)


# -- protocol and matching ----------------------------------------------------------------

@pytest.mark.parametrize(("nprocs", "nbufs", "bufsize"), [(2, 16, 256), (3, 16, 256), (2, 8, 8192)],
                         ids=["2", "3", "2-large-eager"])
def test_point_to_point(nprocs: int, nbufs: int, bufsize: int) -> None:
    """Eager, segmented and rendezvous in every dtype; eager sends done before their
    receive is posted; tags, TAG_ANY and in-order matching; a receive that times out
    (RECEIVE_TIMEOUT_ERROR) and a rank that stays usable; a withdrawn rendezvous
    send; compression on the wire; send to self. With 8 KiB rx buffers, eager
    messages are large enough for MPI to read them from the sender's memory after
    the send has completed: the fabric must have copied them."""
    assert_passed(launch(nprocs, "features.py", "p2p", f"nbufs={nbufs}", f"bufsize={bufsize}",
                         "timeout=1.0"), nprocs)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_flow_control(nprocs: int) -> None:
    """Two 64-byte rx buffers: sends past the receiver's share wait for it, blocked
    sends do not hold up other peers, and everything arrives in order."""
    assert_passed(launch(nprocs, "features.py", "flow", "nbufs=2", "bufsize=64", "timeout=5.0"),
                  nprocs)


@pytest.mark.parametrize("suite", ["communicators", "chains", "compression"])
def test_four_ranks(suite: str) -> None:
    """Sub-communicators; waitfor chains with from_fpga/to_fpga; float16 compression."""
    assert_passed(launch(4, "features.py", suite), 4)


# -- memory over time, and withdrawals -----------------------------------------------------

def measures(job: Job) -> list[str]:
    return re.findall(r"aaccl-mpi-measure .*", job.stdout)


@pytest.mark.parametrize(("count", "stack", "backend"), [
    (200, "tcp", "asyncio"), (200, "rdma", "trio"),
    pytest.param(500, "tcp", "asyncio", marks=pytest.mark.slow),
], ids=["200-eager", "200-rendezvous-trio", "500-eager"])
def test_unreceived_large_sends_stay_with_their_sender(count: int, stack: str,
                                                       backend: str) -> None:
    """`count` 1 MiB sends posted before any receive (larger than the receiver's 16
    rx buffers of 1 KiB: eager ones that wait for their receive on "tcp", rendezvous
    on "rdma"): the receiver's peak RSS grows by less than 50 MiB while it holds every
    header (on main it held every payload: +206 MiB for 200), and then receives each
    one exactly, in order."""
    job = launch(2, "memory.py", "unreceived", f"stack={stack}", f"backend={backend}",
                 env={"AACCL_TEST_COUNT": str(count), "AACCL_TEST_KIB": "1024",
                      "AACCL_TEST_BOUND": "50"})
    assert_passed(job, 2)
    assert measures(job), job.explain()


@pytest.mark.parametrize(("count", "kib", "stack", "backend", "bound"), [
    (2000, 16, "tcp", "asyncio", 10), (600, 64, "rdma", "trio", 10),
    pytest.param(4000, 16, "rdma", "asyncio", 12, marks=pytest.mark.slow),
], ids=["2000x16KiB", "600x64KiB-rendezvous-trio", "4000x16KiB-rendezvous"])
def test_received_messages_leave_nothing_behind(count: int, kib: int, stack: str,
                                                backend: str, bound: int) -> None:
    """A ring of `count` messages of `kib` KiB under five tags: each rank's RSS after
    the last exceeds its RSS after the first tenth by less than `bound` MiB (on main
    the receiver kept every payload: +39 MiB for 3000 of 16 KiB)."""
    job = launch(2, "memory.py", "ring", f"stack={stack}", f"backend={backend}",
                 env={"AACCL_TEST_COUNT": str(count), "AACCL_TEST_KIB": str(kib),
                      "AACCL_TEST_BOUND": str(bound)})
    assert_passed(job, 2)
    assert len(measures(job)) == 2, job.explain()


@pytest.mark.parametrize("suite", ["taken", "pending"])
def test_a_withdrawal_is_the_receivers_answer(suite: str) -> None:
    """Step by step on one fabric (tests/mpi/withdrawals.py): a deadline that passes
    after the receive took the message (its acknowledgement not handled yet) does not
    fail the send (on main it did, while the receive had the data); one that passes
    before any receive fails the send only once the receiver has dropped the message,
    which no receive posted later gets (on main, one could)."""
    assert_passed(launch(1, "withdrawals.py", suite), 1)


def test_a_ranks_last_notice_goes_before_its_farewells() -> None:
    """Rank 0's "leave" notice, queued on its engine while another thread holds it and
    then held up in that thread, still goes out before rank 0's farewells, and nothing
    after them (tests/mpi/farewell.py): a peer frees the communicator once it has every
    farewell, and its next world, which MPI gives the freed context, would receive a
    late message (before, a notice still queued when the farewells went was dropped,
    and one sent in the middle of them could follow one: most likely how a 4-process
    benchmark saw rank 0 leave its second world). A second world in the same
    processes then reduces correctly."""
    assert_passed(launch(2, "farewell.py", "leave"), 2)


@pytest.mark.parametrize(("stack", "backend"), [("rdma", "asyncio"), ("tcp", "trio")])
def test_a_send_and_its_receive_agree_when_its_deadline_passes(stack: str, backend: str) -> None:
    """Sends that wait for their receive (rendezvous on "rdma"; on "tcp", larger than
    the rx buffers), received 0.5 to 1.5 timeouts late: a deadline that passes while
    the receiver takes the message (its acknowledgement in flight) asks the receiver
    to drop it, and the receiver refuses, so the send succeeds exactly when its
    receive got the data, message by message."""
    job = launch(2, "memory.py", "withdraw", "timeout=0.5", f"stack={stack}",
                 f"backend={backend}", env={"AACCL_TEST_COUNT": "12"})
    assert_passed(job, 2)
    assert measures(job), job.explain()


# -- faults -------------------------------------------------------------------------------

DEATH_TIMEOUT = 10.0
"""aaccl's timeout in the kill scenarios under `aaccl launch`, where the survivors
must learn of the death long before it."""


def assert_told_of_death(job: Job, ranks: list[int], victim: int) -> None:
    """Each of `ranks` reported a call that failed at once (well inside the
    DEATH_TIMEOUT it ran with) because `victim`'s process was killed, saying so; the
    job failed with the victim's status and ended."""
    assert job.returncode == 128 + signal.SIGKILL, job.explain()  # the victim's status
    assert not job.oks(), job.explain()
    faults = job.faults()
    assert victim not in faults, job.explain()
    for rank in ranks:
        assert rank in faults, f"rank {rank} reported no failed call{job.explain()}"
        waited, kind, call = faults[rank]
        assert kind == "Aborted", f"rank {rank}: {kind}{job.explain()}"
        assert waited < DEATH_TIMEOUT / 2, \
            f"rank {rank}'s {call} failed after {waited} s{job.explain()}"
    assert f"rank {victim} left the world: its process was killed by SIGKILL" in job.stdout, \
        job.explain()
    assert job.seconds < 20, f"the failed job took {job.seconds:.1f} s to end{job.explain()}"


@needs_hydra
@pytest.mark.parametrize("nprocs", [2, 3])
def test_killed_rank_survivors_fail_at_once_naming_it(nprocs: int) -> None:
    """The last rank SIGKILLs itself in the middle of a collective, its payload in
    flight; under `aaccl launch` the others' calls fail at once, naming the dead rank
    and its signal (its supervisor tells the launcher, which tells theirs, which tell
    them), and they exit non-zero: nothing hangs (not even MPI_Finalize, which waits
    for the dead rank unless aaccl lets it skip its barrier).

    `aaccl launch` runs every rank under a supervisor process, so hydra's proxy (which
    kills all its ranks when one dies of a signal) sees a normal exit, and passes
    -disable-auto-cleanup, so hydra does not kill the survivors either. MPICH then
    moves the ranks' messages through shared memory, where a survivor that reads a dead
    sender's memory (CMA) gets an MPI error, which the MPI fabric survives."""
    job = run_job([sys.executable, "-m", "aaccl", "launch", "-n", str(nprocs),
                   str(WORKERS / "faults.py"), "kill", f"timeout={DEATH_TIMEOUT}"],
                  FAULT_LIMIT)
    assert_told_of_death(job, list(range(nprocs - 1)), nprocs - 1)


def test_killed_rank_with_default_cleanup_ends_the_job() -> None:
    """Plain mpiexec: the launcher kills the whole job when a rank dies, at once."""
    job = launch(3, "faults.py", "kill", f"timeout={TIMEOUT}", limit=FAULT_LIMIT)
    assert job.returncode != 0, job.explain()
    assert not job.oks(), job.explain()
    assert job.seconds < 20, job.explain()


@pytest.mark.parametrize("count", [5000, 10], ids=["rendezvous", "eager"])
def test_mismatched_collectives_fail_at_once_naming_both_sides(count: int) -> None:
    """Rank 0 calls bcast, the others allreduce: the bcast's messages carry its
    fingerprint, so the receivers fail at once (DMA_MISMATCH_ERROR, naming both
    calls) and tell rank 0, whose large (rendezvous) bcast fails as well; a small
    (eager) one has completed, and rank 0 then fails with an error naming the
    ranks that failed (aaccl.run's outcome is the same on every process)."""
    job = launch(3, "faults.py", "mismatch", f"timeout={TIMEOUT}", limit=FAULT_LIMIT,
                 env={"AACCL_TEST_COUNT": str(count)})
    assert job.returncode != 0, f"the job succeeded{job.explain()}"
    faults = job.faults()
    kinds = []
    for rank in [0, 1, 2] if count > 1024 else [1, 2]:
        assert rank in faults, f"rank {rank} reported no failed call{job.explain()}"
        waited, kind, call = faults[rank]
        kinds.append(kind)
        # a rank that got no message of rank 0's bcast may learn first that rank 0,
        # its (eager) bcast done, left the world
        assert kind in ("CCLOError:DMA_MISMATCH_ERROR", "Aborted"), \
            f"rank {rank}: {kind}{job.explain()}"
        assert waited < TIMEOUT / 2, f"rank {rank}'s {call} failed after {waited} s"
    assert "CCLOError:DMA_MISMATCH_ERROR" in kinds, job.explain()
    assert "rank 0 called bcast(count=" in job.stderr + job.stdout, job.explain()
    if count <= 1024:  # rank 0's bcast is done (unless a notice came first); it fails
        assert 0 in faults or re.search(  # too, naming the ranks that did
            r"ACCLError: rank [12] failed: CCLOError: allreduce", job.stderr), job.explain()


def assert_aborted_at_once(job: Job, ranks: tuple[int, ...]) -> None:
    """The job failed, and each of `ranks` reported a call that failed with Aborted
    long before its timeout."""
    assert job.returncode != 0, f"the job succeeded{job.explain()}"
    faults = job.faults()
    for rank in ranks:
        assert rank in faults, f"rank {rank} reported no failed call{job.explain()}"
        waited, kind, call = faults[rank]
        assert kind == "Aborted", f"rank {rank}: {kind}{job.explain()}"
        assert waited < TIMEOUT, f"rank {rank}'s {call} failed after {waited} s{job.explain()}"


def test_a_rank_that_raises_tells_the_others_whose_calls_fail_at_once() -> None:
    """Rank 1's program raises: it leaves the world and says so, and the others'
    calls waiting for it (or for a rank that learned it) fail with Aborted, naming
    rank 1 and its error, long before their timeout."""
    job = launch(3, "faults.py", "quit", f"timeout={30 * TIMEOUT}", limit=FAULT_LIMIT)
    assert_aborted_at_once(job, (0, 2))
    assert "rank 1 left the world: rank 1 raised RuntimeError: rank 1's own code gave up" \
        in job.stdout, job.explain()
    assert "RuntimeError: rank 1's own code gave up" in job.stderr, job.explain()
    assert job.seconds < 20, f"the failed job took {job.seconds:.1f} s to end{job.explain()}"


def test_a_rank_aborted_by_a_leaver_leaves_too() -> None:
    """Rank 2 raises; rank 0's receive from it is aborted, which ends rank 0's program;
    rank 1 waits for a message from rank 0. Rank 0 leaves the world as any rank whose
    program raised does (it left without a word when its error was an Aborted), so
    rank 1's receive fails at once, naming the chain, not at its timeout."""
    job = launch(3, "faults.py", "relay", f"timeout={30 * TIMEOUT}", limit=FAULT_LIMIT)
    assert_aborted_at_once(job, (0, 1))
    assert "rank 0 left the world: rank 0 raised Aborted" in job.stdout, job.explain()
    assert "RuntimeError: rank 2's own code gave up" in job.stderr, job.explain()
    assert job.seconds < 20, f"the failed job took {job.seconds:.1f} s to end{job.explain()}"


def test_a_rank_whose_world_closes_is_not_waited_for_to_gather() -> None:
    """Rank 2's program raises SystemExit: its world closes, and it gathers no results
    (nor does a rank whose world a Ctrl-C cancelled). The others, whose programs
    returned, learn that it left with its world closed and fail at once, naming it;
    they waited for its process to end before, and it waited (up to the timeout) for
    their farewells, which they say after gathering: the job took the timeout."""
    job = launch(3, "faults.py", "exit", f"timeout={30 * TIMEOUT}", limit=FAULT_LIMIT)
    assert job.returncode != 0, f"the job succeeded{job.explain()}"
    for rank in (0, 1):
        assert re.search(rf"rank {rank} cannot gather every rank's result: rank 2 left the "
                         "world: its world closed", job.stdout + job.stderr), job.explain()
    assert job.seconds < 15, f"the failed job took {job.seconds:.1f} s to end{job.explain()}"
