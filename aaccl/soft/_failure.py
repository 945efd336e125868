"""How a call of the soft CCLO fails: raised by the calls, and by the fabrics that
run their part of a collective (`fabric.Collective`), which the calls' package
imports (so this lives below both)."""

from __future__ import annotations

from .._constants import ErrorCode
from .._errors import ACCLError


class CallFailed(Exception):
    """A call fails with ACCL's retcode `code`; `detail` says why, in words. With
    `error`, the call ends with that exception instead (a stream kernel's)."""

    def __init__(self, code: ErrorCode | int, detail: str | None = None,
                 error: ACCLError | None = None) -> None:
        super().__init__(code)
        self.code = int(code)
        self.detail = detail
        self.error = error
