"""Exceptions raised by aaccl."""

from __future__ import annotations

from ._constants import ErrorCode


class ACCLError(Exception):
    """Base of every error aaccl raises for a call that did not succeed."""


class CCLOError(ACCLError):
    """The CCLO ran the call and returned a non-zero return code."""

    def __init__(self, operation: str, code: int) -> None:
        self.operation = operation
        self.code = ErrorCode(code)
        names = ", ".join(self.code.names()) or "no error bits"
        super().__init__(f"{operation} failed on the CCLO: {names} (retcode {int(code):#x})")

    def __reduce__(self):  # keeps the two arguments across pickling (e.g. to another process)
        return type(self), (self.operation, int(self.code))


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




for _error in (ACCLError, CCLOError, DependencyError, DeviceError, DeviceStuck, KernelError):
    _error.__module__ = "aaccl"  # tracebacks name the public path
