"""Exceptions raised by aaccl."""

from __future__ import annotations

from collections.abc import Mapping

from ._constants import ErrorCode
from ._ranks import ranges, without_ranks


class ACCLError(Exception):
    """Base of every error aaccl raises for a call that did not succeed."""


class CCLOError(ACCLError):
    """The CCLO ran the call and returned a non-zero return code (`code`, ACCL's
    bits). `detail` says what happened where the device knows it (the soft CCLO
    does): which peer it waited for and how long, what the peer called instead."""

    def __init__(self, operation: str, code: int, detail: str | None = None) -> None:
        self.operation = operation
        self.code = ErrorCode(code)
        self.detail = detail
        names = ", ".join(self.code.names()) or "no error bits"
        message = f"{operation} failed on the CCLO: {names} (retcode {int(code):#x})"
        super().__init__(message if detail is None else f"{message}: {detail}")

    def __reduce__(self) -> tuple[type[CCLOError], tuple[str, int, str | None]]:
        """Keeps the arguments across pickling (e.g. to another process)."""
        return type(self), (self.operation, int(self.code), self.detail)


class Aborted(ACCLError):
    """The call was aborted before it could finish: its world was cancelled or
    closed, or a rank's program raised. The message names the cause."""


class DependencyError(ACCLError):
    """The call never ran because a call it waited for did not succeed: one in its
    `waitfor`, or an earlier unfinished call on the same device memory."""


class DeviceError(ACCLError):
    """The device (ACCL's emulator, an Alveo card) did not answer, refused a request, or
    cannot run this call at all."""


class KernelError(ACCLError):
    """A kernel modelled in Python raised; the kernel's exception is the `__cause__`."""


class DeviceStuck(DeviceError):
    """The device still runs a call that timed out (ACCL's firmware cannot abandon a
    call), so it cannot take another until that call ends or the device is reset."""


class RankErrors(ACCLError):
    """Ranks of one world failed with different errors (raised by `aaccl.run`).

    `errors` maps each rank that failed to its own error, in rank order; `groups`
    puts together the ranks whose errors are the same (`same_error`). The message
    lists the groups with their ranks as ranges, one line each, and stays short
    however many ranks failed. The lowest rank's error is the `__cause__`, so a
    traceback shows where one of them was raised.
    """

    SHOWN = 8  # groups listed in the message; the rest are counted

    def __init__(self, errors: Mapping[int, BaseException]) -> None:
        self.errors: dict[int, BaseException] = dict(sorted(errors.items()))
        super().__init__(self._describe())
        if self.errors:
            self.__cause__ = next(iter(self.errors.values()))

    @property
    def groups(self) -> list[tuple[list[int], BaseException]]:
        """(ranks, the lowest of those ranks' error) for each kind of error, in the
        order of the lowest rank of each."""
        kinds: dict[str, list[int]] = {}
        for rank, error in self.errors.items():
            kinds.setdefault(same_error(error), []).append(rank)
        return [(ranks, self.errors[ranks[0]]) for ranks in kinds.values()]

    def _describe(self) -> str:
        groups = self.groups
        lines = [f"{len(self.errors)} ranks failed with {len(groups)} different errors:"]
        for ranks, error in groups[:self.SHOWN]:
            lines.append(f"  {ranges(ranks)}: {_one_line(error)}")
        rest = [r for ranks, _ in groups[self.SHOWN:] for r in ranks]
        if rest:
            lines.append(f"  and {len(groups) - self.SHOWN} more different errors, "
                         f"on {ranges(rest)}")
        return "\n".join(lines)

    def __reduce__(self) -> tuple[type[RankErrors], tuple[dict[int, BaseException]]]:
        return type(self), (self.errors,)


class RemoteError(ACCLError):
    """Another process's rank failed with an error that could not travel here as
    itself (it does not pickle): its type and message, and what it is the same as."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__(text)
        self.kind = kind

    def __reduce__(self) -> tuple[type[RemoteError], tuple[str, str]]:
        return type(self), (str(self), self.kind)


def same_error(error: BaseException) -> str:
    """What two ranks' errors must share to be the same error: their type and their
    message once the rank numbers it names are taken out (a rank names itself, and
    the peers it waited for); for a CCLOError, its error bits, since where each rank
    stood when a collective failed (its own timeout, or a peer's notice of it first)
    depends on timing; for an Aborted, its first cause (it may come through a peer's
    call aborted first: "rank 0's allreduce(...) was aborted: rank 1 left the world")."""
    if isinstance(error, RemoteError):
        return error.kind
    kind = f"{type(error).__module__}.{type(error).__qualname__}"
    if isinstance(error, CCLOError):
        return f"{kind} {int(error.code):#x}"
    text = str(error)
    if isinstance(error, Aborted):
        text = text.rsplit(" was aborted: ", 1)[-1]
    return f"{kind}: {without_ranks(text)}"


def _one_line(error: BaseException, limit: int = 240) -> str:
    """`Type: message`, the message's first line, cut at `limit` characters."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > limit:
        first = first[:limit - 3] + "..."
    name = type(error).__name__
    return f"{name}: {first}" if first else name


for _error in (ACCLError, Aborted, CCLOError, DependencyError, DeviceError, DeviceStuck, KernelError,
               RankErrors):
    _error.__module__ = "aaccl"  # tracebacks name the public path
