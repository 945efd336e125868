"""`aaccl`'s small commands: `launch` (the mpiexec command line it builds, how it
reads its program, real launches), `--version`, `info`, and `trace plot`'s help."""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import aaccl
import aaccl.cli
from aaccl.cli import command, main
from aaccl.cli._launch import SHIM, job_status
from aaccl.cli._statuses import (
    PEERS_VARIABLE,
    VARIABLE,
    Board,
    Launcher,
    launcher_addresses,
    parse,
)
from aaccl.cli._rank import WholeLines

RANK = [sys.executable, "-c", SHIM, "--whole-lines"]  # each rank: its supervisor, whole lines
HAVE_MPI = (importlib.util.find_spec("mpi4py") is not None
            and (shutil.which("mpiexec") is not None
                 or (Path(sys.executable).parent / "mpiexec").exists()))
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="no MPI: pip install 'aaccl[mpi]'")


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


def test_prepend_rank_passes_the_launchers_own_option() -> None:
    """hydra's -prepend-rank, Open MPI's --tag-output; the ranks write whole lines
    always (the launchers pass output on, and prefix it, chunk by chunk)."""
    assert command("mpiexec", 2, ["app.py"], None, hydra=True, prepend_rank=True) == \
        ["mpiexec", "-n", "2", "-disable-auto-cleanup", "-prepend-rank", *RANK,
         "app.py"]
    assert command("mpirun", 2, ["-m", "app"], None, hydra=False, prepend_rank=True) == \
        ["mpirun", "-n", "2", "--tag-output", *RANK, "-m", "app"]


@pytest.mark.parametrize(("argv", "program"), [
    (["-n", "2", "-m", "aaccl", "bench", "-n", "3", "-b", "8"],
     ["-m", "aaccl", "bench", "-n", "3", "-b", "8"]),  # what follows -m is the module's
    (["-n", "2", "-m", "pkg.app", "--", "x"], ["-m", "pkg.app", "--", "x"]),
    (["-n", "2", "-c", "print(1)", "-m", "x"], ["-c", "print(1)", "-m", "x"]),
    (["-n", "2", "app.py", "-n", "3", "-m", "x"], ["app.py", "-n", "3", "-m", "x"]),
    (["-n", "2", "--", "-m", "pkg.app", "-l"], ["-m", "pkg.app", "-l"]),
    (["-l", "-n", "2", "app.py"], ["app.py"]),
    (["-n", "2", "--grace", "1.5", "app.py", "--grace", "2"], ["app.py", "--grace", "2"]),
])
def test_launch_reads_its_program_as_python_does(argv: list[str], program: list[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[tuple] = []
    monkeypatch.setattr(aaccl.cli, "launch", lambda *args: launched.append(args) or 0)
    assert main(["launch", *argv]) == 0
    ((nprocs, got, hostfile, mpiexec, prepend, grace),) = launched
    assert (nprocs, got, hostfile, mpiexec, prepend) == (2, program, None, None, "-l" in argv[:1])
    assert grace == (1.5 if "--grace" in argv else 5.0)


@pytest.mark.parametrize(("argv", "says"), [
    (["-n", "2", "-m"], "-m needs a module"), (["-n", "2", "-c"], "-c needs code"),
    (["-n", "2"], "name the program"), (["-m", "aaccl", "-n", "2"], "-n"),
    (["-n", "2", "-m", "x", "-c", "y"], None),  # -c is the module's argument here
])
def test_launch_without_a_program_is_a_usage_error(argv: list[str], says: str | None,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(aaccl.cli, "launch", lambda *args: 0)
    if says is None:
        assert main(["launch", *argv]) == 0
        return
    with pytest.raises(SystemExit) as exc:
        main(["launch", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_job_status_prefers_the_ranks_own_statuses() -> None:
    assert job_status(255, [0, 7], 2) == 7  # hydra's own error hides the rank's status
    assert job_status(255, [0, 0, 0], 3) == 0  # hydra failed tearing a good job down
    assert job_status(0, [0, 0, 0], 3) == 0
    # a rank that did not report (its supervisor killed, the launcher unreachable
    # from its machine): the launcher's status stands beside the reported ones
    assert job_status(9, [1, 1], 3) == 9
    assert job_status(0, [], 2) == 0
    assert job_status(1, [0], 2) == 1
    assert job_status(0, [137], 2) == 137


def test_a_rank_finds_the_launcher_where_hydras_proxy_did() -> None:
    proxy = ["hydra_pmi_proxy", "--control-port", "10.9.0.1:40000", "--rmk", "user"]
    assert list(launcher_addresses(proxy, "head")) == ["10.9.0.1", "head", "localhost"]
    ipv6 = ["hydra_pmi_proxy", "--control-port", "[fd00::1]:40000"]
    assert next(launcher_addresses(ipv6, "head")) == "fd00::1"
    assert list(launcher_addresses(["mpirun"], "head")) == ["head", "localhost"]
    assert list(launcher_addresses(["x", "--control-port"], "head")) == ["head", "localhost"]


@pytest.mark.parametrize(("line", "parsed"), [
    (b"tok hello 3", ("hello", 3, 0)), (b"tok status 0 137", ("status", 0, 137)),
    (b"tok status 2 300", ("status", 2, 300 & 0xFF)),
    (b"other hello 3", None), (b"tok hello -1", None), (b"tok status 1", None),
    (b"tok hello 1 2", None), (b"tok bye 1 2", None), (b"", None),
    (b"tok ended 4 137", ("ended", 4, 137)),
    (b"GET / HTTP/1.1\r", None), (b"\xff\xfe hello 2", None),
])
def test_only_a_message_with_the_launchers_token_counts(line: bytes, parsed: object) -> None:
    assert parse("tok", line) == parsed


def _connect(board: Board, rank: int, monkeypatch: pytest.MonkeyPatch) -> Launcher:
    for name, value in board.env.items():
        monkeypatch.setenv(name, value)
    launcher = Launcher.connect(rank, os.getpid())
    assert launcher is not None
    return launcher


def test_a_program_reads_who_ended_from_its_supervisors_pipe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor writes `RANK STATUS` lines (in pieces, maybe); the program
    takes the abnormal ends, in words."""
    from aaccl.api import _world

    assert _world.PEERS_VARIABLE == PEERS_VARIABLE  # the supervisor's name, spelled twice
    read, write = os.pipe()
    os.set_blocking(read, False)
    monkeypatch.setenv(PEERS_VARIABLE, str(read))
    monkeypatch.setattr(_world, "_news", b"")
    try:
        assert _world.ended_ranks() == {}
        os.write(write, b"3 137\n1 0\n2 1\n5 1")
        assert _world.ended_ranks() == {3: "its process was killed by SIGKILL",
                                        2: "its program exited with status 1"}
        os.write(write, b"43\n")  # the rest of the last line
        assert _world.ended_ranks() == {5: "its process was killed by SIGTERM"}
    finally:
        os.close(read)
        os.close(write)
    with open(os.devnull, "rb") as other:  # the variable inherited, not the pipe
        monkeypatch.setenv(PEERS_VARIABLE, str(other.fileno()))
        assert _world.ended_ranks() == {}
    monkeypatch.setenv(PEERS_VARIABLE, "nonsense")
    assert _world.ended_ranks() == {}
    monkeypatch.delenv(PEERS_VARIABLE)
    assert _world.ended_ranks() == {}  # not under aaccl launch


def test_the_lost_process_handler_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR1 comes once per process that ends, so a second may come while the first
    handler runs: a handler that imports could find a module half made (ImportError
    instead of the peer's name). It only calls what listening bound beforehand."""
    import builtins
    import signal

    from aaccl.api import _world

    told: list[tuple[str, dict[int, str]]] = []
    monkeypatch.setattr(_world, "_lost", lambda why, ended: told.append((why, ended)))
    monkeypatch.delenv(PEERS_VARIABLE, raising=False)

    def no_import(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the signal handler imported {args[0]}")

    monkeypatch.setattr(builtins, "__import__", no_import)
    _world._process_lost(signal.SIGUSR1, None)
    monkeypatch.undo()
    assert told == [("a process of this MPI job ended (hydra's SIGUSR1)", {})]


def test_the_lost_process_handler_names_the_ranks_the_launcher_told_of(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `aaccl launch` the supervisor writes which rank ended, and how, before
    its SIGUSR1: the reason the handler gives (the one the world's collectives fail
    with from then on) names that rank, not just "a process ended" (1 kill in 25 of
    4 ranks gave survivors' errors that did not name the dead rank)."""
    import signal

    from aaccl.api import _world

    told: list[tuple[str, dict[int, str]]] = []
    monkeypatch.setattr(_world, "_lost", lambda why, ended: told.append((why, ended)))
    read, write = os.pipe()
    try:
        os.set_blocking(read, False)
        monkeypatch.setenv(PEERS_VARIABLE, str(read))
        monkeypatch.setattr(_world, "_news", b"")
        os.write(write, f"3 {128 + signal.SIGKILL}\n".encode())
        _world._process_lost(signal.SIGUSR1, None)
    finally:
        os.close(read)
        os.close(write)
    assert told == [("rank 3 left the world: its process was killed by SIGKILL",
                     {3: "its process was killed by SIGKILL"})]


def _reported(board: Board, count: int) -> list[int]:
    """The statuses once `count` are in (the board's thread takes them as they come)."""
    deadline = time.monotonic() + 10
    while len(got := board.statuses(grace=0.05)) < count and time.monotonic() < deadline:
        pass
    return sorted(got)


def test_the_board_holds_every_rank_until_all_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor that reported waits (its machine's proxy lives on) until every
    rank has reported, or dropped its connection; strangers count for nothing."""
    with Board(4) as board:
        port = int(board.env[VARIABLE].split(":")[0])
        with socket.create_connection(("localhost", port)) as stranger:
            stranger.sendall(b"0 hello 0\n0 status 0 0\n")
        with socket.create_connection(("localhost", port)):
            pass  # connects and says nothing
        heard: list[tuple[int, int]] = []
        all_heard = threading.Event()

        def hear(*news: int) -> None:
            heard.append(news)
            if len(heard) == 2:
                all_heard.set()

        ranks = [_connect(board, rank, monkeypatch) for rank in range(3)]
        ranks.append(Launcher.connect(3, os.getpid(), hear))
        assert ranks[3] is not None
        finished: list[int] = []
        threads = [threading.Thread(target=lambda r=r, l=l: (l.finish(r * 7), finished.append(r)))
                   for r, l in enumerate(ranks[:3])]
        for t in threads:
            t.start()
        assert _reported(board, 3) == [0, 7, 14]
        assert finished == []  # held: rank 3 still runs
        assert all_heard.wait(10)
        assert sorted(heard) == [(1, 7), (2, 14)]  # who ended abnormally, and how
        ranks[3]._conn.shutdown(socket.SHUT_RDWR)  # rank 3's supervisor died unreported
        for t in threads:
            t.join(timeout=10)
        assert sorted(finished) == [0, 1, 2]
        assert sorted(board.statuses()) == [0, 7, 14]
    monkeypatch.delenv(VARIABLE)
    assert Launcher.connect(0, os.getpid()) is None  # not under aaccl launch


def test_the_board_ends_the_ranks_still_running_a_grace_after_a_failure(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's program failed: rank 0, which never learns of it (stuck in MPI_Init,
    say), is told to stop `grace` seconds later, and the job's status is rank 1's."""
    with Board(2, grace=0.3) as board:
        stopped = threading.Event()
        for name, value in board.env.items():
            monkeypatch.setenv(name, value)
        rank0 = Launcher.connect(0, os.getpid(), on_stop=stopped.set)
        rank1 = Launcher.connect(1, os.getpid())
        assert rank0 is not None and rank1 is not None
        failed = time.monotonic()
        threading.Thread(target=rank1.finish, args=(3,), daemon=True).start()
        assert stopped.wait(10), "rank 0 was never told to stop"
        assert time.monotonic() - failed >= 0.3  # not before the grace
        stopping = threading.Thread(target=rank0.finish, args=(128 + 15,))
        stopping.start()
        assert _reported(board, 2) == [1, 3]  # rank 0's SIGTERM counts as a failure: 1
        assert board.ended == {0}
        stopping.join(timeout=10)
    assert ("rank 1's program exited with status 3; rank 0 still runs 0.3 s later: "
            "ending it (SIGTERM") in capsys.readouterr().err


def test_the_board_ends_nobody_when_every_rank_succeeds_or_is_done(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that exits 0 starts no grace; a failure after every other rank is done
    ends nobody."""
    with Board(2, grace=0.0) as board:
        stopped = threading.Event()
        for name, value in board.env.items():
            monkeypatch.setenv(name, value)
        rank0 = Launcher.connect(0, os.getpid(), on_stop=stopped.set)
        rank1 = Launcher.connect(1, os.getpid(), on_stop=stopped.set)
        assert rank0 is not None and rank1 is not None
        first = threading.Thread(target=rank0.finish, args=(0,))
        first.start()
        assert _reported(board, 1) == [0]
        second = threading.Thread(target=rank1.finish, args=(2,))
        second.start()
        assert _reported(board, 2) == [0, 2]
        first.join(timeout=10)
        second.join(timeout=10)
        assert not stopped.is_set() and board.ended == set()


def test_a_board_that_closes_lets_its_ranks_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpiexec ended (or the launcher was interrupted) before every rank reported."""
    with Board(2) as board:
        launcher = _connect(board, 0, monkeypatch)
        waiting = threading.Thread(target=launcher.finish, args=(3,))
        waiting.start()
        assert _reported(board, 1) == [3]
    waiting.join(timeout=10)
    assert not waiting.is_alive()


def test_bad_arguments_exit_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["launch", "-n", "0", "app.py"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["launch", "-n", "2"])
    assert "program" in capsys.readouterr().err


@needs_mpi
def test_launch_forwards_the_jobs_exit_code(tmp_path: Path) -> None:
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


@needs_mpi
def test_launch_a_rank_whose_supervisor_is_killed_ends_with_its_program(
        tmp_path: Path) -> None:
    """Killing a rank's supervisor (by mistake, say) takes its program along instead
    of leaving it stuck in MPI_Finalize with the job waiting for it; the others
    report as usual."""
    script = tmp_path / "app.py"
    script.write_text("import os, signal, sys\nfrom mpi4py import MPI\n"
                      "MPI.COMM_WORLD.Barrier()\n"
                      "if MPI.COMM_WORLD.rank == 1: os.kill(os.getppid(), signal.SIGKILL)\n"
                      "sys.exit(3 if MPI.COMM_WORLD.rank == 2 else 0)\n")
    done = subprocess.run([sys.executable, "-m", "aaccl", "launch", "-n", "3", str(script)],
                          timeout=120, capture_output=True, text=True)
    assert done.returncode != 0, done.stderr
    left = subprocess.run(["pgrep", "-f", str(script)], capture_output=True, text=True)
    assert left.stdout == "", f"left running: {left.stdout}"


# `aaccl` as its console script runs: without the working directory on sys.path
AACCL = [sys.executable, "-c",
         "import sys; del sys.path[0]; from aaccl.cli import main; sys.exit(main())"]


def _launch(*args: str, cwd: Path, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AACCL, "launch", *args], check=False, cwd=cwd,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


@needs_mpi
def test_ranks_import_the_installed_aaccl_and_see_their_own_directory(tmp_path: Path) -> None:
    """Started from a directory holding a folder named `aaccl` (a checkout, say),
    every rank still runs the installed aaccl; the program gets the sys.path entry
    `python` gives it: the script's directory, the working directory for -m, "" for
    -c."""
    shadow = tmp_path / "aaccl"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the folder, not the package')\n")
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("NAME = 'helper beside the script'\n")
    report = ("import sys, aaccl\nfrom mpi4py import MPI\n"  # one write: a whole line
              "sys.stdout.write(f'{MPI.COMM_WORLD.rank} {sys.path[0]!r} {aaccl.__file__} "
              "{sys.argv[1:]}\\n')\n")
    (app / "script.py").write_text("import helper\n" + report)
    (tmp_path / "module_here.py").write_text(report)
    installed = aaccl.__file__

    def lines(done: subprocess.CompletedProcess[str]) -> list[str]:
        assert done.returncode == 0, done.stdout + done.stderr
        return sorted(done.stdout.splitlines())

    assert lines(_launch("-n", "2", "app/script.py", "-x", cwd=tmp_path)) == \
        [f"{r} {str(app)!r} {installed} ['-x']" for r in (0, 1)]
    assert lines(_launch("-n", "2", "-m", "module_here", "-n", "5", cwd=tmp_path)) == \
        [f"{r} {str(tmp_path)!r} {installed} ['-n', '5']" for r in (0, 1)]
    assert lines(_launch("-n", "2", "-c", report, "y", cwd=tmp_path)) == \
        [f"{r} '' {installed} ['y']" for r in (0, 1)]
    assert lines(_launch("-n", "2", "-m", "aaccl", "--version", cwd=tmp_path)) == \
        [f"aaccl {aaccl.__version__}"] * 2


def test_whole_lines_wait_for_their_newline_or_a_flush() -> None:
    readable, writable = os.pipe()
    os.set_blocking(readable, False)

    def handed_over() -> bytes:
        try:
            return os.read(readable, 1 << 16)
        except BlockingIOError:
            return b""

    try:
        out = WholeLines(writable)
        assert out.write(b"par") == 3 and handed_over() == b""
        assert out.write(memoryview(b"t\none\ntw")) == 8 and handed_over() == b"part\none\n"
        out.flush()
        assert handed_over() == b"tw"
        text = io.TextIOWrapper(WholeLines(writable), "utf-8", write_through=True)
        print("é", end="", file=text)
        assert handed_over() == b""
        print(file=text)
        assert handed_over() == "é\n".encode()
    finally:
        os.close(readable)
        os.close(writable)


@needs_mpi
def test_prepend_rank_starts_every_line_with_its_rank(tmp_path: Path) -> None:
    """Each rank's lines, in order, whole and prefixed, on stdout and stderr, even
    when Python writes a line's text and its newline apart (PYTHONUNBUFFERED)."""
    (tmp_path / "talk.py").write_text(
        "import sys\nfrom mpi4py import MPI\nr = MPI.COMM_WORLD.rank\n"
        "for i in range(300):\n    print(f'rank {r} line {i}', 'x' * 50)\n"
        "print(f'two\\nlines {r}')\n"
        "sys.stdout.write('in '); sys.stdout.write(f'pieces {r}\\n')\n"
        "print(f'rank {r} complains', file=sys.stderr)\n"
        "raise SystemExit(f'rank {r} ends')\n")
    done = _launch("-n", "2", "-l", "talk.py", cwd=tmp_path, env={"PYTHONUNBUFFERED": "1"})
    assert done.returncode == 1, done.stderr
    for r in (0, 1):
        mine = [line[len(f"[{r}] "):] for line in done.stdout.splitlines()
                if line.startswith(f"[{r}] ")]
        assert mine == [f"rank {r} line {i} " + "x" * 50 for i in range(300)] + \
            ["two", f"lines {r}", f"in pieces {r}"], mine[-5:]
    assert all(re.fullmatch(r"\[[01]\] .*", line) for line in done.stdout.splitlines())
    errors = done.stderr.splitlines()
    for r in (0, 1):
        assert f"[{r}] rank {r} complains" in errors and f"[{r}] rank {r} ends" in errors


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"aaccl {aaccl.__version__}\n"


def test_trace_plot_names_its_default_output(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["trace", "plot", "--help"])
    assert "(default: timeline.png)" in " ".join(capsys.readouterr().out.split())


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


def test_a_lost_process_reason_that_names_ranks_replaces_one_that_did_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """hydra's SIGUSR1 may come before the supervisor's word of who ended: the reason
    it gave ("a process ended") gives way to the one naming the rank, which the
    world's collectives fail with from then on (1 kill in 20 at 4 ranks on trio left
    survivors' errors that did not name the dead rank)."""
    from aaccl.soft.fabric import _mpi

    monkeypatch.setattr(_mpi, "_ended", [])
    monkeypatch.setattr(_mpi, "_dead", {})
    monkeypatch.setattr(_mpi, "_open", set())
    _mpi.MPIFabric.process_lost("a process of this MPI job ended (hydra's SIGUSR1)")
    assert _mpi.MPIFabric.ended() == "a process of this MPI job ended (hydra's SIGUSR1)"
    named = "rank 3 left the world: its process was killed by SIGKILL"
    _mpi.MPIFabric.process_lost(named, {3: "its process was killed by SIGKILL"})
    assert _mpi.MPIFabric.ended() == named
    _mpi.MPIFabric.process_lost("rank 2 left the world: its program exited with status 1",
                                {2: "its program exited with status 1"})
    assert _mpi.MPIFabric.ended() == named  # the first that names ranks stays
    assert _mpi.MPIFabric.dead() == {3: "its process was killed by SIGKILL",
                                     2: "its program exited with status 1"}
