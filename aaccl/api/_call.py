"""What a call's end means to the user who made it: its error, from the device's
return code, its dependencies and its host sync. `Call` itself is one object from
the device to the awaiting task (`aaccl.devices.Call`); a rank adopts the calls it
submits (`ACCL._submit`), and their outcome is worked out here."""

from __future__ import annotations

from .._errors import DependencyError
from ..devices._call import Call, Origin, root_cause, warn_at
from ..driver import Driver

__all__ = ["Call", "Origin", "outcome", "warn_at"]


def outcome(call: Call) -> BaseException | None:
    """The error `call` raises once its device completed it, or None; runs its host
    sync (`finish`) if it succeeded. On the completing thread, before anyone can see
    the call done: a dependent submitted meanwhile finds the error in place."""
    # (named only if it failed: a call that syncs its result formats no name to succeed)
    error: BaseException | None = Driver.error(call, call.name) if call.failed else None
    finish = call._finish
    if error is None and finish is not None:
        try:
            finish()
        except Exception as exc:  # a host sync failed: the call failed
            error = exc
    if isinstance(error, DependencyError):
        failed = [d for d in call._deps if d._error is not None]
        error = DependencyError(f"{call.name} did not run: "
                                f"{', '.join(d.name for d in failed)} failed")
        if failed:  # the root, not the chain: a cause per call would be 20,000 deep
            error.__cause__ = root_cause(failed[0]._error)
    else:
        call._deps = ()  # keep a chain's history only where it explains a failure
    return error
