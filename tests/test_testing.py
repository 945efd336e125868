"""aaccl's pytest plugin (aaccl/testing), from the outside: test files written as a
user would, run by pytest's own `pytester` in this process (in mpiexec jobs for MPI).

Each case checks what pytest reports: outcomes, each rank's part of a failure report,
and how long a failing test took (the report must come within a second, never after a
timeout some rank was still waiting out).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from aaccl._constants import Scenario
from aaccl.testing import Outcome, WorldFailed
from aaccl.testing._emulator import _free_ports
from aaccl.testing._plan import MarkerError, merged
from aaccl.testing._report import LOST, PASSED
from test_mpi_fabric import MPIEXEC, run_job

try:  # imported before any pytester run: a run drops the modules it imported, and
    import zmq  # zmq's compiled core would keep raising the old classes
except ImportError:
    zmq = None

pytest_plugins = ["pytester"]
needs_zmq = pytest.mark.skipif(zmq is None, reason="the emulator device needs pyzmq")

# plugins the files here do not use: hypothesis's imports all of hypothesis in each run
# (pytester drops the modules a run imported)
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")
FAST = 2.0  # seconds a failing test may take, its world's opening included (~0.1 s idle)
INI = """
[pytest]
asyncio_default_fixture_loop_scope = function
"""
HEADER = """
import anyio, numpy as np, pytest, sniffio
import aaccl
from aaccl import ReduceFunction
SUM = ReduceFunction.SUM
"""


@pytest.fixture
def tests(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI)
    return pytester


def write(pytester: pytest.Pytester, body: str, name: str = "test_user") -> Path:
    return pytester.makepyfile(**{name: HEADER + textwrap.dedent(body)})


def call_reports(rec: pytest.HookRecorder) -> dict[str, pytest.TestReport]:
    """The call phase's report of every test that got that far, by test name."""
    return {r.nodeid.split("::")[-1]: r for r in rec.getreports("pytest_runtest_logreport")
            if r.when == "call"}


def text(report: pytest.TestReport) -> str:
    return str(report.longrepr)


# -- passing ------------------------------------------------------------------------------

SUM_TEST = """
@pytest.mark.aaccl(world_size=4{options})
async def test_sum(accl):
    buf = accl.allocate(8)
    buf[:] = accl.rank
    await accl.allreduce(buf, buf, 8, SUM)
    assert (buf == 0 + 1 + 2 + 3).all()
    assert sniffio.current_async_library() == {library!r}
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_marked_test_runs_once_per_rank_on_its_own_loop(tests: pytest.Pytester,
                                                          backend: str) -> None:
    """With no other plugin running it, the plugin runs the test itself: asyncio by
    default, trio when the marker asks."""
    options = "" if backend == "asyncio" else ", backend='trio'"
    write(tests, SUM_TEST.format(options=options, library=backend) + """
ranks = []

@pytest.mark.aaccl(world_size=3)
async def test_each_rank_once(accl, world_size):
    ranks.append(accl.rank)
    assert accl.size == world_size == 3

def test_every_rank_ran():
    assert sorted(ranks) == [0, 1, 2]
""")
    tests.runpytest(*QUIET).assert_outcomes(passed=3)


def test_on_pytest_asyncios_loop_and_anyios_backends(tests: pytest.Pytester) -> None:
    """A test another plugin runs runs on that plugin's loop: the one its async
    fixtures ran on (pytest-asyncio), the backend of `anyio_backend` (anyio)."""
    write(tests, """
import asyncio, pytest_asyncio

@pytest_asyncio.fixture
async def fixtures_loop():
    return asyncio.get_running_loop()

@pytest.mark.asyncio
@pytest.mark.aaccl(world_size=2)
async def test_pytest_asyncio(accl, fixtures_loop):
    assert asyncio.get_running_loop() is fixtures_loop
    await accl.barrier()

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.aaccl(world_size=2)
async def test_anyio(accl, anyio_backend):
    assert sniffio.current_async_library() == anyio_backend
    await accl.barrier()
""")
    tests.runpytest(*QUIET).assert_outcomes(passed=3)


def test_world_size_is_parametrized_like_any_argument(tests: pytest.Pytester) -> None:
    write(tests, """
@pytest.mark.parametrize("world_size", [1, 2, 5])
@pytest.mark.aaccl
async def test_sizes(accl, world_size):
    buf = accl.allocate(4)
    buf[:] = 1
    await accl.allreduce(buf, buf, 4, SUM)
    assert accl.size == world_size and (buf == world_size).all()

@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.aaccl
async def test_sizes_without_naming_it(accl):
    assert accl.size in (2, 3)
""")
    result = tests.runpytest(*QUIET, "-v")
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*test_sizes[[]5[]] PASSED*",
                                 "*test_sizes_without_naming_it[[]3[]] PASSED*"])


def test_markers_of_the_module_the_test_and_a_parameter_combine(tests: pytest.Pytester) -> None:
    """A module's marker gives options to the tests that take `accl`; the test's own
    and its parameters' markers add theirs, the closest winning."""
    write(tests, """
pytestmark = pytest.mark.aaccl(world_size=3, timeout=0.5, nbufs=8)

def test_taking_no_accl_is_left_alone():
    pass

@pytest.mark.parametrize("rx", [
    pytest.param("default"),
    pytest.param("small", marks=pytest.mark.aaccl(bufsize=64, nbufs=4)),
])
@pytest.mark.aaccl(2)
async def test_options(accl, rx):
    driver = accl._driver
    assert accl.size == 2 and driver.timeout == 0.5
    assert (driver.bufsize, driver.nbufs) == ((64, 4) if rx == "small" else (1024, 8))

async def test_module_options_alone(accl):
    assert accl.size == 3 and accl._driver.timeout == 0.5
""")
    tests.runpytest(*QUIET).assert_outcomes(passed=4)


def test_accl_world_alone_runs_the_body_once_with_every_rank(tests: pytest.Pytester) -> None:
    write(tests, """
runs = []

@pytest.mark.aaccl(world_size=3)
async def test_drive(accl_world):
    runs.append(len(accl_world))
    a, b, c = accl_world
    x, y = a.allocate(4), c.allocate(4)
    x[:] = 7
    await a.send(x, 4, 2), await c.recv(y, 4, 0)
    assert (y == 7).all()

@pytest.mark.aaccl(world_size=2)
async def test_both(accl, accl_world):
    assert accl_world[accl.rank] is accl and len(accl_world) == 2

def test_once():
    assert runs == [3]
""")
    tests.runpytest(*QUIET).assert_outcomes(passed=3)


def test_a_skip_on_every_rank_skips_the_test(tests: pytest.Pytester) -> None:
    write(tests, """
@pytest.mark.aaccl(world_size=2)
async def test_skipping(accl):
    pytest.skip("not today")
""")
    result = tests.runpytest(*QUIET, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*not today*"])


# -- failing ------------------------------------------------------------------------------

def test_a_failing_rank_is_reported_by_rank_at_once(tests: pytest.Pytester) -> None:
    """Rank 1's assertion fails while rank 0 waits in an allreduce and rank 2 has not
    called it yet (timeout=30): within a second, the report shows rank 1's traceback
    (with pytest's assertion message), rank 0 aborted in its allreduce and rank 2
    cancelled, each at its line of the test."""
    write(tests, """
@pytest.mark.aaccl(world_size=3, timeout=30)
async def test_one_rank_fails(accl):
    buf = accl.allocate(8)
    if accl.rank == 2:
        await anyio.sleep(0.05)
    if accl.rank == 1:
        assert buf[0] == 42
    await accl.allreduce(buf, buf, 8, SUM)
""")
    rec = tests.inline_run(*QUIET)
    report = call_reports(rec)["test_one_rank_fails"]
    assert report.failed and report.duration < FAST
    out = text(report)
    assert out.startswith("world of 3 ranks: rank 1 failed: AssertionError: assert ")
    assert "ranks 0, 2 were still waiting" in out.splitlines()[0]
    failed = out.split("---- rank 1 failed ----")[1].split("---- rank 0")[0]
    assert ">           assert buf[0] == 42" in failed
    assert "accl = <ACCL rank 1 of 3>" in failed
    assert re.search(r"test_user.py:\d+: AssertionError", failed)
    aborted = out.split("---- rank 0 was aborted ----")[1].split("----")[0]
    assert re.search(r"at test_user.py:\d+ in test_one_rank_fails: "
                     r"await accl.allreduce\(buf, buf, 8, SUM\)", aborted)
    assert "waiting in allreduce (rank 0, call 1)" in aborted
    assert "allreduce (rank 0, call 1) was aborted: rank 1 failed: AssertionError" in aborted
    cancelled = out.split("---- rank 2 was cancelled, still running ----")[1]
    assert re.search(r"at test_user.py:\d+ in test_one_rank_fails: await anyio.sleep\(0.05\)",
                     cancelled)


def test_the_summary_line_names_the_failing_rank(tests: pytest.Pytester) -> None:
    write(tests, """
@pytest.mark.aaccl(world_size=2)
async def test_boom(accl):
    if accl.rank == 1:
        raise KeyError("boom")
    await accl.barrier()
""")
    result = tests.runpytest(*QUIET, "-rf")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["FAILED test_user.py::test_boom - rank 1 failed: KeyError: 'boom'*"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_ranks_failing_differently_are_each_reported(tests: pytest.Pytester) -> None:
    write(tests, """
@pytest.mark.aaccl(world_size=3)
async def test_all_fail(accl):
    raise ValueError(f"got {10 * accl.rank}")
""")
    out = text(call_reports(tests.inline_run(*QUIET))["test_all_fail"])
    for rank in range(3):
        assert f"---- rank {rank} failed ----" in out and f"got {10 * rank}" in out
    assert out.splitlines()[0] == "world of 3 ranks: ranks 0-2 failed: ValueError: got 0"


def test_ranks_alike_but_for_their_number_are_reported_once(tests: pytest.Pytester) -> None:
    """64 ranks: one fails, the others wait in one barrier. The report has one section
    per kind of ending, not one per rank, and names the ranks as ranges."""
    write(tests, """
@pytest.mark.aaccl(world_size=64)
async def test_many(accl):
    if accl.rank == 37:
        raise ValueError(f"rank {accl.rank} is unhappy")
    await accl.barrier()

@pytest.mark.aaccl(world_size=8)
async def test_all_alike(accl):
    assert accl.size == 9, f"rank {accl.rank} is unhappy"
""")
    reports = call_reports(tests.inline_run(*QUIET))
    out = text(reports["test_many"])
    assert out.splitlines()[0].startswith("world of 64 ranks: rank 37 failed: ValueError: "
                                          "rank 37 is unhappy; ranks ")
    assert out.count("---- ") <= 3 and len(out.splitlines()) < 60
    assert "rank 37 is unhappy" in out.split("---- rank 37 failed ----")[1]
    waiting = re.findall(r"---- ranks ([\d, -]+) were (?:aborted|cancelled, still running) ----",
                         out)
    named = [n for part in ", ".join(waiting).split(", ") for n in
             (range(int(part.split("-")[0]), int(part.split("-")[1]) + 1) if "-" in part
              else [int(part)])]
    assert sorted(named) == [r for r in range(64) if r != 37]
    assert "differ only in their own rank numbers" in out
    alike = text(reports["test_all_alike"])
    assert alike.splitlines()[0].startswith("world of 8 ranks: ranks 0-7 failed: AssertionError: "
                                            "rank 0 is unhappy")
    assert "---- ranks 0-7 failed ----\n(rank 0's report;" in alike
    assert alike.count("---- ") == 1


def test_a_rank_hanging_outside_aaccl_fails_the_test_at_the_timeout_naming_it(
        tests: pytest.Pytester) -> None:
    """Rank 2 hangs in code of its own: the others' barrier waits for it for the
    marker's timeout (0.5 s), fails naming it, and rank 2 is cancelled where it hung."""
    write(tests, """
@pytest.mark.aaccl(world_size=3, timeout=0.5)
async def test_hang(accl):
    if accl.rank == 2:
        await anyio.sleep_forever()
    await accl.barrier()
""")
    report = call_reports(tests.inline_run(*QUIET))["test_hang"]
    assert report.failed and report.duration < 0.5 + FAST
    out = text(report)
    # rank 1 waits for rank 2 too: its own timeout or rank 0's failure ends its wait
    assert re.search(r"(rank 2 was|ranks [\d, ]*\b2 were) still waiting", out.splitlines()[0])
    assert "waited 0.5 s for rank 2; rank 2 has no call outstanding" in out
    hung = out.split("---- rank 2 was cancelled, still running ----")[1]
    assert re.search(r"at test_user.py:\d+ in test_hang: await anyio.sleep_forever\(\)", hung)
    assert "with no call outstanding" in hung


def test_a_rank_left_waiting_by_a_peer_that_finished_fails_at_once(tests: pytest.Pytester) -> None:
    """Rank 1 waits (timeout=30) for a message rank 0 never sends before it returns: the
    receive fails as soon as rank 0 is done, naming the call and why."""
    write(tests, """
@pytest.mark.aaccl(world_size=2, timeout=30)
async def test_left_waiting(accl):
    if accl.rank == 1:
        await accl.recv(accl.allocate(4), 4, 0, tag=5)
""")
    report = call_reports(tests.inline_run(*QUIET))["test_left_waiting"]
    assert report.failed and report.duration < FAST
    out = text(report)
    assert out.splitlines()[0] == ("world of 2 ranks: rank 1 aborted: Aborted: recv (rank 1, "
                                   "call 1) was aborted: rank 0 left the world: its test passed")
    assert re.search(r"at test_user.py:\d+ in test_left_waiting: await accl.recv\(", out)
    assert "rank 0 passed" in out


def test_calls_a_cancelled_rank_left_unawaited_do_not_hold_the_world_open(
        tests: pytest.Pytester) -> None:
    """Rank 1 makes a receive (timeout=30) after rank 0 already failed, and is cancelled
    at another await: the receive is aborted with the world, not waited for."""
    write(tests, """
@pytest.mark.aaccl(world_size=2, timeout=30)
async def test_dropped(accl):
    if accl.rank == 0:
        raise KeyError("boom")
    call = accl.recv(accl.allocate(4), 4, 0)
    await anyio.sleep(60)
    await call
""")
    report = call_reports(tests.inline_run(*QUIET))["test_dropped"]
    assert report.failed and report.duration < FAST
    assert text(report).splitlines()[0] == ("world of 2 ranks: rank 0 failed: KeyError: 'boom'; "
                                            "rank 1 was still waiting")
    assert re.search(r"at test_user.py:\d+ in test_dropped: await anyio.sleep\(60\)", text(report))


def test_in_order_makes_a_program_that_needs_overlap_time_out(tests: pytest.Pytester) -> None:
    """Both ranks receive before they send: fine on the soft CCLO, a deadlock on the
    firmware, which in_order=True reproduces (as a timeout, here 0.3 s)."""
    write(tests, """
async def swap(accl):
    mine, theirs = accl.allocate(4), accl.allocate(4)
    mine[:] = accl.rank
    other = 1 - accl.rank
    incoming = accl.recv(theirs, 4, other, tag=1)
    await accl.send(mine, 4, other, tag=1)
    await incoming
    assert (theirs == other).all()

@pytest.mark.aaccl(world_size=2, timeout=0.3)
async def test_overlapping(accl):
    await swap(accl)

@pytest.mark.aaccl(world_size=2, timeout=0.3, in_order=True)
async def test_in_order(accl):
    await swap(accl)
""")
    reports = call_reports(tests.inline_run(*QUIET))
    assert reports["test_overlapping"].passed
    assert reports["test_in_order"].failed
    assert "RECEIVE_TIMEOUT_ERROR" in text(reports["test_in_order"])
    assert "waited 0.3 s" in text(reports["test_in_order"])


# -- mistakes -----------------------------------------------------------------------------

MISTAKES = [  # (decorator, test, what the error says)
    ("@pytest.mark.aaccl(world_size=2)", "def test_{}(accl): pass",
     "must be an `async def` function"),
    ("@pytest.mark.aaccl(world_size=2)", "async def test_{}(): pass", "takes neither `accl`"),
    ("@pytest.mark.aaccl(world_size=2, timout=3)", "async def test_{}(accl): pass",
     "unknown option timout; options: world_size, backend, device"),
    ("@pytest.mark.aaccl", "async def test_{}(accl): pass", "give world_size"),
    ("@pytest.mark.aaccl(world_size=0)", "async def test_{}(accl): pass",
     "world_size must be a positive integer, got 0"),
    ("@pytest.mark.aaccl(2, world_size=2)", "async def test_{}(accl): pass",
     "world_size given twice"),
    ("@pytest.mark.aaccl(world_size=2, timeout=-1)", "async def test_{}(accl): pass",
     "timeout must be a positive number"),
    ("@pytest.mark.aaccl(world_size=2, in_order=1)", "async def test_{}(accl): pass",
     "in_order must be True or False, got 1"),
    ("@pytest.mark.aaccl(world_size=2, backend='curio')", "async def test_{}(accl): pass",
     "backend must be one of asyncio, trio"),
    ("@pytest.mark.aaccl(world_size=2, timeout=True)", "async def test_{}(accl): pass",
     "timeout must be a positive number of seconds below 4000, got True"),
    ("@pytest.mark.aaccl(world_size=2, device='gpu')", "async def test_{}(accl): pass",
     "unknown device 'gpu': available here: soft, emulator, xrt, pynq"),
    ("@pytest.mark.aaccl(world_size=2, nbufs='x')", "async def test_{}(accl): pass",
     "nbufs must be a positive integer, got 'x'"),
    ("@pytest.mark.aaccl(world_size=100000)", "async def test_{}(accl): pass",
     "a world of 100000 ranks does not fit"),
    ("@pytest.mark.parametrize('world_size', [3])\n@pytest.mark.aaccl(world_size=2)",
     "async def test_{}(accl): pass", "parametrized with world_size=3"),
    ("", "async def test_{}(accl): pass", "come with the aaccl marker"),
    ("", "def test_{}(world_size): pass", "come with the aaccl marker"),
]


def test_mistakes_are_explained_before_any_world_opens(tests: pytest.Pytester) -> None:
    write(tests, "".join(f"\n{decorator}\n{test.format(i)}\n"
                         for i, (decorator, test, _) in enumerate(MISTAKES)))
    rec = tests.inline_run(*QUIET)
    setups = {r.nodeid.split("::")[-1].split("[")[0]: r
              for r in rec.getreports("pytest_runtest_logreport") if r.when == "setup"}
    for i, (decorator, test, error) in enumerate(MISTAKES):
        report = setups[f"test_{i}"]
        assert report.failed, (decorator, test)
        assert error in text(report) and "Traceback" not in text(report), text(report)
    assert not call_reports(rec), "a test ran"


def test_a_backend_another_plugin_overrules_is_an_error(tests: pytest.Pytester) -> None:
    write(tests, """
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.aaccl(world_size=2, backend="trio")
async def test_x(accl):
    pass
""")
    result = tests.runpytest(*QUIET)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*backend='trio', but another plugin runs this test on asyncio*"])


def test_unmarked_tests_are_left_alone(tests: pytest.Pytester) -> None:
    write(tests, """
def test_sync():
    pass

@pytest.mark.anyio
async def test_plain_async():
    pass
""")
    tests.runpytest(*QUIET).assert_outcomes(passed=3)  # anyio: 2 backends


# -- the emulator -------------------------------------------------------------------------

EMULATOR_TEST = """
@pytest.mark.aaccl(world_size=2, device="emulator", nbufs=4, timeout=5{port})
async def test_copy(accl):
    assert type(accl._driver.device).__name__ == "EmulatorDevice"
    src, dst = accl.allocate(64), accl.allocate(64)
    src[:] = np.arange(64) + 100 * accl.rank
    await accl.copy(src, dst, 64)
    assert (dst == src).all()
"""


@needs_zmq
def test_the_emulator_is_skipped_with_the_reason_when_none_is_configured(
        tests: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AACCL_EMULATOR", raising=False)
    with port_nobody_listens_on() as port:
        write(tests, EMULATOR_TEST.format(port=f", emulator_port={port}"))
        result = tests.runpytest(*QUIET, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*no emulator answers at tcp://127.0.0.1:{port}*AACCL_EMULATOR*"])


@needs_zmq
def test_an_emulator_already_answering_is_used(tests: pytest.Pytester,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from test_emulator_protocol import FakeEmulator

    monkeypatch.delenv("AACCL_EMULATOR", raising=False)
    start = _free_ports(2)
    ranks = [FakeEmulator(port=start + r) for r in range(2)]  # rank r at start + r
    try:
        write(tests, EMULATOR_TEST.format(port=f", emulator_port={ranks[0].port}"))
        tests.runpytest(*QUIET).assert_outcomes(passed=1)
    finally:
        for rank in ranks:
            rank.close()
    assert all(any(c.scenario == Scenario.COPY for c in rank.started()) for rank in ranks)


@needs_zmq
def test_aaccl_emulator_starts_one_per_test(tests: pytest.Pytester, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """AACCL_EMULATOR names the binary: each test starts its world's ranks (here the
    stand-in of tests/fakes/cclo_emu.py), runs on them, and stops them."""
    binary = tmp_path / "cclo_emu"
    fake = Path(__file__).resolve().parent / "fakes" / "cclo_emu.py"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} --tag {tmp_path} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("AACCL_EMULATOR", str(binary))
    write(tests, EMULATOR_TEST.format(port="") + """
@pytest.mark.aaccl(world_size=1)
async def test_soft_still(accl):
    assert type(accl._driver.device).__name__ == "SoftDevice"
""")
    result = tests.runpytest(*QUIET)
    result.assert_outcomes(passed=2)
    assert not _running(f"--tag {tmp_path} "), "the emulator's ranks outlived the test"
    assert {(tmp_path / f"stack.{r}").read_text() for r in range(2)} == {"tcp"}


@needs_zmq
@pytest.mark.parametrize("stack,flag", [("udp", "udp"), ("rdma", "cyt_rdma")])
def test_the_emulator_runs_the_world_s_stack(tests: pytest.Pytester, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, stack: str,
                                             flag: str) -> None:
    binary = tmp_path / "cclo_emu"
    fake = Path(__file__).resolve().parent / "fakes" / "cclo_emu.py"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} --tag {tmp_path} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("AACCL_EMULATOR", str(binary))
    write(tests, EMULATOR_TEST.format(port=f", stack={stack!r}"))
    tests.runpytest(*QUIET).assert_outcomes(passed=1)
    assert {(tmp_path / f"stack.{r}").read_text() for r in range(2)} == {flag}


@needs_zmq
def test_aaccl_device_option_runs_unmarked_devices_on_the_emulator(
        tests: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AACCL_EMULATOR", raising=False)
    with port_nobody_listens_on() as port:
        write(tests, f"""
@pytest.mark.aaccl(world_size=1, emulator_port={port})
async def test_x(accl):
    pass
""")
        result = tests.runpytest(*QUIET, "--aaccl-device=emulator", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*device='emulator'*"])


@contextlib.contextmanager
def port_nobody_listens_on() -> Iterator[int]:
    """A port held bound but not listening, so nothing answers there meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _running(needle: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmdline:
            found.append(cmdline)
    return found


# -- the pure parts --------------------------------------------------------------------

def test_markers_merge_the_closest_winning() -> None:
    module, test, param = ((), {"timeout": 2, "world_size": 3}), ((4,), {}), ((), {"nbufs": 4})
    assert merged([module, test, param]) == ((4,), {"timeout": 2, "nbufs": 4})
    assert merged([test, ((), {"world_size": 5})]) == ((), {"world_size": 5})
    with pytest.raises(MarkerError, match="given twice"):
        merged([((2,), {"world_size": 2})])


def test_a_process_that_never_reported_is_named() -> None:
    """Under MPI, a process that does not report in time (dead, or still running)."""
    failure = WorldFailed([Outcome(0, PASSED), Outcome(1, LOST, error="not every rank "
                                                       "finished within 10.0 s of rank 0")],
                          "MPI job of 2 processes")
    assert failure.summary == ("rank 1 did not report: not every rank finished within 10.0 s "
                               "of rank 0")
    assert str(failure).splitlines()[0] == f"MPI job of 2 processes: {failure.summary}"
    assert "---- rank 1 did not report ----" in str(failure) and "rank 0 passed" in str(failure)


# -- MPI: one rank per process ------------------------------------------------------------

MPI_TESTS = """
@pytest.mark.aaccl(world_size=2)
async def test_sum(accl):
    buf = accl.allocate(8)
    buf[:] = accl.rank + 1
    await accl.allreduce(buf, buf, 8, SUM)
    assert (buf == 3).all() and accl.size == 2

@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.aaccl
async def test_sizes(accl, world_size):
    assert accl.size == world_size

@pytest.mark.aaccl
async def test_job_size(accl, world_size):
    assert world_size == accl.size == 2
"""

MPI_FAILING = """
@pytest.mark.aaccl(timeout=30)
async def test_one_rank_fails(accl):
    buf = accl.allocate(8)
    if accl.rank == 1:
        assert buf[0] == 42
    await accl.allreduce(buf, buf, 8, SUM)

@pytest.mark.aaccl(timeout=30)
async def test_one_rank_hangs(accl):
    if accl.rank == 0:
        await anyio.sleep_forever()
    raise KeyError("rank 1 gives up")
"""

needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")


OUTCOMES = """
import os

def pytest_runtest_logreport(report):  # each process's outcomes, in a file of its own
    if report.when == "call" or report.skipped:
        with open(os.path.join(os.path.dirname(__file__), "outcomes." + os.environ["PMI_RANK"]),
                  "a") as f:
            f.write(f"{report.nodeid.split('::')[-1]} {report.outcome}\\n")
"""


def outcomes_of_each_process(tests: pytest.Pytester, nprocs: int) -> list[str]:
    return [(tests.path / f"outcomes.{rank}").read_text() for rank in range(nprocs)]


@needs_mpiexec
def test_under_mpiexec_each_process_runs_one_rank_and_rank_0_reports(
        tests: pytest.Pytester) -> None:
    """`mpiexec -n 2 python -m pytest`: the same tests, one rank per process; sizes
    the job cannot hold are skipped; a failure on rank 1 fails the test on both
    processes, at once (timeout=30), and only rank 0's report is printed; a rank hung
    outside aaccl is ended as soon as its peer failed."""
    path = write(tests, MPI_TESTS + MPI_FAILING)
    tests.makeconftest(OUTCOMES)
    assert MPIEXEC is not None
    job = run_job([MPIEXEC, "-n", "2", sys.executable, "-m", "pytest", *QUIET, "-rA",
                   "--durations=0", "--durations-min=0", str(path)], limit=120)
    out = job.stdout
    assert job.returncode != 0, job.explain()
    assert out.count("test session starts") == 1, job.explain()  # rank 0 alone reports
    assert re.search(r"2 failed, 3 passed, 2 skipped in [\d.]+s", out), job.explain()
    first, second = outcomes_of_each_process(tests, 2)
    assert first == second and first.count("failed") == 2, (first, second)
    assert re.search(r"PASSED \S*test_user.py::test_sizes\[2\]", out), out
    assert "world_size=3: this MPI job has 2 processes" in out
    assert ("MPI job of 2 processes: rank 1 failed: AssertionError: assert " in out
            and "rank 0 was still waiting" in out), job.explain()
    assert ">           assert buf[0] == 42" in out and "accl = <ACCL rank 1 of 2>" in out
    assert "rank 1 left the world: rank 1 failed: AssertionError" in out, job.explain()
    assert "MPI job of 2 processes: rank 1 failed: KeyError: 'rank 1 gives up'" in out
    hung = out.split("---- rank 0 was cancelled, still running ----")[1]
    assert "in test_one_rank_hangs: await anyio.sleep_forever()" in hung
    took = {name: float(s) for s, name in re.findall(r"([\d.]+)s call +\S+::(\w+)", out)}
    assert took["test_one_rank_fails"] < FAST and took["test_one_rank_hangs"] < FAST, out


MPI_LATE = """
@pytest.mark.aaccl(world_size=2, timeout=1)
async def test_one_rank_finishes_late(accl):
    buf = accl.allocate(8)
    buf[:] = 1
    await accl.allreduce(buf, buf, 8, SUM)
    assert (buf == 2).all()
    if accl.rank == 1:
        time.sleep(5)  # its own code, 5 timeouts longer than rank 0's

@pytest.mark.aaccl(world_size=2, timeout=1)
async def test_then_a_rank_fails_at_once(accl):
    buf = accl.allocate(8)
    if accl.rank == 1:
        raise KeyError("rank 1 gives up")
    await accl.allreduce(buf, buf, 8, SUM)
"""


@needs_mpiexec
def test_under_mpiexec_a_rank_that_finishes_late_passes(tests: pytest.Pytester) -> None:
    """The timeout (1 s) bounds calls, not a rank's own code: rank 0 waits for rank 1,
    whose body takes 5 s more, and the test passes on both; a rank that raises still
    fails its peer's waiting call at once."""
    path = write(tests, "import time\n" + MPI_LATE)
    tests.makeconftest(OUTCOMES)
    assert MPIEXEC is not None
    job = run_job([MPIEXEC, "-n", "2", sys.executable, "-m", "pytest", *QUIET, "-rA",
                   "--durations=0", "--durations-min=0", str(path)], limit=120)
    out = job.stdout
    assert re.search(r"1 failed, 1 passed in [\d.]+s", out), job.explain()
    first, second = outcomes_of_each_process(tests, 2)
    assert first == second == ("test_one_rank_finishes_late passed\n"
                               "test_then_a_rank_fails_at_once failed\n"), (first, second)
    took = {name: float(s) for s, name in re.findall(r"([\d.]+)s call +\S+::(\w+)", out)}
    assert took["test_one_rank_finishes_late"] >= 5, out
    assert took["test_then_a_rank_fails_at_once"] < FAST, out
    assert "rank 1 left the world: rank 1 failed: KeyError" in out, job.explain()


@needs_mpiexec
def test_aaccl_launch_runs_pytest_one_rank_per_process(tests: pytest.Pytester) -> None:
    path = write(tests, MPI_TESTS)
    tests.makeconftest(OUTCOMES)
    job = run_job([sys.executable, "-m", "aaccl", "launch", "-n", "2", "-m", "pytest", *QUIET,
                   str(path)], limit=120)
    assert job.returncode == 0, job.explain()
    assert job.stdout.count("test session starts") == 1, job.explain()
    assert re.search(r"3 passed, 2 skipped(, \d+ warnings?)? in", job.stdout), job.explain()
    first, second = outcomes_of_each_process(tests, 2)
    assert first == second and first.count("passed") == 3, (first, second)
