"""`aaccl launch`: the mpiexec command line it builds, and a real launch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aaccl.cli import command, main
from aaccl.cli._launch import job_status

RANK = [sys.executable, "-m", "aaccl.cli._rank"]  # each rank records its exit status


def test_command_for_hydra_keeps_survivors_alive() -> None:
    cmd = command("/x/mpiexec", 4, ["app.py", "--flag"], "hosts.txt", hydra=True)
    assert cmd == ["/x/mpiexec", "-n", "4", "-f", "hosts.txt", "-disable-auto-cleanup",
                   *RANK, "app.py", "--flag"]


def test_command_on_one_machine_keeps_one_proxy_and_each_rank_supervised() -> None:
    """One proxy per machine (MPICH's shared memory between local ranks survives a
    dead peer); each rank runs under the supervisor that outlives its program."""
    cmd = command("mpiexec", 3, ["app.py"], None, hydra=True)
    assert cmd == ["mpiexec", "-n", "3", "-disable-auto-cleanup", *RANK, "app.py"]


def test_command_for_other_launchers() -> None:
    cmd = command("mpirun", 2, ["-m", "pkg.app"], "hosts", hydra=False)
    assert cmd == ["mpirun", "-n", "2", "--hostfile", "hosts", *RANK, "-m", "pkg.app"]


def test_job_status_prefers_the_ranks_own_statuses() -> None:
    assert job_status(255, [0, 7], 2) == 7  # hydra's own error hides the rank's status
    assert job_status(0, [0, 0, 0], 3) == 0
    assert job_status(9, [1, 1], 3) == 9  # a rank died without a status: the launcher's
    assert job_status(0, [0], 2) == 1  # missing a status is never success


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
    synced = tmp_path / "synced.py"
    synced.write_text("import sys\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
                      "sys.exit(7 if MPI.COMM_WORLD.rank == 1 else 0)\n")
    for _ in range(3):  # hydra alone sometimes reports 255 here
        again = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "2", str(synced)],
                               timeout=120)
        assert again.returncode == 7
    ok = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "2", "--", "-c",
                         "pass"], timeout=120)
    assert ok.returncode == 0


# -- aaccl info ----------------------------------------------------------------------------

INFO_DEVICES = ["soft", "soft over MPI", "emulator", "xrt", "pynq"]


@pytest.fixture
def no_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make pyxrt and pynq fail to import, as on a machine without them (this one)."""
    monkeypatch.setitem(sys.modules, "pyxrt", None)
    monkeypatch.setitem(sys.modules, "pynq", None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text_rows(out: str) -> dict[str, tuple[str, str]]:
    """`aaccl info`'s table: device (padded), yes/no, detail."""
    width = max(map(len, INFO_DEVICES))
    lines = out.strip().splitlines()
    assert [line[:width].rstrip() for line in lines] == INFO_DEVICES
    return {line[:width].rstrip(): (line[width + 2:width + 5].strip(), line[width + 5:].strip())
            for line in lines}


def _check_unavailable_cards(xrt: str, pynq: str) -> None:
    assert "pyxrt" in xrt and "install XRT" in xrt
    assert "pynq 3.0.1" in pynq and "pip install 'aaccl[pynq]'" in pynq


def test_info_lists_every_device_and_finds_a_running_emulator(
        capsys: pytest.CaptureFixture[str], no_cards: None) -> None:
    pytest.importorskip("zmq")
    from test_emulator_protocol import FakeEmulator

    fake = FakeEmulator()
    try:
        assert main(["info", "--emulator-port", str(fake.port)]) == 0
    finally:
        fake.close()
    rows = _text_rows(capsys.readouterr().out)
    assert rows["soft"][0] == "yes"
    assert rows["emulator"] == ("yes", rows["emulator"][1])
    assert f"tcp://127.0.0.1:{fake.port}" in rows["emulator"][1]
    assert rows["xrt"][0] == rows["pynq"][0] == "no"
    _check_unavailable_cards(rows["xrt"][1], rows["pynq"][1])
    mpi, why = rows["soft over MPI"]
    assert mpi in ("yes", "no") and ("mpi4py" in why)


def test_info_json_without_an_emulator(capsys: pytest.CaptureFixture[str], no_cards: None,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    pytest.importorskip("zmq")
    from aaccl.devices import _emulator

    real = _emulator.EmulatorDevice  # wait 0.2 s, not `available`'s 1 s, for no answer
    monkeypatch.setattr(_emulator, "EmulatorDevice",
                        lambda *a, **kw: real(*a, **{**kw, "connect_timeout": 0.2}))
    port = _free_port()
    assert main(["info", "--json", "--emulator-port", str(port)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["device"] for row in rows] == INFO_DEVICES
    assert all(set(row) == {"device", "available", "detail"} and isinstance(row["available"], bool)
               and row["detail"] for row in rows)
    by = {row["device"]: row for row in rows}
    assert by["soft"]["available"] is True
    assert by["emulator"]["available"] is False
    assert f"no emulator answers at tcp://127.0.0.1:{port}" in by["emulator"]["detail"]
    assert by["xrt"]["available"] is by["pynq"]["available"] is False
    _check_unavailable_cards(by["xrt"]["detail"], by["pynq"]["detail"])
