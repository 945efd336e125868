"""The narrow interface between the driver and a CCLO, whatever implements it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from ._call import Call, CallArgs, Poller, joined


DeviceCall = Call
"""A call as devices make and complete it: the same object the user awaits."""


def in_sequence(device: Device, whole: CallArgs, steps: Sequence[CallArgs],
                waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
    """`steps` as one device call with `whole`'s arguments: each waits for the one
    before (the first for `waitfor`), and the call fails as the first that failed.
    `Device.start_steps` of devices where calls match by sequence, not by their
    order on the device (the soft CCLO)."""
    calls: list[DeviceCall] = []
    for step in steps:
        calls.append(device.start(step, [calls[-1]] if calls else waitfor))
    return joined(whole, calls)


class Device(ABC):
    """What the driver and `ACCL` need from a CCLO: exchange memory, device memory,
    calls. Every device inherits it.

    The abstract methods are what every device does. The rest are capabilities only
    some devices have, declared here with what a device without them does (nothing,
    or a TypeError that says why not), so callers call them without asking first.

    `start` submits a call that runs once every call in `waitfor` succeeded; if one
    failed, the new call completes with `aborted=True` and never runs.
    """

    timer_hz: int  # units of the SET_TIMEOUT config value per second

    runs_accl_firmware: bool = False
    """The device runs ACCL's firmware: the driver gives it equivalent calls for those
    the firmware gets wrong (through `start_steps`)."""

    enforces_call_timeout: bool = False
    """The device fails a call after the timeout itself, on the host (ACCL's firmware
    never acts on SET_TIMEOUT): it takes the timeout in seconds (`set_call_timeout`),
    so it holds timeouts the 32-bit register cannot."""

    poller: Poller | None = None
    """Progress a task waiting for one of the device's calls can make itself (the MPI
    fabric), or None: its calls complete on the device's own threads."""

    gone: Mapping[int, str] = MappingProxyType({})
    """The peers (sessions) that left the device's world, and why (the soft CCLO
    learns it from their notices; other devices never do)."""

    missing: Callable[[], str | None] | None = None
    """Where the device's world can tell that a peer will never come (the MPI fabric:
    its process ended), `missing()` says why, or None while all may still come. Set
    by the world that joins the device to its fabric; None: waits for every rank are
    bounded by the timeout instead."""

    # -- what every device does ---------------------------------------------------------

    @abstractmethod
    def mmio_read(self, offset: int) -> int: ...

    @abstractmethod
    def mmio_write(self, offset: int, value: int) -> None: ...

    @abstractmethod
    def alloc(self, nbytes: int) -> int: ...

    @abstractmethod
    def free(self, address: int) -> None: ...

    @abstractmethod
    def write(self, address: int, data: np.ndarray) -> None: ...

    @abstractmethod
    def read(self, address: int, out: np.ndarray) -> None: ...

    @abstractmethod
    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall: ...

    @abstractmethod
    def run(self, job: Callable[[], None], waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Run host work (a kernel modelled in Python, a DMA transfer) on the device's
        worker threads once `waitfor` succeeded, as a call of the same graph."""

    @abstractmethod
    def close(self) -> None: ...

    # -- capabilities, and what a device without them does ------------------------------

    def set_call_timeout(self, seconds: float) -> None:
        """Fail a call that runs longer than `seconds` (`enforces_call_timeout`); by
        default nothing: the device goes by SET_TIMEOUT's register."""

    def start_steps(self, whole: CallArgs, steps: Sequence[CallArgs],
                    waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """One call, with `whole`'s arguments, that runs `steps` back to back with no
        other call between them where the device can order them so (its own queue);
        by default each step waits for the one before (`in_sequence`)."""
        return in_sequence(self, whole, steps, waitfor)

    def array(self, address: int, dtype: np.dtype, count: int) -> np.ndarray | None:
        """`count` elements of device memory at `address` as an array, without a copy,
        where device memory is in this process (the soft CCLO); else None: `read` and
        `write` copy it."""
        return None

    def abort(self, reason: str) -> None:
        """End every outstanding call at once with `Aborted(reason)` (any thread);
        by default nothing: a card's calls end in their own time."""

    def abort_calls(self, handles: Sequence[DeviceCall], reason: str) -> None:
        """End these outstanding calls with `Aborted(reason)` (any thread); by default
        nothing."""

    def leave(self, reason: str, peers: Sequence[int]) -> None:
        """Tell `peers` (sessions) that this rank leaves the world, and why, so their
        calls that need it fail at once; by default nothing: they time out."""

    def skip_collective(self, comm: int, reason: str) -> None:
        """The host rejected a collective on communicator `comm` (its exchange-memory
        address): let the peers' calls of it fail with `reason`; by default nothing."""

    def attach_stream(self, kernel: Callable[[np.ndarray, int], Any] | None,
                      name: str) -> None:
        """Route what the CCLO writes to its kernel stream through `kernel(chunk,
        tag)` (None: the loopback); only the soft CCLO can."""
        raise TypeError("attach_stream needs the soft CCLO (device='soft'): on a card the "
                        "CCLO's kernel streams are wired to kernels when the bitstream is "
                        "linked, and ACCL's emulator loops them back (cclo_emu -b)")

    def is_card_kernel(self, target: object) -> bool:
        """Whether `target` is a kernel of the card (run by `start_kernel`), not a
        Python callable; by default no device has any."""
        return False

    def overlay_kernel(self, name: str) -> Any:
        """The card's kernel called `name` (under device="pynq", its overlay's)."""
        raise TypeError(f"kernel {name!r}: kernels by name are an overlay's, under "
                        "device='pynq'; on this device a kernel is a Python callable")

    def start_kernel(self, kernel: Any, args: Sequence[Any],
                     waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        """Start a run of a kernel of the card (`is_card_kernel`) after `waitfor`."""
        raise TypeError(f"{type(self).__name__} runs no kernels of a card")
