"""A process killed in the middle of large allreduces, as real MPI processes.

Each trial starts a job whose ranks run 16 MiB allreduces in a loop (timeout=5), kills
a random rank with SIGKILL or SIGTERM once every rank has finished one, and checks
what DESIGN.md promises ("Fail fast, everywhere, and say why"; a killed process):

- under `aaccl launch`, every survivor reports a failed call (an ACCLError) within the
  timeout, and exits;
- the job exits with a non-zero status within the timeout + 15 s: never a hang;
- no process of the job (ranks, their supervisors, hydra's proxy, mpiexec) is left.

Under plain `mpiexec -n N`, hydra kills every rank as soon as one dies of a signal, so
nobody reports; the job still ends at once, non-zero, with nothing left.
benchmarks/bench_faults.py runs the same trials and prints their figures.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import benchmark_module

pytest.importorskip("mpi4py")  # the package only: MPI itself starts in the jobs

procs = benchmark_module("_procs")  # the fault benchmark watches its jobs alike

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 5.0  # aaccl's timeout in the jobs
GRACE = 15.0  # a job must be gone this long after the timeout
MARK = "aaccl-fault"

WORKER = f'''
import os, sys
import numpy as np
import aaccl
from aaccl import ReduceFunction

COUNT = 4 << 20  # 16 MiB of float32


def say(text):
    sys.stdout.write(text + "\\n")
    sys.stdout.flush()


async def main(accl):
    src, dst = accl.allocate(COUNT, np.float32), accl.allocate(COUNT, np.float32)
    src[:] = 1
    src.sync_to_device()
    rounds = 0
    while True:
        try:
            await accl.allreduce(src, dst, COUNT, ReduceFunction.SUM, from_fpga=True,
                                 to_fpga=True)
        except aaccl.ACCLError as exc:
            say(f"{MARK}-error rank={{accl.rank}} {{type(exc).__name__}}: {{exc}}")
            raise
        rounds += 1
        if rounds == 1:
            say(f"{MARK}-ready rank={{accl.rank}} pid={{os.getpid()}}")


aaccl.run(main, timeout=float(sys.argv[1]))
'''


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")


# -- one trial ------------------------------------------------------------------------------

@dataclass
class Trial:
    launcher: str
    nprocs: int
    signal: str
    victim: int = -1
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid of its program
    reports: dict[int, tuple[float, str]] = field(default_factory=dict)  # after the kill
    returncode: int | None = None
    exit_after: float | None = None  # seconds from the kill to the job's exit
    hung: bool = False
    leftovers: list[int] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""

    def explain(self) -> str:
        def tail(text: str) -> str:
            return text if len(text) < 5000 else "...\n" + text[-5000:]

        return (f"\n{self.launcher} launch of {self.nprocs} ranks, rank {self.victim} "
                f"(pid {self.pids.get(self.victim)}) killed with SIG{self.signal}: exit status "
                f"{self.returncode} {self.exit_after and round(self.exit_after, 2)} s after the "
                f"kill, reports {self.reports}, leftovers {self.leftovers}\n--- stdout\n"
                f"{tail(self.stdout)}\n--- stderr\n{tail(self.stderr)}")


def run_trial(worker: Path, launcher: str, nprocs: int, sig: str,
              rng: random.Random) -> Trial:
    """Start the job, kill a random rank once all are under way, wait for the end."""
    assert MPIEXEC is not None
    marker = f"--aaccl-test-{uuid.uuid4().hex}"
    program = [str(worker), str(TIMEOUT), marker]
    if launcher == "aaccl":
        cmd = [sys.executable, "-m", "aaccl", "launch", "-n", str(nprocs), *program]
    else:
        cmd = [MPIEXEC, "-n", str(nprocs), sys.executable, *program]
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    trial = Trial(launcher, nprocs, sig)
    live = procs.LiveJob(cmd, env, ROOT)
    proc, lines = live.proc, live.lines
    job: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while len(trial.pids) < nprocs and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            trial.pids = {int(rank): int(pid) for _, line in list(lines)
                          for rank, pid in re.findall(rf"{MARK}-ready rank=(\d+) pid=(\d+)", line)}
        if len(trial.pids) < nprocs:
            trial.stdout, trial.stderr = live.stdout, live.stderr
            pytest.fail(f"the job did not start: only ranks {sorted(trial.pids)} got going"
                        f"{trial.explain()}")
        time.sleep(rng.uniform(0, 0.5))  # somewhere inside an allreduce
        job = procs.descendants(proc.pid) | {proc.pid}
        trial.victim = rng.randrange(nprocs)
        killed = time.monotonic()
        os.kill(trial.pids[trial.victim], getattr(signal, f"SIG{sig}"))
        try:
            proc.wait(TIMEOUT + GRACE)
        except subprocess.TimeoutExpired:
            trial.hung = True
        trial.exit_after = time.monotonic() - killed
        job |= set(trial.pids.values()) | procs.with_marker(marker)
        trial.leftovers = sorted(pid for pid in job if pid != proc.pid and procs.alive(pid))
    finally:
        procs.kill(job | procs.descendants(proc.pid) | procs.with_marker(marker) | {proc.pid})
        proc.wait()
        live.join(10)
    trial.returncode = proc.returncode
    trial.stdout, trial.stderr = live.stdout, live.stderr
    for when, line in lines:
        found = re.match(rf"{MARK}-error rank=(\d+) (.*)", line)
        if found and int(found[1]) != trial.victim:
            trial.reports.setdefault(int(found[1]), (when - killed, found[2]))
    return trial


def assert_contained(trial: Trial) -> None:
    """The job ended in time, non-zero, with no process left."""
    assert not trial.hung, f"the job still ran {TIMEOUT + GRACE} s after the kill{trial.explain()}"
    assert trial.returncode != 0, f"the job exited with status 0{trial.explain()}"
    assert not trial.leftovers, f"processes outlived the job{trial.explain()}"


def assert_survivors_reported(trial: Trial) -> None:
    """Every survivor printed its failed call within about the timeout."""
    survivors = set(range(trial.nprocs)) - {trial.victim}
    assert set(trial.reports) == survivors, \
        f"survivors {sorted(survivors - set(trial.reports))} reported nothing{trial.explain()}"
    for rank, (after, text) in trial.reports.items():
        assert re.match(r"(CCLOError|Aborted|ACCLError): ", text), \
            f"rank {rank} reported {text!r}{trial.explain()}"
        assert after <= TIMEOUT + 3, \
            f"rank {rank} reported {after:.1f} s after the kill{trial.explain()}"


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "allreduce_until_killed.py"
    path.write_text(WORKER)
    return path


@pytest.mark.parametrize(("nprocs", "sig"), [(4, "KILL"), (3, "TERM")])
def test_killed_rank_under_aaccl_launch(worker: Path, nprocs: int, sig: str) -> None:
    trial = run_trial(worker, "aaccl", nprocs, sig, random.Random(nprocs))
    assert_contained(trial)
    assert_survivors_reported(trial)


def test_killed_rank_under_plain_mpiexec(worker: Path) -> None:
    """hydra's default: the proxy kills every rank when one dies of a signal. Nobody
    reports, but the job ends at once, non-zero, with nothing left."""
    trial = run_trial(worker, "mpiexec", 3, "KILL", random.Random(0))
    assert_contained(trial)
    assert trial.exit_after is not None and trial.exit_after < 5, trial.explain()


@pytest.mark.slow
def test_repeated_kills_never_hang_nor_leave_processes(worker: Path) -> None:
    """10 trials: 4 and 3 processes, SIGKILL and SIGTERM, a random rank each time."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for i in range(10):
        trial = run_trial(worker, "aaccl", (4, 3)[i // 2 % 2], ("KILL", "TERM")[i % 2], rng)
        where = f"\ntrial {i + 1} of 10 (seed {seed})"
        try:
            assert_contained(trial)
            assert_survivors_reported(trial)
        except AssertionError as failure:
            raise AssertionError(f"{failure}{where}") from None


# -- leaving: Ctrl-C, late finishers -------------------------------------------------------

INTERRUPTED = f'''
import os, sys
import numpy as np
import aaccl
from aaccl import ReduceFunction


async def main(accl):
    src, dst = accl.allocate(1024, np.float32), accl.allocate(1024, np.float32)
    rounds = 0
    while True:
        await accl.allreduce(src, dst, 1024, ReduceFunction.SUM)
        rounds += 1
        if rounds == 1:
            sys.stdout.write(f"{MARK}-ready rank={{accl.rank}} pid={{os.getpid()}}\\n")
            sys.stdout.flush()


aaccl.run(main, timeout=5.0)
'''


def interrupt_trial(script: Path, nprocs: int,
                    launcher: list[str] | None = None) -> tuple[int, str, list[int]]:
    """Start `mpiexec -n nprocs` (or `launcher -n nprocs`) on `script`, Ctrl-C it
    (SIGINT to the launcher, which forwards it to every rank) once every rank is in
    its loop of allreduces; return its exit status, its output and the processes of
    the job left running."""
    assert MPIEXEC is not None
    marker = f"--aaccl-test-{uuid.uuid4().hex}"
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OPENBLAS_NUM_THREADS": "1"}
    if launcher is None:
        start = [MPIEXEC, "-n", str(nprocs), sys.executable]
    else:
        start = [*launcher, "-n", str(nprocs)]
    live = procs.LiveJob([*start, str(script), marker], env, ROOT)
    proc = live.proc
    try:
        deadline = time.monotonic() + 90
        while sum(f"{MARK}-ready" in line for _, line in list(live.lines)) < nprocs \
                and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the job ended before it was interrupted:\n{live.stderr}"
        job = procs.descendants(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        left = sorted(pid for pid in job | procs.with_marker(marker) if procs.alive(pid))
    finally:
        procs.kill(procs.descendants(proc.pid) | procs.with_marker(marker) | {proc.pid})
        proc.wait()
        live.join(10)
    return proc.returncode, live.stdout + live.stderr, left


def assert_interrupted_cleanly(status: int, output: str, left: list[int]) -> None:
    """No rank crashed, the status says the job was interrupted, nothing is left.

    Every rank exits 130 (after MPI_Finalize) instead of dying of SIGINT. Once
    mpiexec has forwarded a Ctrl-C, it SIGKILLs the ranks still running as soon as one
    exits, whatever its status: its own status is 130 when every rank got out first,
    else 9 (its SIGKILL); 131 (130 | 1) when a rank whose SIGINT came late had its
    calls aborted by an interrupted peer first, and exited 1 with that error. Before,
    ranks died of SIGINT and hydra reported the job as 2 | 9 = 11, "Segmentation
    fault (signal 11)"."""
    assert "Segmentation fault" not in output and "signal 11" not in output, output[-3000:]
    assert status in (128 + signal.SIGINT, (128 + signal.SIGINT) | 1, signal.SIGKILL), \
        f"exit status {status}:\n{output[-3000:]}"
    assert not left, f"processes outlived the job: {left}"


@pytest.fixture(params=["asyncio", "trio"])
def interrupted(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    path = tmp_path / "allreduce_until_interrupted.py"
    path.write_text(INTERRUPTED.replace("timeout=5.0)", f"timeout=5.0, backend={request.param!r})"))
    return path


def test_ctrl_c_under_plain_mpiexec_is_clean(interrupted: Path) -> None:
    for i in range(3):
        status, output, left = interrupt_trial(interrupted, 4)
        assert_interrupted_cleanly(status, output, left)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_under_aaccl_launch_exits_130(tmp_path: Path, backend: str) -> None:
    """Under `aaccl launch` every rank's supervisor reports its program's status, and
    the job's is the highest of them: a rank interrupted by Ctrl-C says 130, as a
    shell says of a Python program that dies of its KeyboardInterrupt (a rank whose
    calls an interrupted peer aborted before its own SIGINT came says 1). Before,
    the supervisor reported a KeyboardInterrupt as 1 like any other exception.

    On trio, a SIGINT sent to the launcher alone left the job running past 30 s (2
    of 5 runs of two trials): trio raised the KeyboardInterrupt inside a soft CCLO
    event, leaving a call no abort could end, which the world's closing waited for;
    events are KI-protected under trio now."""
    script = tmp_path / "allreduce_until_interrupted.py"
    script.write_text(INTERRUPTED.replace("timeout=5.0)", f"timeout=5.0, backend={backend!r})"))
    for i in range(2):
        status, output, left = interrupt_trial(
            script, 3, [sys.executable, "-m", "aaccl", "launch"])
        assert "Segmentation fault" not in output and "signal 11" not in output, output[-3000:]
        assert status == 128 + signal.SIGINT, f"exit status {status}:\n{output[-3000:]}"
        assert not left, f"processes outlived the job: {left}"


@pytest.mark.slow
def test_ctrl_c_under_plain_mpiexec_is_clean_10_trials(interrupted: Path) -> None:
    statuses = []
    for i in range(10):
        status, output, left = interrupt_trial(interrupted, 4 - i % 2)
        statuses.append(status)
        try:
            assert_interrupted_cleanly(status, output, left)
        except AssertionError as failure:
            raise AssertionError(f"trial {i + 1} of 10 (statuses so far {statuses}): "
                                 f"{failure}") from None


@pytest.mark.parametrize("launcher", ["mpiexec", "aaccl"])
def test_a_rank_whose_own_code_finishes_late_does_not_fail_the_job(launcher: str) -> None:
    """The last rank's own code takes 5 s more than the others' (timeout=1): the
    others wait for it to leave as long as its process lives, and every rank gets
    every rank's result."""
    assert MPIEXEC is not None
    suite = [str(ROOT / "tests" / "mpi" / "faults.py"), "late", "timeout=1.0"]
    cmd = [MPIEXEC, "-n", "3", sys.executable, *suite] if launcher == "mpiexec" else \
        [sys.executable, "-m", "aaccl", "launch", "-n", "3", *suite]
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OPENBLAS_NUM_THREADS": "1"}
    started = time.monotonic()
    job = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=90, start_new_session=True, stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    explain = f"\nexit {job.returncode} after {took:.1f} s\n{job.stdout}\n{job.stderr[-3000:]}"
    assert job.returncode == 0, explain
    assert len(re.findall(r"aaccl-mpi-ok suite=late rank=\d size=3 checks=1", job.stdout)) == 3, \
        explain
    assert took >= 5, explain  # (the late rank's own 5 s)


def test_a_late_rank_killed_while_the_others_wait_to_leave_fails_them_at_once() -> None:
    """The late rank's process is killed 1 s into its own code, while the others wait
    for it to leave (timeout=1, which does not bound that wait): they fail at once,
    and the job ends with its status."""
    suite = [str(ROOT / "tests" / "mpi" / "faults.py"), "late", "timeout=1.0"]
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OPENBLAS_NUM_THREADS": "1",
           "AACCL_TEST_LATE_DIES": "1"}
    started = time.monotonic()
    job = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "3", *suite],
                         check=False, capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=90, start_new_session=True, stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    explain = f"\nexit {job.returncode} after {took:.1f} s\n{job.stdout}\n{job.stderr[-3000:]}"
    assert job.returncode == 128 + signal.SIGKILL, explain
    for rank in (0, 1):
        # (named by its pid's end, or by the launcher's word, whichever came first)
        assert re.search(rf"rank {rank} cannot gather every rank's result: (.*rank 2|a "
                         "process of this MPI job ended)", job.stdout + job.stderr), explain
    assert took < 15, explain  # (start-up, 1 s of the late rank's code, then at once)


def test_a_killed_launcher_takes_its_job_with_it(tmp_path: Path) -> None:
    """`aaccl launch` SIGKILLed (kill -9, a batch system's time limit): Linux kills
    its mpiexec, whose proxies end the ranks. mpiexec and every rank ran on for good
    before, orphaned."""
    script = tmp_path / "allreduce_until_interrupted.py"
    script.write_text(INTERRUPTED)
    marker = f"--aaccl-test-{uuid.uuid4().hex}"
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OPENBLAS_NUM_THREADS": "1"}
    live = procs.LiveJob([sys.executable, "-m", "aaccl", "launch", "-n", "2", str(script),
                          marker], env, ROOT)
    proc, job = live.proc, set()
    try:
        deadline = time.monotonic() + 90
        while sum(f"{MARK}-ready" in line for _, line in list(live.lines)) < 2 \
                and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, f"the job ended before its launcher was killed:\n{live.stderr}"
        job = procs.descendants(proc.pid)
        assert job, "the launcher has no processes under it"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while (left := sorted(p for p in job | procs.with_marker(marker) if procs.alive(p))) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes outlived their killed launcher: {left}"
    finally:
        procs.kill(job | procs.with_marker(marker) | ({proc.pid} if proc.poll() is None else set()))
        proc.wait()
        live.join(10)


OPENINGS = """
import sys, time
import numpy as np
import aaccl

mode, me = sys.argv[1], aaccl.process_rank()


async def main(accl):
    data = accl.allocate(8, np.float32)
    data[:] = 1
    await accl.allreduce(data, data, 8, aaccl.ReduceFunction.SUM)
    return float(data[0])


if mode == "early" and me == 1:
    time.sleep(0.2)  # rank 0 is in MPI's start-up (MPI_Init) by now
    raise FileNotFoundError("input.npy")
aaccl.run(main, timeout=1.0)
if mode == "late" and me == 1:
    time.sleep(3)  # its own code, longer than the timeout, before the next world
if mode == "late" or me == 2:
    started = time.monotonic()
    try:
        results = aaccl.run(main, timeout=5.0)
    except aaccl.ACCLError as error:
        print(f"reopen-failed rank={me} after={time.monotonic() - started:.2f}: {error}",
              flush=True)
        raise
    print(f"reopened rank={me} results={results}", flush=True)
"""


def _openings(tmp_path: Path, mode: str, cmd: list[str],
              ) -> tuple[subprocess.CompletedProcess[str], float, str]:
    """Run OPENINGS's `mode` with `cmd`: the job, how long it took, what to show."""
    assert MPIEXEC is not None
    script = tmp_path / "openings.py"
    script.write_text(OPENINGS)
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OPENBLAS_NUM_THREADS": "1"}
    started = time.monotonic()
    job = subprocess.run([*cmd, str(script), mode], check=False, capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=90, start_new_session=True,
                         stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    explain = f"\nexit {job.returncode} after {took:.1f} s\n{job.stdout}\n{job.stderr[-3000:]}"
    return job, took, explain


@pytest.mark.parametrize("launcher", ["aaccl", "mpiexec"])
def test_a_world_opened_after_its_peers_exited_fails_at_once(tmp_path: Path,
                                                             launcher: str) -> None:
    """Ranks 0 and 1 run one world and exit (status 0); rank 2 opens a second one: its
    opening fails at once, naming a rank that is gone, where MPI's Comm.Dup waited for
    them forever."""
    assert MPIEXEC is not None
    cmd = [MPIEXEC, "-n", "3", sys.executable] if launcher == "mpiexec" else \
        [sys.executable, "-m", "aaccl", "launch", "-n", "3"]
    job, took, explain = _openings(tmp_path, "reopen", cmd)
    assert job.returncode != 0, explain
    failed = re.search(r"reopen-failed rank=2 after=([\d.]+): rank 2 cannot open its MPI "
                       r"world \(open_world\): (.*)", job.stdout)
    assert failed, explain
    assert float(failed[1]) < 3, explain  # (ranks 0 and 1 exit within about a second)
    assert re.match(r"(rank [01]('s process \(pid \d+\))? ended|a process of this MPI job "
                    r"ended)", failed[2]), explain
    assert "reopened" not in job.stdout, explain
    assert took < 30, explain


def test_a_rank_late_to_open_its_world_is_waited_for(tmp_path: Path) -> None:
    """Rank 1's own code takes 3 s between two worlds (timeout=1): the others wait for
    it to open the second as long as its process lives, and the world works."""
    job, took, explain = _openings(tmp_path, "late",
                                   [sys.executable, "-m", "aaccl", "launch", "-n", "3"])
    assert job.returncode == 0, explain
    assert len(re.findall(r"reopened rank=\d results=\[3.0, 3.0, 3.0\]", job.stdout)) == 3, \
        explain
    assert took >= 3, explain


def test_a_rank_that_fails_before_mpi_starts_ends_the_job(tmp_path: Path) -> None:
    """Rank 1's program raises before it starts MPI, while rank 0 waits in MPI_Init for
    it (forever: hydra does not end the job). `aaccl launch` ends rank 0 `--grace`
    seconds after rank 1's failure, says so, and exits with rank 1's status."""
    job, took, explain = _openings(tmp_path, "early", [
        sys.executable, "-m", "aaccl", "launch", "-n", "2", "--grace", "1"])
    assert job.returncode == 1, explain
    assert "FileNotFoundError: input.npy" in job.stderr, explain
    assert ("aaccl launch: rank 1's program exited with status 1; rank 0 still runs 1 s "
            "later: ending it (SIGTERM") in job.stderr, explain
    assert took < 20, explain
