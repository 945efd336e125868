"""A call's life on the soft CCLO, in one place.

    submitted --(dependencies done; in_order: its turn)--> running --> done
                                                            |   ^
                                              yields a Wait |   | the Wait is set
                                                            v   |  (or its deadline
                                                           waiting  passes: failed)

`admit` runs when the call is submitted, in submission order, and fixes its place
in the message order (a send's sequence number, a receive's place among posted
receives, a collective's sequence number). Once the call may run, its body — a
generator — runs until it must wait for a message, for a peer to finish reading
our data, or for a data job, and yields that `Wait`; the engine resumes it when
the Wait is set. Every step happens in engine context, never by recursion. Any
exception fails this call alone.

`_state` holds the state machine (`SoftCall`), `_p2p` the point-to-point calls,
`_collective` what a collective's call shares with its peers (fingerprint,
notices), `_schedule` the executor of the schedules; how a fabric takes part in
a collective is the fabric's (`port.collective`, `fabric.Collective`).
"""

from __future__ import annotations

from ..._constants import ErrorCode, Scenario
from ...devices import CallArgs
from ._p2p import RecvCall, SendCall
from ._schedule import ScheduleCall
from ._state import COLLECTIVES, OFFLOAD_BYTES, CallFailed, Comm, ConfigCall, SoftCall

__all__ = ["KINDS", "OFFLOAD_BYTES", "CallFailed", "Comm", "SoftCall", "make_call"]


KINDS: dict[int, type[SoftCall]] = {
    **{int(s): ScheduleCall for s in (*COLLECTIVES, Scenario.COPY, Scenario.COMBINE)},
    int(Scenario.SEND): SendCall, int(Scenario.RECV): RecvCall,
    int(Scenario.CONFIG): ConfigCall, int(Scenario.NOP): SoftCall}
"""The kind of call each scenario makes (`make_call` for the others, which fail)."""


def make_call(args: CallArgs) -> SoftCall:
    """A call of a scenario `KINDS` lacks (it fails), or of any, the long way; its
    device sets its fields (see `SoftCall`)."""
    scenario = args.scenario
    if scenario == Scenario.SEND:
        return SendCall(args)
    if scenario == Scenario.RECV:
        return RecvCall(args)
    if scenario in COLLECTIVES or scenario in (Scenario.COPY, Scenario.COMBINE):
        return ScheduleCall(args)
    call: SoftCall = ConfigCall(args) if scenario == Scenario.CONFIG else SoftCall(args)
    if scenario not in (Scenario.CONFIG, Scenario.NOP):
        call.failure = int(ErrorCode.COLLECTIVE_NOT_IMPLEMENTED)
    return call
