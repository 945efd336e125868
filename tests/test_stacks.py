"""The network stack, a world option (`stack="tcp" | "udp" | "rdma"`): the eager
threshold it sets on every device, the calls ACCL's firmware cannot run over TCP and
UDP, and the option's checks. (Eager and rendezvous sends themselves: test_p2p.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import aaccl
from aaccl import DeviceError
from aaccl._constants import Scenario
from aaccl.api._world import _ranks
from aaccl.devices._pynq import PynqDevice
from aaccl.driver import EAGER_ONLY, Driver, eager_threshold
from fakes.fake_pynq import Fake

F32 = np.dtype(np.float32)


def test_the_eager_threshold_of_each_stack() -> None:
    assert eager_threshold("tcp", 1024) == eager_threshold("udp", 64) == EAGER_ONLY == 1 << 30
    assert eager_threshold("rdma", 1024) == 1024  # ACCL's: one rx buffer
    with pytest.raises(ValueError, match="stack must be one of 'tcp', 'udp', 'rdma'"):
        eager_threshold("roce", 1024)


@pytest.mark.parametrize("options, message", [
    ({"stack": "TCP"}, "unknown stack 'TCP': choose from tcp, udp, rdma"),
    ({"stack": "axis3x"}, "unknown stack"),
    ({"stack": "udp", "emulator_protocol": "tcp"}, "disagree"),
    ({"emulator_protocol": "roce"}, "unknown stack 'roce'"),
    ({"device": "xrt", "xclbin": "a.xclbin", "stack": "rdma"}, "RDMA is Coyote's"),
    ({"device": "pynq", "xclbin": "a.xclbin", "stack": "rdma"}, "RDMA is Coyote's"),
])
def test_a_stack_that_is_not_there_is_refused_before_any_device(options: dict[str, Any],
                                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        aaccl.run(lambda accl: accl.nop(), 2, **options)


def test_emulator_protocol_is_an_older_name_for_the_stack() -> None:
    async def main(accl: aaccl.ACCL) -> int:
        return accl._driver.max_eager_size

    assert aaccl.run(main, 2, emulator_protocol="rdma", bufsize=512) == [512, 512]
    assert aaccl.run(main, 2, emulator_protocol="udp", stack="udp") == [EAGER_ONLY] * 2
    assert aaccl.run(main, 2) == [EAGER_ONLY] * 2  # tcp


@pytest.mark.parametrize("stack", ["tcp", "udp", "rdma"])
def test_the_soft_cclo_runs_barrier_and_alltoall_on_every_stack(stack: str) -> None:
    async def main(accl: aaccl.ACCL) -> np.ndarray:
        src, dst = accl.allocate(4), accl.allocate(4)
        src[:] = np.arange(4) + 10 * accl.rank
        await accl.barrier()
        await accl.alltoall(src, dst, 2)
        return np.array(dst)

    a, b = aaccl.run(main, 2, stack=stack)
    np.testing.assert_array_equal(a, [0, 1, 10, 11])
    np.testing.assert_array_equal(b, [2, 3, 12, 13])


# -- on a card (the PYNQ fake): the firmware's rendezvous-only calls -------------------------

@pytest.fixture
def card(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Fake, Callable[..., Driver]]]:
    fake = Fake().install(monkeypatch)
    devices: list[PynqDevice] = []

    def driver(**options: Any) -> Driver:
        devices.append(PynqDevice("/opt/accl/ccl_offload.xclbin"))
        made = Driver(devices[-1], 0, _ranks(2, 1024), nbufs=4, bufsize=1024, **options)
        made.configure()
        return made

    yield fake, driver
    for device in devices:
        device.close()
    fake.shutdown()


@pytest.mark.parametrize("stack", ["tcp", "udp"])
def test_over_tcp_and_udp_barrier_and_alltoall_fail_at_once_and_reach_no_card(
        card: tuple[Fake, Callable[..., Driver]], stack: str) -> None:
    """The firmware runs them only through rendezvous, which these stacks never carry:
    on a card they would spin until the host's timeout, then leave it stuck."""
    fake, driver = card
    on_card = driver(stack=stack)
    assert on_card.max_eager_size == EAGER_ONLY
    for scenario in (Scenario.BARRIER, Scenario.ALLTOALL):
        call = on_card.start(scenario, count=2, dtype=F32)
        assert call.done()
        error = Driver.error(call, scenario.name.lower())
        assert isinstance(error, DeviceError)
        assert f"cannot run {scenario.name.lower()} over a {stack} stack" in str(error)
    assert not fake.runs(Scenario.BARRIER) and not fake.runs(Scenario.ALLTOALL)
    assert on_card.start(Scenario.NOP).block(5)  # the card is none the worse


def test_over_rdma_they_reach_the_card(card: tuple[Fake, Callable[..., Driver]]) -> None:
    fake, driver = card
    on_card = driver(stack="rdma")
    assert on_card.max_eager_size == 1024
    call = on_card.start(Scenario.BARRIER, dtype=F32)
    assert call.block(5) and not call.failed
    assert len(fake.runs(Scenario.BARRIER)) == 1


def test_a_driver_without_a_stack_keeps_its_old_threshold(
        card: tuple[Fake, Callable[..., Driver]]) -> None:
    """Driver(stack=None), as aaccl.compat makes it: a quarter of the rx buffers, and
    every call reaches the device."""
    fake, driver = card
    on_card = driver()
    assert on_card.max_eager_size == 1024 * max(1, 4 // 4)
    assert on_card.start(Scenario.BARRIER, dtype=F32).block(5)
    assert len(fake.runs(Scenario.BARRIER)) == 1


# -- ACCL's emulator: its -c is the stack -------------------------------------------------------

def test_the_emulator_over_rdma_takes_barrier_and_says_cyt_rdma() -> None:
    pytest.importorskip("zmq", reason="the emulator device needs pyzmq")
    from aaccl._constants import TAG_ANY
    from aaccl.devices._emulator import EmulatorDevice
    from test_emulator_protocol import FakeEmulator, args, close_within, finish, free_port

    fake = FakeEmulator()
    fake.retcode_for[TAG_ANY] = 0
    device = EmulatorDevice(0, port=fake.port, protocol="rdma")
    try:
        call = device.start(args(TAG_ANY, Scenario.BARRIER))
        finish(call)
        assert not call.failed and [c.scenario for c in fake.started()] == [Scenario.BARRIER]
    finally:
        close_within(device, 5)
        fake.close()
    with pytest.raises(DeviceError, match="-c cyt_rdma"):
        EmulatorDevice(0, port=free_port(), protocol="rdma", connect_timeout=0.2)
    with pytest.raises(ValueError, match="protocol must be one of tcp, udp, rdma"):
        EmulatorDevice(0, port=free_port(), protocol="cyt_rdma")
