"""How each rank's run of a test ended, and the report of a world that failed.

Pure data and text: outcomes are formatted where the rank ran (under MPI, in its own
process) and travel as plain strings, so every process can print the same report.
"""

from __future__ import annotations

import linecache
import re
import sysconfig
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import aaccl

from .._ranks import ranges as _ranks

PASSED, FAILED, ABORTED, CANCELLED, SKIPPED, LOST = (
    "passed", "failed", "aborted", "cancelled", "skipped", "lost")
_MACHINERY = tuple({str(Path(aaccl.__file__).parent)} | {
    sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


@dataclass(frozen=True)
class Outcome:
    """How one rank's run of the test body ended (picklable: MPI ranks exchange them)."""

    rank: int
    state: str  # PASSED, FAILED (its own error), ABORTED (a call ended by another
    #             rank's failure), CANCELLED (still running when the world failed), SKIPPED,
    #             LOST (its process never reported, under MPI)
    error: str = ""  # one line: "AssertionError: assert 3 == 4"
    details: str = ""  # a FAILED rank's traceback, as pytest formats it
    where: str = ""  # the line of the test it was at, for ABORTED and CANCELLED ranks
    calls: tuple[str, ...] = field(default=())  # its calls outstanding when the world failed

    @property
    def waiting(self) -> bool:
        return self.state in (ABORTED, CANCELLED)


def one_line(exc: BaseException) -> str:
    """`Type: message`, the message's first line only."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def where(tb: TracebackType | None) -> str:
    """`path:line in function` and that line's source, for the deepest frame of `tb`
    that is the user's code (not aaccl's, the standard library's or an installed
    package's): where a rank was when its wait ended."""
    frames = list(traceback.walk_tb(tb))
    mine = [(f, n) for f, n in frames if not f.f_code.co_filename.startswith(_MACHINERY)]
    if not (mine or frames):
        return ""
    frame, line = (mine or frames)[-1]
    path = frame.f_code.co_filename
    source = linecache.getline(path, line).strip()
    return f"{_short(path)}:{line} in {frame.f_code.co_name}" + (f": {source}" if source else "")


def _short(path: str) -> str:
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def _alike(outcomes: Sequence[Outcome]) -> list[list[Outcome]]:
    """The outcomes grouped where they are the same but for each rank's own number
    (`rank 5`, as in `barrier (rank 5, call 1)`): 63 ranks aborted in one barrier are
    one section of the report, not 63."""
    groups: dict[tuple[str, ...], list[Outcome]] = {}
    for o in outcomes:
        own = re.compile(rf"\brank {o.rank}\b")
        key = tuple(own.sub("rank #", text)
                    for text in (o.state, o.error, o.details, o.where, *o.calls))
        groups.setdefault(key, []).append(o)
    return list(groups.values())


def _heading(group: Sequence[Outcome], what: str, several: str) -> list[str]:
    """A section's first line; for a group, which rank's report follows."""
    ranks = [o.rank for o in group]
    if len(group) == 1:
        return [f"---- {_ranks(ranks)} {what} ----"]
    return [f"---- {_ranks(ranks)} {several} ----",
            f"(rank {ranks[0]}'s report; the others' differ only in their own rank numbers)"]


def summary(outcomes: Sequence[Outcome]) -> str:
    """One line: who failed, with what, and who was still waiting."""
    failed = [o for o in outcomes if o.state == FAILED]
    waiting = [o.rank for o in outcomes if o.waiting]
    lost = [o for o in outcomes if o.state == LOST]
    if lost and not failed:
        return f"{_ranks([o.rank for o in lost])} did not report: {lost[0].error}"
    if failed:
        first = failed[0]
        text = f"{_ranks([o.rank for o in failed])} failed: {first.error}"
        if waiting:
            text += f"; {_ranks(waiting)} {'was' if len(waiting) == 1 else 'were'} still waiting"
        return text
    aborted = [o for o in outcomes if o.state == ABORTED]
    if aborted:
        return f"{_ranks([o.rank for o in aborted])} aborted: {aborted[0].error}"
    if waiting:
        return f"{_ranks(waiting)} cancelled"
    return "passed"


def report(outcomes: Sequence[Outcome], world: str) -> str:
    """The whole story, rank by rank: each failed rank's traceback, where each waiting
    rank was and in which calls, and who passed."""
    lines = [f"{world}: {summary(outcomes)}", ""]
    for group in _alike([o for o in outcomes if o.state == FAILED]):
        lines += [*_heading(group, "failed", "failed"), group[0].details.rstrip(), ""]
    for group in _alike([o for o in outcomes if o.waiting]):
        o = group[0]
        lines += _heading(group, "was aborted", "were aborted") if o.state == ABORTED else \
            _heading(group, "was cancelled, still running", "were cancelled, still running")
        if o.where:
            lines.append(f"at {o.where}")
        if o.calls:
            lines.append("waiting in " + ", ".join(o.calls))
        elif o.state == CANCELLED:
            lines.append("with no call outstanding")
        if o.state == ABORTED:
            lines.append(o.error)
        lines.append("")
    for group in _alike([o for o in outcomes if o.state == LOST]):
        lines += [*_heading(group, "did not report", "did not report"), group[0].error, ""]
    passed = [o.rank for o in outcomes if o.state == PASSED]
    if passed:
        lines.append(f"{_ranks(passed)} passed")
    for group in _alike([o for o in outcomes if o.state == SKIPPED]):
        lines.append(f"{_ranks([o.rank for o in group])} skipped: {group[0].error}")
    return "\n".join(lines).rstrip() + "\n"


class WorldFailed(AssertionError):
    """A test run on every rank of a world failed on at least one: `outcomes` says how
    each rank ended; the message is the report pytest shows."""

    def __init__(self, outcomes: Sequence[Outcome], world: str) -> None:
        self.outcomes = list(outcomes)
        self.world = world
        super().__init__(report(self.outcomes, world))

    @property
    def summary(self) -> str:
        return summary(self.outcomes)


@dataclass
class _Crash:
    message: str


class WorldReport:
    """What pytest prints for a WorldFailed (its `longrepr`): the report, with the
    traceback lines pytest marks `E` in red, and the summary for `-r` lines."""

    def __init__(self, failure: WorldFailed) -> None:
        self.text = str(failure)
        self.reprcrash = _Crash(failure.summary)

    def toterminal(self, tw: object) -> None:
        for line in self.text.splitlines():
            red = line.startswith(("E ", "---- ")) and "passed" not in line
            tw.line(line, red=red, bold=line.startswith("---- "))  # type: ignore[attr-defined]

    def __str__(self) -> str:
        return self.text
