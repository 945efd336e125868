"""`aaccl launch`: the mpiexec command line it builds, and a real launch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aaccl.cli import command, main


def test_command_for_hydra_keeps_survivors_alive() -> None:
    cmd = command("/x/mpiexec", 4, ["app.py", "--flag"], "hosts.txt", hydra=True)
    assert cmd == ["/x/mpiexec", "-n", "4", "-f", "hosts.txt", "-disable-auto-cleanup",
                   sys.executable, "app.py", "--flag"]


def test_command_on_one_machine_gives_each_rank_its_own_proxy() -> None:
    cmd = command("mpiexec", 3, ["app.py"], None, hydra=True)
    assert cmd == ["mpiexec", "-n", "3", "-disable-auto-cleanup", "-launcher", "fork",
                   "-hosts", "127.0.0.1,127.0.0.2,127.0.0.3", "-ppn", "1",
                   sys.executable, "app.py"]


def test_command_for_other_launchers() -> None:
    cmd = command("mpirun", 2, ["-m", "pkg.app"], "hosts", hydra=False)
    assert cmd == ["mpirun", "-n", "2", "--hostfile", "hosts", sys.executable, "-m", "pkg.app"]


def test_bad_arguments_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["launch", "-n", "0", "app.py"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["launch", "-n", "2"])
    assert "program" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("mpiexec") is None and not (Path(sys.executable).parent / "mpiexec").exists(),
                    reason="no mpiexec: pip install 'aaccl[mpi]'")
def test_launch_forwards_the_jobs_exit_code(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    script = tmp_path / "app.py"
    script.write_text("import sys\nfrom mpi4py import MPI\n"
                      "sys.exit(7 if MPI.COMM_WORLD.rank == 1 else 0)\n")
    done = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "2", str(script)],
                          timeout=120)
    assert done.returncode == 7
    ok = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "2", "--", "-c",
                         "pass"], timeout=120)
    assert ok.returncode == 0
