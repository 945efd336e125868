"""The pytest plugin (entry point `aaccl`): the `aaccl` marker and the `accl`,
`accl_world` and `world_size` fixtures.

Nothing here acts on a test that is not marked. A marked test's function is swapped,
for its call only, for a coroutine function that opens the world and runs the body
on every rank; whichever plugin runs coroutine tests runs that one (pytest-asyncio on
its loop, anyio's plugin on its backend), and where none does, this plugin runs it.
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import sys
from collections.abc import Callable, Coroutine, Generator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import pytest

import aaccl

from ..api import open_world
from ..api._world import _mpi_rank_and_size
from ..devices._call import asyncio_loop
from . import _emulator
from ._plan import MISSING, MarkerError, Plan, merged, plan
from ._ranks import run_world
from ._report import PASSED, SKIPPED, WorldFailed, WorldReport

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

MARKER = "aaccl"
WORLD = "_aaccl_world"  # the fixture that checks the marker and provides the device
DEVICES = ("soft", "emulator")  # --aaccl-device: those that need no more than a marker
_PLANS = pytest.StashKey[Plan]()
_SWAPPED = pytest.StashKey[Callable[..., Coroutine[Any, Any, None]]]()
_QUIET = pytest.StashKey["_Quiet"]()
_AACCL = str(Path(aaccl.__file__).parent) + os.sep  # aaccl's own frames


# -- configuration ------------------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aaccl", "aaccl: tests run once per rank")
    group.addoption("--aaccl-device", choices=DEVICES, default="soft",
                    help="the device of tests marked aaccl whose marker names none "
                         "(default: soft; emulator: ACCL's emulator, see AACCL_EMULATOR)")


LOOP_SCOPE = "asyncio_default_fixture_loop_scope"
"""pytest-asyncio's setting that warns (PytestDeprecationWarning) on every run
where it is left unset."""


def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    """Give pytest-asyncio's `asyncio_default_fixture_loop_scope` the default it
    announces ("function") before it reads it: aaccl's test extra installs
    pytest-asyncio, and every run of a project that never asked for it would
    otherwise open with its deprecation warning. A project's own setting (ini file,
    pyproject, -o) still wins: only the default is replaced. Here, after every
    plugin installed has declared its settings and before any is configured."""
    if "pytest_asyncio.plugin" in sys.modules:  # (not: the setting means nothing)
        parser.addini(LOOP_SCOPE, type="string", default="function",
                      help="default scope of the asyncio event loop used to execute async "
                           "fixtures (pytest-asyncio; aaccl's plugin makes it 'function')")


def _job_size() -> int | None:
    """The number of processes of this process's MPI job, if it has more than one."""
    job = _mpi_rank_and_size()
    return job[1] if job is not None and job[1] > 1 else None


@pytest.hookimpl(trylast=True)  # after the terminal reporter exists
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(world_size=None, *, timeout=10.0, device='soft', in_order=False, "
                   "backend='asyncio', **world_options): run this async test once per rank of "
                   "an aaccl world (its `accl` argument is the rank's ACCL); under mpiexec, "
                   "one rank per process")
    job = _mpi_rank_and_size()
    if job is not None and job[1] > 1 and job[0] != 0:
        quiet = _Quiet.of(config)
        if quiet is not None:
            config.stash[_QUIET] = quiet


class _Quiet:
    """Under mpiexec, ranks other than 0 report nothing once the session turns out to
    hold aaccl tests (rank 0 reports for all); until then their output is held back, and
    it is let out if there are none."""

    def __init__(self, writer: Any) -> None:
        self.writer, self.real, self.held = writer, writer._file, io.StringIO()
        writer._file = self.held

    @classmethod
    def of(cls, config: pytest.Config) -> _Quiet | None:
        try:
            writer = config.get_terminal_writer()
        except (AssertionError, AttributeError):  # no terminal reporter (-p no:terminal)
            return None
        return cls(writer) if hasattr(writer, "_file") else None

    def decide(self, silent: bool) -> None:
        if silent:
            self.writer._file = _Discard()
        else:
            self.writer._file = self.real
            self.real.write(self.held.getvalue())
            self.real.flush()


class _Discard(io.StringIO):
    def write(self, text: str) -> int:
        return len(text)


def pytest_collection_finish(session: pytest.Session) -> None:
    quiet = session.config.stash.get(_QUIET, None)
    if quiet is not None:
        quiet.decide(any(item.get_closest_marker(MARKER) for item in session.items))


# -- fixtures -----------------------------------------------------------------------------

def _plan_of(item: pytest.Item) -> Plan:
    """The item's checked plan (a usage error fails the test with the reason)."""
    if _PLANS in item.stash:
        return item.stash[_PLANS]
    markers = _markers(item)
    if not markers:
        pytest.fail("`accl`, `accl_world` and `world_size` come with the aaccl marker: mark "
                    "the test @pytest.mark.aaccl(world_size=N)", pytrace=False)
    assert isinstance(item, pytest.Function)
    test = item.obj
    if hasattr(test, "hypothesis"):
        pytest.fail("aaccl marker: a Hypothesis test cannot run once per rank; use "
                    "aaccl.open_world inside it", pytrace=False)
    callspec = getattr(item, "callspec", None)
    try:
        args, kwargs = merged([(m.args, m.kwargs) for m in markers])
        checked = plan(args, kwargs,
                       argnames=list(inspect.signature(test).parameters),
                       is_async=inspect.iscoroutinefunction(test),
                       parametrized=callspec.params.get("world_size", MISSING) if callspec
                       else MISSING,
                       job_size=_job_size(), default_device=item.config.option.aaccl_device)
    except MarkerError as error:
        mistake = str(error)  # failed outside the handler: pytest would print it twice
    else:
        item.stash[_PLANS] = checked
        return checked
    pytest.fail(mistake, pytrace=False)


def _markers(item: pytest.Item) -> list[pytest.Mark]:
    """The item's aaccl markers, the farthest first: a module's, a class's, the test's,
    then those of its parameters (`pytest.param(..., marks=pytest.mark.aaccl(...))`)."""
    params = [m for m in getattr(getattr(item, "callspec", None), "marks", ()) if m.name == MARKER]
    return [m for m in reversed(list(item.iter_markers(MARKER))) if m not in params] + params


@pytest.fixture
def _aaccl_world(request: pytest.FixtureRequest) -> Iterator[Plan]:
    """The marked test's plan; skips it where it cannot run, and starts ACCL's
    emulator for it when AACCL_EMULATOR names one."""
    checked = _plan_of(request.node)
    if checked.skip:
        pytest.skip(checked.skip)
    if checked.options["device"] != "emulator":
        yield checked
        return
    options = checked.options
    why = _emulator.skip_reason(options.get("emulator_port", _emulator.DEFAULT_PORT),
                                may_start=not checked.mpi)
    if why is not None:
        pytest.skip(why)
    if _emulator.binary() is None or checked.mpi:
        yield checked  # the one already running (under mpiexec, always: one per job)
        return
    stack = options.get("stack") or options.get("emulator_protocol") or "tcp"
    with _emulator.started(checked.world_size, stack) as port:
        yield Plan(**{**checked.__dict__, "options": {**options, "emulator_port": port}})


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The number of ranks of the test's world: the aaccl marker's `world_size`, a
    parametrized one, or under mpiexec the job's."""
    return _plan_of(request.node).world_size


class _PerRank:
    """What the `accl` and `accl_world` fixtures give until the test runs: the ranks
    exist only inside the test's body (another fixture cannot use them)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        raise RuntimeError(f"`{self._name}` exists only inside the body of a test marked "
                           "aaccl: the world opens when the test runs, after its fixtures")

    def __repr__(self) -> str:
        return f"<{self._name}: inside the test's body only>"


@pytest.fixture
def accl(_aaccl_world: Plan, world_size: int) -> Any:
    """This rank's `aaccl.ACCL`: the test's body runs once per rank."""
    return _PerRank("accl")


@pytest.fixture
def accl_world(_aaccl_world: Plan, world_size: int) -> Any:
    """The ACCLs of every rank of this process, in rank order (under mpiexec, this
    process's one): a test taking it without `accl` runs once, and drives the ranks
    itself."""
    return _PerRank("accl_world")


# -- running ------------------------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # A test marked itself that takes neither `accl` nor `accl_world` is told so; a
    # module's or a class's marker gives options to those of its tests that take one.
    if isinstance(item, pytest.Function) and WORLD not in item.fixturenames \
            and any(m.name == MARKER for m in item.own_markers):
        item.fixturenames.append(WORLD)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    checked = getattr(item, "funcargs", {}).get(WORLD)
    if not isinstance(checked, Plan):
        return (yield)
    assert isinstance(item, pytest.Function)
    test = item.obj
    item.obj = item.stash[_SWAPPED] = _world_test(item, checked, test)
    try:
        return (yield)
    finally:
        item.obj = test
        del item.stash[_SWAPPED]


def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a marked test that no other plugin ran (it is still the coroutine function
    put in place above), on its own event loop."""
    swapped = pyfuncitem.stash.get(_SWAPPED, None)
    if swapped is None or pyfuncitem.obj is not swapped:
        return None
    checked = pyfuncitem.funcargs[WORLD]
    assert isinstance(checked, Plan)
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    anyio.run(functools.partial(swapped, **args), backend=checked.backend)
    return True


def _world_test(item: pytest.Function, checked: Plan,
                test: Callable[..., Any]) -> Callable[..., Coroutine[Any, Any, None]]:
    """The coroutine function run in the test's place: its world, its ranks, its verdict."""
    async def world_test(**args: Any) -> None:
        __tracebackhide__ = True
        _check_backend(checked)
        if not checked.per_rank and not checked.mpi:  # one body, driving every rank
            async with open_world(checked.world_size, **checked.options) as accls:
                await test(**{**args, "accl_world": accls})
            return

        async def body(accl: Any, accls: list[Any]) -> None:
            mine = dict(args)
            if "accl" in mine:
                mine["accl"] = accl
            if "accl_world" in mine:
                mine["accl_world"] = accls
            await test(**mine)

        outcomes = await run_world(body, checked, functools.partial(_describe, item))
        if any(o.state not in (PASSED, SKIPPED) for o in outcomes):
            world = (f"MPI job of {checked.world_size} processes" if checked.mpi
                     else f"world of {checked.world_size} rank{'s' * (checked.world_size > 1)}")
            raise WorldFailed(outcomes, world)
        skipped = [o for o in outcomes if o.state == SKIPPED]
        if skipped:
            pytest.skip(skipped[0].error)

    functools.update_wrapper(world_test, test, updated=())
    return world_test


def _check_backend(checked: Plan) -> None:
    if not checked.backend_given:
        return
    running = _running_library()
    if running != checked.backend:
        pytest.fail(f"aaccl marker: backend={checked.backend!r}, but another plugin runs this "
                    f"test on {running} (backend= is for tests the aaccl plugin runs itself)",
                    pytrace=False)


def _running_library() -> str:
    """The event loop running this coroutine (as aaccl's bridge tells them apart)."""
    return "trio" if asyncio_loop() is None else "asyncio"


def _describe(item: pytest.Function, exc: BaseException) -> str:
    """A rank's error as pytest would show it for the test (its --tb style, assertion
    rewriting), cut to the test's own frames; the frames inside aaccl that raised an
    error of aaccl's are left out too (the error says what happened), unless
    --fulltrace."""
    tb = exc.__traceback__
    if not item.config.getoption("fulltrace", False):
        tb = _without_aaccl_tail(tb)
    if tb is None:  # never raised: there are no frames to show
        return f"{type(exc).__name__}: {exc}"
    return str(item.repr_failure(pytest.ExceptionInfo.from_exc_info((type(exc), exc, tb))))


def _without_aaccl_tail(tb: TracebackType | None) -> TracebackType | None:
    """A copy of `tb` without the innermost frames that are aaccl's own."""
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while len(entries) > 1 and entries[-1].tb_frame.f_code.co_filename.startswith(_AACCL):
        entries.pop()
    copy = None
    for entry in reversed(entries):
        copy = TracebackType(copy, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return copy


# -- reporting ----------------------------------------------------------------------------

@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if call.when == "call" and call.excinfo is not None and report.failed:
        failure = _world_failure(call.excinfo.value)
        if failure is not None:
            # pytest takes any object with toterminal, though it types longrepr as its own
            report.longrepr = WorldReport(failure)  # type: ignore[assignment]
    return report


def _world_failure(exc: BaseException) -> WorldFailed | None:
    """The WorldFailed a test raised, also when a runner wrapped it in a group of one."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, WorldFailed) else None

