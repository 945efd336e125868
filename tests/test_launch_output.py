"""What `aaccl launch` prints when things go wrong (a missing program, Ctrl-C, an
error on every rank), the variables it gives each rank, and the process's rank and
size under it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import benchmark_module

ROOT = Path(__file__).resolve().parents[1]
HAVE_MPI = (importlib.util.find_spec("mpi4py") is not None
            and (shutil.which("mpiexec") is not None
                 or (Path(sys.executable).parent / "mpiexec").exists()))
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="no MPI: pip install 'aaccl[mpi]'")
LIMIT = 120  # seconds any job may take


def environment() -> dict[str, str]:
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1"}


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aaccl", "launch", *args], cwd=cwd,
                          env=environment(), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=LIMIT)


def test_a_missing_script_is_one_line_and_status_2(tmp_path: Path) -> None:
    done = launch("-n", "2", "missing.py", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"aaccl launch: can't open file {str(tmp_path / 'missing.py')!r}: "
        "[Errno 2] No such file or directory"]


def test_a_folder_with_no_main_is_one_line_and_status_1(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    done = launch("-n", "2", "app", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["aaccl launch: can't find '__main__' module in 'app'"]


@needs_mpi
def test_a_missing_module_is_one_line_per_rank(tmp_path: Path) -> None:
    done = launch("-n", "2", "-m", "no_such_module_here", cwd=tmp_path)
    assert done.returncode == 1
    assert [line.split(": ", 1)[1] for line in done.stderr.splitlines()] == \
        ["No module named no_such_module_here"] * 2


@needs_mpi
def test_each_rank_gets_torchruns_variables_and_its_process_rank(tmp_path: Path) -> None:
    code = ("import os, aaccl\n"
            "names = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')\n"
            "words = [aaccl.process_rank(), aaccl.process_count(), "
            "*[os.environ[n] for n in names]]\n"
            "os.write(1, (' '.join(map(str, words)) + '\\n').encode())\n")  # a whole line
    done = launch("-n", "3", "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"{r} 3 {r} 3 {r} 3" for r in range(3)]


@needs_mpi
def test_an_error_on_every_rank_prints_one_traceback(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(
        "import numpy as np, aaccl\n"
        "async def main(accl):\n"
        "    buf = accl.allocate(8, np.float32 if accl.rank == 0 else np.float64)\n"
        "    await accl.allreduce(buf, buf, 8, aaccl.ReduceFunction.SUM)\n"
        "aaccl.run(main, timeout=5)\n")
    done = launch("-n", "3", "app.py", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert "aaccl.CCLOError: allreduce (rank 0, call 1) failed" in done.stderr
    assert "aaccl.run: ranks 0-2 raised this error" in done.stderr


@needs_mpi
def test_the_demo_prints_once(tmp_path: Path) -> None:
    done = launch("-n", "3", str(ROOT / "examples" / "demo.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("aaccl ")] == \
        [lines[0]] and "3 ranks on the soft CCLO, one process per rank (MPI)" in lines[0]
    assert sum("rank 2: ring: got" in line for line in lines) == 1


def test_the_demo_in_process() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--ranks", "3"],
                          env=environment(), capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("aaccl ") and "3 ranks on the soft CCLO, in this process" \
        in done.stdout.splitlines()[0]


SLEEPER = """
import anyio, aaccl
async def main(accl):
    buf = accl.allocate(4)
    await accl.allreduce(buf, buf, 4, aaccl.ReduceFunction.SUM)
    print("ready", accl.rank, flush=True)
    await anyio.sleep_forever()
aaccl.run(main)
"""


@needs_mpi
def test_ctrl_c_prints_one_short_message(tmp_path: Path) -> None:
    """SIGINT to the launcher once every rank said it is running (a terminal's Ctrl-C
    goes to the launcher's whole group, mpiexec included, and the launcher then
    leaves mpiexec's own to hydra): no traceback per rank, one line from aaccl
    launch."""
    procs = benchmark_module("_procs")
    nprocs = 3
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    job = procs.LiveJob([sys.executable, "-m", "aaccl", "launch", "-n", str(nprocs),
                         str(script)], environment(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while sum(text.startswith("ready") for _, text in job.lines) < nprocs:
            assert job.proc.poll() is None, job.stderr
            # (this once xfailed as "hydra's proxy ended early": it was the ranks' lines
            # mixing mid-line under PYTHONUNBUFFERED, fixed by whole lines always)
            assert time.monotonic() < deadline, f"no markers in 30 s: {job.lines}"
            time.sleep(0.01)  # (the marker comes through the reader thread)
        job.proc.send_signal(signal.SIGINT)
        try:
            job.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # the same, open: the proxy exits on the SIGINT without passing it on
            pytest.xfail("mpiexec did not pass the Ctrl-C on (hydra, open issue)")
        job.join(10)
    finally:
        if job.proc.poll() is None:  # the launcher, mpiexec and every rank (by its script:
            ranks = subprocess.run(["pgrep", "-f", str(script)],  # init may hold them)
                                   capture_output=True, text=True).stdout.split()
            procs.kill({job.proc.pid} | procs.descendants(job.proc.pid) | set(map(int, ranks)))
            job.proc.wait()
    out, err = job.stdout, job.stderr
    assert job.proc.returncode == 128 + signal.SIGINT
    assert "Traceback" not in err + out, err
    assert f"aaccl launch: interrupted (Ctrl-C); the job's {nprocs} ranks ended" in err
    assert len((out + err).strip().splitlines()) <= nprocs + 4, out + err  # hydra: 2 lines


@needs_mpi
def test_the_program_starts_as_under_python_with_a_share_of_the_cores(tmp_path: Path) -> None:
    """Nothing of aaccl (nor numpy) is imported before the program, so it can still set
    OPENBLAS_NUM_THREADS; where it sets none, the ranks share the cores."""
    code = ("import os, sys\n"  # one write: a whole line
            "sys.stdout.write(f\"{'numpy' in sys.modules} {'aaccl' in sys.modules} "
            "{os.environ.get('OPENBLAS_NUM_THREADS')} {os.environ.get('MKL_NUM_THREADS')}\\n\")\n")
    env = {k: v for k, v in environment().items() if not k.endswith("_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "2", "-c", code],
                          cwd=tmp_path, env={**env, "MKL_NUM_THREADS": "7"},
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=LIMIT)
    assert done.returncode == 0, done.stderr
    share = str(max(1, (os.cpu_count() or 1) // 2))
    assert done.stdout.splitlines() == [f"False False {share} 7"] * 2


@needs_mpi
def test_lines_of_ranks_never_mix_even_unbuffered(tmp_path: Path) -> None:
    """print under PYTHONUNBUFFERED (as containers often set it) writes a line's words,
    separators and newline apart; each rank still hands the launcher whole lines."""
    code = ("import os\n"
            "for i in range(200):\n"
            "    print('rank', os.environ['RANK'], 'line', i, 'x' * 40)\n")
    done = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "3", "-c", code],
                          cwd=tmp_path, env={**environment(), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=LIMIT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert sorted(lines) == sorted(f"rank {r} line {i} {'x' * 40}" for r in range(3)
                                   for i in range(200))


def test_the_supervisor_names_the_attribute_run_sets() -> None:
    from aaccl.api import _world
    from aaccl.cli import _rank

    assert _rank.REPORTED_BY == _world.REPORTED_BY
