"""`Device` declares every capability the layers above use, with what a device
without it does; every device inherits it, so nothing above asks a device what it
can do (getattr/hasattr), it just calls."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

import aaccl
from aaccl._constants import TAG_ANY, Scenario
from aaccl.devices import CallArgs, Device, DeviceCall
from aaccl.devices._emulator import EmulatorDevice
from aaccl.devices._pynq import PynqDevice
from aaccl.devices._xrt import XRTDevice
from aaccl.soft import SoftDevice

DEVICES = [SoftDevice, EmulatorDevice, XRTDevice, PynqDevice]
ABOVE_THE_DEVICES = ["api", "driver", "testing", "compat", "cli"]


@pytest.mark.parametrize("cls", DEVICES, ids=lambda cls: cls.__name__)
def test_every_device_is_a_complete_device(cls: type[Device]) -> None:
    assert issubclass(cls, Device)
    assert not inspect.isabstract(cls), sorted(getattr(cls, "__abstractmethods__", ()))


def test_nothing_above_the_devices_probes_a_device() -> None:
    """No getattr/hasattr whose object is a device (`device`, `self.device`, ...)."""
    root = Path(aaccl.__file__).parent
    found = []
    for package in ABOVE_THE_DEVICES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and node.func.id in ("getattr", "hasattr") and node.args \
                        and "device" in ast.unparse(node.args[0]).lower():
                    found.append(f"{path.relative_to(root)}:{node.lineno}: "
                                 f"{ast.unparse(node)}")
    assert found == []


class Plain(Device):
    """A device with nothing but the contract: each call succeeds at once."""

    timer_hz = 1_000_000

    def __init__(self) -> None:
        self.started: list[tuple[CallArgs, tuple[DeviceCall, ...]]] = []

    def mmio_read(self, offset: int) -> int:
        return 0

    def mmio_write(self, offset: int, value: int) -> None:
        pass

    def alloc(self, nbytes: int) -> int:
        return 0

    def free(self, address: int) -> None:
        pass

    def write(self, address: int, data: np.ndarray) -> None:
        pass

    def read(self, address: int, out: np.ndarray) -> None:
        pass

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        self.started.append((args, tuple(waitfor)))
        call = DeviceCall(args)
        call.complete()
        return call

    def run(self, job: Callable[[], None], waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        job()
        call = DeviceCall(None)
        call.complete()
        return call

    def close(self) -> None:
        pass


def args(scenario: Scenario, count: int = 0) -> CallArgs:
    return CallArgs(int(scenario), count, 0, 0, 0, TAG_ANY, 0, 0, 0, 0, 0, 0)


def test_a_device_without_a_capability_does_nothing_or_says_why_not() -> None:
    device = Plain()
    assert not device.runs_accl_firmware and not device.enforces_call_timeout
    assert device.poller is None and device.missing is None and dict(device.gone) == {}
    assert device.array(0, np.dtype(np.float32), 4) is None
    handle = DeviceCall(args(Scenario.NOP))
    device.set_call_timeout(30.0)
    device.abort("why")
    device.abort_calls([handle], "why")
    device.leave("why", range(2))
    device.skip_collective(0, "why")
    assert not device.is_card_kernel(print)
    with pytest.raises(TypeError, match="attach_stream needs the soft CCLO"):
        device.attach_stream(None, "loopback")
    with pytest.raises(TypeError, match="kernels by name are an overlay's"):
        device.overlay_kernel("vadd_1")
    with pytest.raises(TypeError, match="runs no kernels of a card"):
        device.start_kernel(object(), [])


def test_start_steps_by_default_runs_each_step_after_the_one_before() -> None:
    device, before = Plain(), DeviceCall(args(Scenario.NOP))
    before.complete()
    steps = [args(Scenario.REDUCE, 1), args(Scenario.BCAST, 2)]
    whole = device.start_steps(args(Scenario.ALLREDUCE, 3), steps, [before])
    assert whole.done() and not whole.failed and whole.args == args(Scenario.ALLREDUCE, 3)
    (first, first_waits), (second, second_waits) = device.started
    assert (first, second) == tuple(steps) and first_waits == (before,)
    assert len(second_waits) == 1 and second_waits[0].args == first
