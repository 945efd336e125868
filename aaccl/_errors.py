"""Exceptions raised by aaccl."""

from __future__ import annotations

from ._constants import ErrorCode


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




for _error in (ACCLError, Aborted, CCLOError, DependencyError, DeviceError, DeviceStuck, KernelError):
    _error.__module__ = "aaccl"  # tracebacks name the public path
