"""The emulator device's wire protocol, against a fake of ACCL's emulator command server.

`FakeEmulator` answers on a ZMQ REP socket exactly as `serve_zmq` in Xilinx/ACCL
test/model/zmq/zmq_server.cpp (the emulator's variant, with `cfgmem`, `devicemem`
and `hostmem`) does: JSON requests by "type", replies {"status", ["rdata"]} as
jsoncpp writes them; memory reads come back as the server's `vector<char>`, i.e.
signed chars. Behind it sits a tiny firmware: one command stream (NUM_CTRL_STREAMS
is 1 in zmq_server.h), calls that report "running" for a few polls, a return code
written to RETVAL_OFFSET (0x1FFC) on completion, COPY and NOP implemented (COPY with
its stream flags, over the kernel loopback `cclo_emu -b` makes), config calls
complete at once. Tests choose return codes, hold calls (a call that never
completes), and can make the server stop answering.

The fake also checks the client: every field it sends must survive jsoncpp's
asUInt/asUInt64 (no negative or out-of-range numbers), memory addresses must fit
the server's `int`, and no call may start while another is outstanding (the
firmware would overwrite the first call's return code).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest

import aaccl
from aaccl import _exchmem as xm
from aaccl import CCLOError, DependencyError, DeviceError, DeviceStuck, ErrorCode
from aaccl._constants import TAG_ANY, ConfigFunction, Scenario
from aaccl.devices import CallArgs, DeviceCall
from aaccl.devices import _emulator, _serial
from aaccl.devices._emulator import EmulatorDevice, available
from aaccl.driver import Driver

zmq = pytest.importorskip("zmq", reason="the emulator device needs pyzmq: pip install 'aaccl[emulator]'")

END_OF_EXCHMEM = 0x2000  # ccl_offload_control.h
NUM_CTRL_STREAMS = 1  # zmq_server.h
HWID = 0x0ACC1E3
CALL_FIELDS = ("scenario", "count", "comm", "root_src_dst", "function", "tag", "arithcfg",
               "compression_flags", "stream_flags", "addr_0", "addr_1", "addr_2")
WORD_FIELDS = CALL_FIELDS[:9]
ADDR_FIELDS = CALL_FIELDS[9:]
INT_MAX = 2**31 - 1  # the server keeps memory addresses and lengths in an `int`


@dataclass
class FakeCall:
    """One call as the firmware got it: the request, and the 15 command words that
    serve_zmq pushes into the command stream (64-bit addresses split low, high)."""

    request: dict[str, Any]
    words: list[int]
    busy: int  # polls left that report "running"

    @property
    def tag(self) -> int:
        return int(self.request["tag"])

    @property
    def scenario(self) -> int:
        return int(self.request["scenario"])


class FakeEmulator:
    """ACCL's emulator command server (serve_zmq) with a minimal firmware behind it."""

    def __init__(self, busy_polls: int = 2, port: int | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self.socket.bind_to_random_port("tcp://127.0.0.1", min_port=20000,
                                                   max_port=60000)
        else:  # as `cclo_emu -p` does (tests/fakes/cclo_emu.py)
            self.socket.bind(f"tcp://127.0.0.1:{port}")
        self.port = port
        self.cfgmem = [0] * (END_OF_EXCHMEM // 4)
        self.cfgmem[xm.HWID // 4] = HWID
        self.devicemem = bytearray()
        self.hostmem = bytearray()
        self.loopback = bytearray()  # the kernel streams, looped back: whole 64-byte words
        self.busy_polls = busy_polls
        self.retcode_for: dict[int, int] = {}  # tag -> return code the firmware reports
        self.held: set[int] = set()  # tags of calls that do not complete until released
        self.events: list[tuple[Any, ...]] = []  # every request (and completion), in order
        self.violations: list[str] = []
        self.cond = threading.Condition()
        self._pending: deque[FakeCall] = deque()  # started, not finished: the command stream
        self._sts: deque[FakeCall] = deque()  # finished, not yet popped by a poll
        self._muted = False
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fake-cclo_emu")
        self._thread.start()

    # -- what tests use -------------------------------------------------------------------

    def hold(self, tag: int) -> None:
        with self.cond:
            self.held.add(tag)

    def release(self, tag: int) -> None:
        """Let the held call finish: the next poll finds it done."""
        with self.cond:
            self.held.discard(tag)
            for call in self._pending:
                if call.tag == tag:
                    call.busy = 0

    def mute(self) -> None:
        """Stop answering: requests from now on are never received, never replied to."""
        with self.cond:
            self._muted = True

    def leave_finished_call(self, tag: int, retcode: int) -> None:
        """A call some earlier client started and left before polling its completion
        (killed mid-call, or gone after the call timed out), finished since."""
        with self.cond:
            call = FakeCall(args(tag)._asdict(), [], 0)
            self.cfgmem[xm.RETCODE // 4] = retcode
            self._sts.append(call)
            self.events.append(("done", call))

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, timeout), "the fake emulator never got there"

    def snapshot(self) -> list[tuple[Any, ...]]:
        with self.cond:
            return list(self.events)

    def of_kind(self, kind: str, since: int = 0) -> list[tuple[Any, ...]]:
        with self.cond:
            return [e[1:] for e in self.events[since:] if e[0] == kind]

    def started(self) -> list[FakeCall]:
        return [e[0] for e in self.of_kind("start")]

    def started_tags(self) -> list[int]:
        return [c.tag for c in self.started()]

    def _started_tags_locked(self) -> list[int]:
        return [e[1].tag for e in self.events if e[0] == "start"]

    def word(self, offset: int) -> int:
        with self.cond:
            return self.cfgmem[offset // 4]

    def close(self) -> None:
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        self._thread.join(5)
        assert not self._thread.is_alive(), "the fake emulator's thread did not stop"
        self.socket.close(linger=0)
        self.context.term()

    # -- the server -----------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            with self.cond:  # a muted server takes no request until the test ends
                self.cond.wait_for(lambda: not self._muted or self._stopping)
                if self._stopping:
                    return
            if not poller.poll(20):  # wake now and then to notice _stopping
                continue
            with self.cond:
                if self._muted:
                    continue
            text = self.socket.recv_string()
            with self.cond:
                try:
                    response = self._answer(json.loads(text))
                except Exception as error:  # a malformed request: the real server would misbehave
                    self.violations.append(f"request {text[:200]!r}: {error!r}")
                    response = {"status": 1}
                self.cond.notify_all()
            # jsoncpp's StreamWriterBuilder: tab-indented, keys sorted, "key" : value
            self.socket.send_string(json.dumps(response, indent="\t", separators=(",", " : "),
                                               sort_keys=True))

    def _uint(self, request: dict[str, Any], key: str, bits: int = 32) -> int:
        """request[key].asUInt() (or asUInt64()): jsoncpp throws on what does not fit."""
        value = request.get(key)
        if isinstance(value, bool) and bits == 1:
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**max(bits, 1):
            self.violations.append(f"{key}={value!r} is not a {bits}-bit unsigned integer "
                                   f"in request {json.dumps(request)[:200]}")
            return 0
        return value

    def _memory(self, request: dict[str, Any], adr: int, length: int) -> bytearray:
        if adr + length > INT_MAX:
            self.violations.append(f"memory range {adr:#x}+{length} overflows the server's int")
        return self.hostmem if self._uint(request, "host", 1) else self.devicemem

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        response: dict[str, Any] = {"status": 0}
        kind = request.get("type")
        if kind == 0:  # MMIO read {"addr"} -> {"status", "rdata"}
            adr = self._uint(request, "addr")
            self.events.append(("mmio_read", adr))
            if adr >= END_OF_EXCHMEM:
                response.update(status=1, rdata=0)
            else:
                response["rdata"] = self.cfgmem[adr // 4]
        elif kind == 1:  # MMIO write {"addr", "wdata"}
            adr, value = self._uint(request, "addr"), self._uint(request, "wdata")
            self.events.append(("mmio_write", adr, value))
            if adr >= END_OF_EXCHMEM:
                response["status"] = 1
            else:
                self.cfgmem[adr // 4] = value
        elif kind == 2:  # memory read {"addr", "len", "host"} -> rdata: vector<char>, signed
            adr, length = self._uint(request, "addr"), self._uint(request, "len")
            mem = self._memory(request, adr, length)
            self.events.append(("mem_read", adr, length))
            if adr + length > len(mem):
                response.update(status=1, rdata=[0])
            elif length:  # for len 0 the server sets no rdata at all
                response["rdata"] = np.frombuffer(bytes(mem[adr:adr + length]), np.int8).tolist()
        elif kind == 3:  # memory write {"addr", "wdata": [...], "host"}: grows the memory
            adr, wdata = self._uint(request, "addr"), request.get("wdata")
            if not isinstance(wdata, list):
                self.violations.append(f"wdata is not an array: {wdata!r:.80}")
                wdata = []
            mem = self._memory(request, adr, len(wdata))
            self.events.append(("mem_write", adr, len(wdata)))
            if any(isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 256 for b in wdata):
                # asUInt() throws on negatives; above 255 a char keeps only the low byte
                self.violations.append(f"wdata holds values outside 0..255 at {adr:#x}")
                wdata = [int(b) & 0xFF for b in wdata]
            if adr + len(wdata) > len(mem):
                mem.extend(bytes(adr + len(wdata) - len(mem)))
            mem[adr:adr + len(wdata)] = bytes(wdata)
        elif kind == 4:  # allocate {"addr", "len", "host"}: grows the memory
            adr, length = self._uint(request, "addr"), self._uint(request, "len")
            mem = self._memory(request, adr, length)
            self.events.append(("alloc", adr, length))
            if adr + length > len(mem):
                mem.extend(bytes(adr + length - len(mem)))
        elif kind == 5:  # call start {"ctrl_id", 12 arguments}
            if self._uint(request, "ctrl_id") >= NUM_CTRL_STREAMS:
                response["status"] = -1
            else:
                self._start(request)
        elif kind == 6:  # call wait {"ctrl_id"} -> 0 (done, popped) or 1 (running)
            if self._uint(request, "ctrl_id") >= NUM_CTRL_STREAMS:
                response["status"] = -1
            else:
                self._progress()
                response["status"] = 0 if self._sts else 1
                if self._sts:
                    self._sts.popleft()
                self.events.append(("poll", response["status"]))
        else:
            self.violations.append(f"unknown request type {kind!r}")
            response["status"] = 1
        return response

    # -- the firmware ---------------------------------------------------------------------

    def _start(self, request: dict[str, Any]) -> None:
        if self._pending or self._sts:
            self.violations.append(
                f"call {request.get('tag')} started while call "
                f"{(self._pending or self._sts)[0].tag} is outstanding")
        words = [self._uint(request, key) for key in WORD_FIELDS]
        for key in ADDR_FIELDS:
            address = self._uint(request, key, 64)
            words += [address & 0xFFFFFFFF, address >> 32]
        extra = set(request) - {"type", "ctrl_id", *CALL_FIELDS}
        if extra:
            self.violations.append(f"unexpected call fields {sorted(extra)}")
        call = FakeCall({k: request.get(k) for k in CALL_FIELDS}, words, self.busy_polls)
        self.events.append(("start", call))
        self._pending.append(call)
        if call.scenario == Scenario.CONFIG and len(self._pending) == 1:
            self._finish()  # config calls complete at once

    def _progress(self) -> None:
        if not self._pending:
            return
        call = self._pending[0]
        if call.tag in self.held:
            return
        if call.busy > 0:
            call.busy -= 1
            return
        self._finish()

    def _finish(self) -> None:
        call = self._pending.popleft()
        w = call.words
        retcode = 0
        if call.scenario == Scenario.COPY:
            nbytes, src, dst = 4 * w[1], w[9] | (w[10] << 32), w[13] | (w[14] << 32)
            words = -(-nbytes // 64) * 64
            if max(src, dst) + nbytes > len(self.devicemem):
                self.violations.append(f"copy outside device memory: {src:#x} -> {dst:#x}")
                retcode = ErrorCode.DMA_DECODE_ERROR
            elif w[8] & 1 and len(self.loopback) < words:
                self.violations.append("a copy reads more than the kernel stream holds")
            else:
                data = self.loopback[:nbytes] if w[8] & 1 else self.devicemem[src:src + nbytes]
                if w[8] & 1:
                    del self.loopback[:words]
                if w[8] & 2:
                    self.loopback += data + bytes(words - nbytes)
                else:
                    self.devicemem[dst:dst + nbytes] = data
        elif call.scenario == Scenario.CONFIG:
            if w[4] == ConfigFunction.RESET_PERIPH:
                self.cfgmem[xm.CFGRDY // 4] = 0  # the firmware's init waits for the host again
        elif call.scenario != Scenario.NOP:
            retcode = ErrorCode.COLLECTIVE_NOT_IMPLEMENTED  # not in this fake
        retcode = self.retcode_for.get(call.tag, retcode)
        self.cfgmem[xm.RETCODE // 4] = int(retcode) & 0xFFFFFFFF
        self._sts.append(call)
        self.events.append(("done", call))


# -- fixtures and helpers ------------------------------------------------------------------

RANKS = [xm.RankRecord(ip=xm.ip_encode("127.0.0.1"), port=17000, session=0,
                       max_segment_size=1024)]


@pytest.fixture
def fake() -> Iterator[FakeEmulator]:
    server = FakeEmulator()
    try:
        yield server
    finally:
        server.close()
    assert server.violations == []


def close_within(device: EmulatorDevice, seconds: float) -> None:
    closer = threading.Thread(target=device.close, daemon=True)
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), f"closing the device took over {seconds} s"


@pytest.fixture
def device(fake: FakeEmulator) -> Iterator[EmulatorDevice]:
    dev = EmulatorDevice(0, port=fake.port, reply_timeout=5.0, connect_timeout=5.0)
    try:
        yield dev
    finally:
        close_within(dev, 10)


def configured(device: EmulatorDevice, timeout: float = 5.0) -> Driver:
    driver = Driver(device, 0, RANKS, nbufs=4, bufsize=1024, timeout=timeout)
    driver.configure()
    return driver


def args(tag: int, scenario: int = Scenario.NOP, **fields: int) -> CallArgs:
    values = dict(scenario=int(scenario), count=0, comm=0, root_src_dst=0, function=0, tag=tag,
                  arithcfg=0, compression_flags=0, stream_flags=0, addr_0=0, addr_1=0, addr_2=0)
    return CallArgs(**{**values, **fields})


def finish(*calls: DeviceCall, timeout: float = 5.0) -> None:
    for call in calls:
        assert call.block(timeout), f"{call.args} never completed"


def free_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- connecting ----------------------------------------------------------------------------

def test_connects_to_start_port_plus_rank_and_reads_the_hardware_id(fake: FakeEmulator) -> None:
    dev = EmulatorDevice(2, port=fake.port - 2)
    try:
        assert dev.endpoint == f"tcp://127.0.0.1:{fake.port}"
        assert fake.of_kind("mmio_read")[:1] == [(xm.HWID,)]
        assert dev.mmio_read(xm.HWID) == HWID
    finally:
        close_within(dev, 5)


def test_no_server_at_the_port_fails_within_connect_timeout() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(DeviceError, match="no ACCL emulator answers") as caught:
        EmulatorDevice(1, port=port - 1, connect_timeout=0.3)
    assert time.monotonic() - started < 0.3 + 2.0
    message = str(caught.value)
    assert f"tcp://127.0.0.1:{port}" in message and "cclo_emu" in message
    assert f"-r 1 -p {port - 1}" in message  # the command that would start the missing rank


def test_available_with_the_fake_running(fake: FakeEmulator) -> None:
    ok, reason = available(fake.port)
    assert ok, reason
    assert f"tcp://127.0.0.1:{fake.port}" in reason


def test_available_without_a_server_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AACCL_EMULATOR", "/opt/accl/cclo_emu")
    port = free_port()
    ok, reason = available(port)
    assert not ok
    assert f"no emulator answers at tcp://127.0.0.1:{port}" in reason
    assert "/opt/accl/cclo_emu" in reason and "docs/emulator.md" in reason


def test_available_without_pyzmq(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)
    ok, reason = available(free_port())
    assert not ok and "pip install 'aaccl[emulator]'" in reason


# -- exchange memory and device memory -----------------------------------------------------

def test_mmio_round_trip_and_refused_requests(fake: FakeEmulator, device: EmulatorDevice) -> None:
    device.mmio_write(0x100, -1)  # sent as the 32-bit word, as asUInt() needs
    assert fake.word(0x100) == 0xFFFFFFFF == device.mmio_read(0x100)
    with pytest.raises(DeviceError, match="refused request 0"):
        device.mmio_read(END_OF_EXCHMEM)
    with pytest.raises(DeviceError, match="refused request 1"):
        device.mmio_write(END_OF_EXCHMEM, 1)
    device.mmio_write(0x104, 7)  # a refusal leaves the connection usable
    assert device.mmio_read(0x104) == 7


def test_alloc_asks_for_aligned_ranges_within_the_servers_int(fake: FakeEmulator,
                                                              device: EmulatorDevice) -> None:
    a, b = device.alloc(100), device.alloc(1)
    assert fake.of_kind("alloc") == [(a, 100), (b, 1)]
    assert a % 64 == 0 and b == a + 128  # 100 bytes take two 64-byte blocks
    device.free(a)
    assert device.alloc(64) == a  # freed ranges are reused
    assert len(fake.devicemem) >= b + 1


def test_every_byte_value_survives_the_signed_char_round_trip(fake: FakeEmulator,
                                                              device: EmulatorDevice) -> None:
    address = device.alloc(256)
    data = np.arange(256, dtype=np.uint8)
    device.write(address, data)
    assert bytes(fake.devicemem[address:address + 256]) == data.tobytes()
    out = np.zeros(256, np.uint8)
    device.read(address, out)
    np.testing.assert_array_equal(out, data)
    halves = np.zeros(128, np.int16)  # any dtype reads the same bytes
    device.read(address, halves)
    assert halves.tobytes() == data.tobytes()
    floats = np.linspace(-3, 3, 16).astype(np.float64)
    device.write(address, floats)
    back = np.zeros_like(floats)
    device.read(address, back)
    np.testing.assert_array_equal(back, floats)


def test_transfers_bigger_than_a_chunk_take_several_requests(
        monkeypatch: pytest.MonkeyPatch, fake: FakeEmulator, device: EmulatorDevice) -> None:
    monkeypatch.setattr(_emulator, "CHUNK", 1000)
    data = np.random.default_rng(5).integers(0, 256, 4500, dtype=np.uint8)
    address = device.alloc(data.size)
    expected = [(address + k, min(1000, data.size - k)) for k in range(0, data.size, 1000)]
    since = len(fake.snapshot())
    device.write(address, data)
    assert fake.of_kind("mem_write", since) == expected
    out = np.zeros_like(data)
    since = len(fake.snapshot())
    device.read(address, out)
    assert fake.of_kind("mem_read", since) == expected
    np.testing.assert_array_equal(out, data)


# -- configuration -------------------------------------------------------------------------

def test_configure_writes_num_rx_bufs_last_then_cfgrdy(fake: FakeEmulator,
                                                       device: EmulatorDevice) -> None:
    configured(device, timeout=2.0)
    events = fake.snapshot()
    writes = [(i, e[1], e[2]) for i, e in enumerate(events) if e[0] == "mmio_write"]
    rx_end = xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * 4
    rx_setup = [(i, a, v) for i, a, v in writes if a < rx_end]
    assert rx_setup[-1][1:] == (xm.NUM_RX_BUFS, 4), "NUM_RX_BUFS must be written last"
    assert [a for _, a, _ in rx_setup].count(xm.NUM_RX_BUFS) == 1
    assert [(a, v) for _, a, v in rx_setup if a == xm.RX_BUF_SIZE] == [(xm.RX_BUF_SIZE, 1024)]

    allocs = dict(fake.of_kind("alloc"))
    buffers = [xm.RxBuffer.read(fake.word, xm.RX_RECORDS + 4 * xm.RxBuffer.WORDS * k)
               for k in range(4)]
    assert len({b.address for b in buffers}) == 4
    for buf in buffers:
        assert buf.status == xm.RxBuffer.IDLE and allocs[buf.address] >= 1024
        assert fake.devicemem[buf.address:buf.address + 1024] == bytes(1024)

    starts = [(i, e[1]) for i, e in enumerate(events) if e[0] == "start"]
    assert {c.scenario for _, c in starts} == {Scenario.CONFIG}
    assert [c.request["function"] for _, c in starts] == [
        ConfigFunction.RESET_PERIPH, ConfigFunction.SET_TIMEOUT,
        ConfigFunction.SET_MAX_EAGER_MSG_SIZE, ConfigFunction.SET_MAX_RENDEZVOUS_MSG_SIZE,
        ConfigFunction.ENABLE_PKT]
    assert starts[1][1].request["count"] == 2 * EmulatorDevice.timer_hz  # SET_TIMEOUT, in cycles
    cfgrdy = [(i, v) for i, a, v in writes if a == xm.CFGRDY]
    assert [v for _, v in cfgrdy] == [1]
    # reset, then the rx buffers, then CFGRDY, then the remaining config calls
    assert starts[0][0] < rx_setup[0][0] and rx_setup[-1][0] < cfgrdy[0][0] < starts[1][0]
    assert fake.word(xm.CFGRDY) == 1


# -- calls ---------------------------------------------------------------------------------

def test_call_arguments_reach_the_firmware_in_accls_layout(fake: FakeEmulator,
                                                           device: EmulatorDevice) -> None:
    call_args = args(TAG_ANY, count=0xFFFFFFFF, comm=0x1F00, root_src_dst=3, function=1,
                     arithcfg=0x700, compression_flags=8, stream_flags=3,
                     addr_0=0x1_2345_6780, addr_1=0xFFFF_FFFF_FFFF_FFC0, addr_2=0x7FFF_FFC0)
    finish(device.start(call_args))
    [call] = fake.started()
    assert call.request == call_args._asdict()
    assert call.words == [255, 0xFFFFFFFF, 0x1F00, 3, 1, 0xFFFFFFFF, 0x700, 8, 3,
                          0x2345_6780, 0x1, 0xFFFF_FFC0, 0xFFFF_FFFF, 0x7FFF_FFC0, 0]


def test_driver_calls_carry_tag_any_and_the_communicator(fake: FakeEmulator,
                                                         device: EmulatorDevice) -> None:
    driver = configured(device)
    a, b = device.alloc(64), 0x2_0000_0000
    call = driver.start(Scenario.NOP, count=16, dtype=np.dtype(np.float32), addrs=(a, 0, b))
    finish(call)
    request = fake.started()[-1].request
    assert request["tag"] == TAG_ANY == 0xFFFFFFFF
    assert request["comm"] == driver.communicators[0][0]
    assert request["arithcfg"] == driver.arithcfg(np.dtype(np.float32), np.dtype(np.float32))
    assert (request["addr_0"], request["addr_2"]) == (a, b)
    assert fake.started()[-1].words[13:] == [0, 2]


def test_calls_run_one_at_a_time_in_order_each_with_its_own_retcode(
        fake: FakeEmulator, device: EmulatorDevice) -> None:
    fake.retcode_for.update({tag: 0x100 + tag for tag in range(0, 30, 3)})
    calls = [device.start(args(tag)) for tag in range(30)]
    finish(*calls)
    assert fake.started_tags() == list(range(30))  # the fake flags any overlap
    assert [c.retcode for c in calls] == [0x100 + t if t % 3 == 0 else 0 for t in range(30)]
    assert all(c.error is None and not c.aborted for c in calls)
    assert fake.of_kind("poll").count((1,)) >= 2 * 30  # each call reported "running" first
    # each completion's retcode is read before the next call could overwrite it
    unread = False
    for event in fake.snapshot():
        if event == ("poll", 0):
            assert not unread
            unread = True
        elif event == ("mmio_read", xm.RETCODE):
            unread = False
        elif event[0] == "start":
            assert not unread, "a call started before the last one's retcode was read"
    assert not unread
    error = Driver.error(calls[3], "nop")
    assert isinstance(error, CCLOError) and error.code == 0x103


def test_dependent_starts_only_after_its_dependencies(fake: FakeEmulator,
                                                      device: EmulatorDevice) -> None:
    outside = DeviceCall(args(0))  # a dependency no device runs: completed by the test
    dependent = device.start(args(2), [outside])
    independent = device.start(args(3))
    finish(independent)
    assert fake.started_tags() == [3] and not dependent.done()
    completer = threading.Thread(target=outside.complete)
    completer.start()
    completer.join()
    finish(dependent)
    assert fake.started_tags() == [3, 2] and dependent.retcode == 0

    fake.hold(10)
    first = device.start(args(10))
    second = device.start(args(11), [first])
    third = device.start(args(12), [first, second])
    fake.wait_until(lambda: fake._started_tags_locked()[-1:] == [10])
    assert not (second.done() or third.done())
    fake.release(10)
    finish(first, second, third)
    assert fake.started_tags()[2:] == [10, 11, 12]
    order = [(e[0], e[1].tag) for e in fake.snapshot() if e[0] in ("start", "done")]
    assert order[-6:] == [("start", 10), ("done", 10), ("start", 11), ("done", 11),
                          ("start", 12), ("done", 12)]


def test_communicating_calls_start_in_the_order_they_were_submitted(
        fake: FakeEmulator, device: EmulatorDevice) -> None:
    """Every rank's firmware must run its sends, receives and collectives in the order
    its program gave them (messages match by order): one that waits for a dependency
    holds back the communicating calls after it, not the local ones; one whose
    dependency failed gives way."""
    fake.retcode_for.update({tag: 0 for tag in range(1, 10)})
    outside = DeviceCall(args(0))
    waiting = device.start(args(1, Scenario.ALLREDUCE), [outside])
    later = device.start(args(2, Scenario.BCAST))
    local = device.start(args(3, Scenario.COPY))  # count 0: copies nothing
    finish(local)
    assert fake.started_tags() == [3] and not later.done()
    threading.Thread(target=outside.complete).start()
    finish(waiting, later)
    assert fake.started_tags() == [3, 1, 2] and not waiting.failed and not later.failed

    failed = DeviceCall(args(0))
    gives_way = device.start(args(4, Scenario.SEND), [failed])
    after = device.start(args(5, Scenario.RECV))
    assert not after.done() or fake.started_tags()[-1] == 5
    failed.complete(error=RuntimeError("a dependency failed"))
    finish(gives_way, after)
    assert gives_way.aborted and not after.failed
    assert fake.started_tags() == [3, 1, 2, 5]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_collective_waiting_for_its_buffer_keeps_its_place(fake: FakeEmulator,
                                                            backend: str) -> None:
    """A collective that waits for an earlier call on its buffer (a kernel here) is not
    passed by a later, independent collective: on another rank, where nothing made it
    wait, the two would run the other way round and the firmware would mismatch them."""
    fake.retcode_for[TAG_ANY] = 0

    async def main(accl: aaccl.ACCL) -> None:
        buf, other = accl.allocate(8, np.float32), accl.allocate(8, np.float32)
        opened = threading.Event()
        touch = accl.kernel(lambda b: opened.wait(10), name="slow")(buf)
        first = accl.allreduce(buf, buf, 8, aaccl.ReduceFunction.SUM)  # waits for the kernel
        second = accl.bcast(other, 8, 0)
        with anyio.move_on_after(0.2):
            await second
        assert not second.done()
        opened.set()
        await second
        await first
        await touch

    aaccl.run(main, 1, device="emulator", emulator_port=fake.port, nbufs=4, timeout=5,
              backend=backend)
    assert [c.scenario for c in fake.started() if c.scenario != Scenario.CONFIG] \
        == [Scenario.ALLREDUCE, Scenario.BCAST]


def test_failed_dependency_aborts_its_dependents(fake: FakeEmulator,
                                                 device: EmulatorDevice) -> None:
    fake.retcode_for[1] = ErrorCode.RECEIVE_TIMEOUT_ERROR
    first = device.start(args(1))
    second = device.start(args(2), [first])
    third = device.start(args(3), [second])
    other = device.start(args(4))
    finish(first, second, third, other)
    assert first.retcode == ErrorCode.RECEIVE_TIMEOUT_ERROR
    assert second.aborted and third.aborted and not other.failed
    assert isinstance(Driver.error(second, "nop"), DependencyError)
    assert isinstance(Driver.error(third, "nop"), DependencyError)
    assert fake.started_tags() == [1, 4]


def test_barrier_and_alltoall_fail_at_once_naming_the_protocol(fake: FakeEmulator,
                                                               device: EmulatorDevice) -> None:
    driver = configured(device)
    fake.hold(1)
    pending = driver.start(Scenario.NOP, tag=1)
    for scenario in (Scenario.BARRIER, Scenario.ALLTOALL):
        call = driver.start(scenario, dtype=np.dtype(np.float32), waitfor=[pending])
        assert call.done()  # at once, even with a dependency pending
        error = Driver.error(call, scenario.name.lower())
        assert isinstance(error, DeviceError) and not isinstance(error, DeviceStuck)
        assert "tcp" in str(error) and scenario.name.lower() in str(error)
    fake.release(1)
    finish(pending)
    udp = EmulatorDevice(0, port=fake.port, protocol="udp")
    try:
        call = udp.start(args(2, Scenario.BARRIER))
        assert call.done() and "udp" in str(call.error)
    finally:
        close_within(udp, 5)
    assert not {Scenario.BARRIER, Scenario.ALLTOALL} & {c.scenario for c in fake.started()}


def test_call_that_never_completes_times_out_then_the_device_is_stuck(
        fake: FakeEmulator, device: EmulatorDevice) -> None:
    driver = configured(device, timeout=0.3)
    assert [c.request["count"] for c in fake.started()
            if c.request["function"] == ConfigFunction.SET_TIMEOUT] == [75_000_000]
    fake.hold(7)
    started = time.monotonic()
    stuck = driver.start(Scenario.NOP, tag=7)
    finish(stuck, timeout=10)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 0.3 + 1.0 + 2.0  # the timeout, the device's grace, slack
    assert stuck.retcode == ErrorCode.RECEIVE_TIMEOUT_ERROR and stuck.error is None
    assert isinstance(Driver.error(stuck, "nop"), CCLOError)

    started = time.monotonic()
    later = driver.start(Scenario.NOP, tag=8)
    dependent = driver.start(Scenario.NOP, tag=9, waitfor=[later])
    finish(later, dependent)
    assert time.monotonic() - started < 1.0  # fails fast, not after another timeout
    assert isinstance(later.error, DeviceStuck)
    assert isinstance(Driver.error(later, "nop"), aaccl.DeviceStuck)
    assert dependent.aborted
    assert fake.started_tags()[-1:] == [7]

    fake.release(7)  # the firmware finally finishes it: the device works again
    again = driver.start(Scenario.NOP, tag=10)
    finish(again)
    assert again.error is None and again.retcode == 0
    after = driver.start(Scenario.NOP, tag=11)
    finish(after)
    assert after.error is None and after.retcode == 0
    assert fake.started_tags()[-3:] == [7, 10, 11]


def test_a_timeout_longer_than_the_register_holds_is_enforced_in_full(
        fake: FakeEmulator, device: EmulatorDevice, monkeypatch: pytest.MonkeyPatch) -> None:
    """SET_TIMEOUT's 32-bit register saturates (near 17 s at 250 MHz; here, with a
    faster clock, at 0.2 s): the host still fails the call at the timeout asked for."""
    monkeypatch.setattr(_serial, "TIMEOUT_GRACE", 0.0)
    monkeypatch.setattr(EmulatorDevice, "timer_hz", int(0xFFFFFFFF / 0.2))
    driver = configured(device, timeout=0.6)
    assert [c.request["count"] for c in fake.started()
            if c.request["function"] == ConfigFunction.SET_TIMEOUT] == [0xFFFFFFFF]
    fake.hold(7)
    started = time.monotonic()
    stuck = driver.start(Scenario.NOP, tag=7)
    finish(stuck, timeout=10)
    assert time.monotonic() - started >= 0.6  # not the register's 0.2 s
    assert stuck.retcode == ErrorCode.RECEIVE_TIMEOUT_ERROR
    fake.release(7)


def test_server_that_stops_answering_fails_requests_within_reply_timeout(
        fake: FakeEmulator) -> None:
    dev = EmulatorDevice(0, port=fake.port, reply_timeout=0.3)
    try:
        fake.mute()
        started = time.monotonic()
        with pytest.raises(DeviceError, match="did not answer"):
            dev.mmio_read(xm.HWID)
        assert time.monotonic() - started < 0.3 + 2.0
        started = time.monotonic()
        with pytest.raises(DeviceError, match="did not answer"):
            dev.mmio_read(xm.HWID)  # gone: no second wait
        call = dev.start(args(1))
        finish(call)
        assert time.monotonic() - started < 1.0
        assert isinstance(call.error, DeviceError)
    finally:
        close_within(dev, 2.0)


def test_server_that_stops_answering_during_a_call_fails_the_call(fake: FakeEmulator) -> None:
    dev = EmulatorDevice(0, port=fake.port, reply_timeout=0.3)
    try:
        fake.hold(5)
        call = dev.start(args(5))
        fake.wait_until(lambda: fake._started_tags_locked() == [5])
        fake.mute()
        started = time.monotonic()
        finish(call)
        assert time.monotonic() - started < 0.3 + 2.0
        assert isinstance(call.error, DeviceError) and "did not answer" in str(call.error)
    finally:
        close_within(dev, 2.0)


def test_a_completion_left_by_an_earlier_client_is_not_taken_for_a_new_calls() -> None:
    fake = FakeEmulator()
    dev = None
    try:
        fake.leave_finished_call(77, ErrorCode.RECEIVE_TIMEOUT_ERROR)
        dev = EmulatorDevice(0, port=fake.port)
        calls = [dev.start(args(tag)) for tag in (1, 2)]
        finish(*calls)
        assert [c.retcode for c in calls] == [0, 0]
        assert fake.violations == []  # no call started while another was still running
    finally:
        if dev is not None:
            close_within(dev, 5)
        fake.close()


def test_a_closed_device_fails_requests_and_calls(fake: FakeEmulator) -> None:
    dev = EmulatorDevice(0, port=fake.port)
    outside = DeviceCall(args(0))
    waiting = dev.start(args(1), [outside])  # its dependency completes after close
    dev.close()
    with pytest.raises(DeviceError):
        dev.mmio_read(xm.HWID)
    with pytest.raises(DeviceError):
        dev.alloc(64)
    assert dev._heap.in_use == 0  # a failed alloc keeps no range
    outside.complete()
    late = dev.start(args(2))
    finish(waiting, late, timeout=1.0)
    assert isinstance(waiting.error, DeviceError) and isinstance(late.error, DeviceError)
    assert fake.started_tags() == []


# -- end to end ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_copy_end_to_end(fake: FakeEmulator, backend: str) -> None:
    n = 300

    async def main(accl: aaccl.ACCL) -> np.ndarray:
        src, mid, dst = (accl.allocate(n, np.float32) for _ in range(3))
        src[:] = np.linspace(-100, 100, n, dtype=np.float32)  # bytes of both signs
        await accl.copy(src, dst, n)
        np.testing.assert_array_equal(dst, src)
        first = accl.copy(src, mid, n, to_fpga=True)
        await accl.copy(mid, dst, n, from_fpga=True, waitfor=[first])
        await first
        with pytest.raises(DeviceError, match="barrier.*tcp"):
            await accl.barrier()
        return np.array(dst)

    [result] = aaccl.run(main, 1, device="emulator", emulator_port=fake.port, nbufs=4,
                         timeout=5, backend=backend)
    np.testing.assert_array_equal(result, np.linspace(-100, 100, n, dtype=np.float32))
    copies = [c for c in fake.started() if c.scenario == Scenario.COPY]
    assert len(copies) == 3 and all(c.request["count"] == n for c in copies)
    assert copies[1].request["addr_2"] == copies[2].request["addr_0"]  # the chain's middle


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_stream_flags_reach_the_firmware_and_the_loopback_returns_the_data(
        fake: FakeEmulator, backend: str) -> None:
    """Stream flags pass through as they are; with the emulator's kernel loopback
    (`cclo_emu -b`), what a copy writes to the stream the next copy reads back, as on
    the soft CCLO. Streamed buffers are synced neither in nor out; kernels cannot be
    attached to the streams here."""
    n = 40

    async def main(accl: aaccl.ACCL) -> tuple[np.ndarray, int]:
        src, dst, dtype_of = (accl.allocate(n, np.float32) for _ in range(3))
        src[:], dst[:], dtype_of[:] = np.arange(n), -1, 7
        await accl.copy(src, dtype_of, n, stream_flags=aaccl.StreamFlags.RES_STREAM)
        np.testing.assert_array_equal(dtype_of, 7)  # nothing synced out
        await accl.copy(dtype_of, dst, n, stream_flags=aaccl.StreamFlags.OP0_STREAM)
        with pytest.raises(TypeError, match="attach_stream needs the soft CCLO"):
            accl.attach_stream(lambda chunk, tag: chunk)
        return np.array(dst), dtype_of.device_address

    [(result, unsynced)] = aaccl.run(main, 1, device="emulator", emulator_port=fake.port,
                                     nbufs=4, timeout=5, backend=backend)
    np.testing.assert_array_equal(result, np.arange(n))
    copies = [c.request for c in fake.started() if c.scenario == Scenario.COPY]
    assert [c["stream_flags"] for c in copies] == [2, 1]
    assert all(adr != unsynced for adr, _ in fake.of_kind("mem_write"))
    assert fake.loopback == bytearray()


def test_a_python_kernel_between_firmware_calls_works_on_staged_device_memory(
        fake: FakeEmulator) -> None:
    """The emulator's memory is behind the socket: a Python kernel gets a copy read
    before it runs and written back after, between the firmware's calls."""
    n = 50

    async def main(accl: aaccl.ACCL) -> np.ndarray:
        src, mid, dst = (accl.allocate(n, np.int32) for _ in range(3))
        src[:] = np.arange(n)
        copied = accl.copy(src, mid, n, to_fpga=True)
        negated = accl.kernel(np.negative)(mid, out=mid, waitfor=[copied])  # one copy
        await accl.copy(mid, dst, n, from_fpga=True, waitfor=[negated])
        np.testing.assert_array_equal(mid, 0)  # the host copy of mid never moved
        await accl.sync_from_device(mid)
        np.testing.assert_array_equal(mid, -np.arange(n))
        return np.array(dst)

    [result] = aaccl.run(main, 1, device="emulator", emulator_port=fake.port, nbufs=4, timeout=5)
    np.testing.assert_array_equal(result, -np.arange(n))
