"""A client of ACCL's emulator, `cclo_emu`: ACCL's real firmware, run on the host.

Each emulated rank answers JSON requests on a ZMQ REP socket at start port + rank
(Xilinx/ACCL test/model/zmq): exchange-memory reads and writes, device-memory
allocation, reads and writes, a call's start, and polls for its completion. The
firmware runs one call at a time and cannot take a wait list, so this device keeps
its calls in one host-side queue, starts each when its dependencies succeeded
(`start_after`) and the previous call finished, and reads the return code from the
exchange memory before the next call can overwrite it — as ACCL's own SimDevice
does.

ACCL's firmware keeps its receive timeout but never acts on it: a call whose peer
never comes spins in the firmware forever. The device enforces the configured
timeout on the host: the call fails with RECEIVE_TIMEOUT_ERROR, and until the
emulator finishes it (if ever) later calls fail at once with `DeviceStuck`.
"""

from __future__ import annotations

import json
import os
import shutil
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .._constants import ConfigFunction, ErrorCode, Scenario
from .._errors import DeviceError, DeviceStuck
from ._base import CallArgs, DeviceCall
from ._heap import Heap
from ._hostdeps import start_after
from ._poll import poll

log = logging.getLogger("aaccl")

DEFAULT_PORT = 5500  # cclo_emu's and ACCL's run.py default start port
PROTOCOLS = ("tcp", "udp")
RENDEZVOUS_ONLY = frozenset({Scenario.BARRIER, Scenario.ALLTOALL})
"""Calls ACCL's firmware always runs with rendezvous, whatever their size."""
EAGER_ONLY = 1 << 30
"""Eager threshold for the emulator: its TCP and UDP stacks cannot do rendezvous."""
REPLY_TIMEOUT = 30.0
"""Seconds one request may take before the emulator counts as gone."""
CONNECT_TIMEOUT = 5.0
"""Seconds the first request may take: the emulator's many busy threads make it slow."""
CHUNK = 1 << 20
"""Bytes per memory request: the protocol sends every byte as a JSON number."""
_START, _POLL, _MMIO_READ, _MMIO_WRITE, _MEM_READ, _MEM_WRITE, _MEM_ALLOC = 5, 6, 0, 1, 2, 3, 4


class EmulatorDevice:
    """One rank of a running `cclo_emu` world, driven over ZMQ."""

    timer_hz = 250_000_000  # the CCLO's clock, in which the firmware counts its timeout

    def __init__(self, rank: int, *, port: int = DEFAULT_PORT, host: str = "127.0.0.1",
                 protocol: str = "tcp", reply_timeout: float = REPLY_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        try:
            import zmq
        except ImportError:
            raise ImportError("the emulator device needs pyzmq: pip install 'aaccl[emulator]'") from None
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.rank, self.protocol = rank, protocol
        self.endpoint = f"tcp://{host}:{port + rank}"
        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REQ)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDTIMEO, int(reply_timeout * 1000))
        self._socket.connect(self.endpoint)
        self._lock = threading.Lock()  # one request in flight on a REQ socket
        self._gone: DeviceError | None = None
        # ZMQ connects lazily: ask for the hardware ID now, so a missing emulator is a
        # prompt error rather than a stalled first call
        self._socket.setsockopt(zmq.RCVTIMEO, int(connect_timeout * 1000))
        try:
            self.mmio_read(xm.HWID)
        except DeviceError:
            self._socket.close(linger=0)
            self._context.term()
            raise DeviceError(
                f"no ACCL emulator answers at {self.endpoint} (rank {rank}) within "
                f"{connect_timeout:g} s. Start one cclo_emu per rank with this start port, "
                f"e.g. `cclo_emu -s <world size> -r {rank} -p {port} -c {protocol}` "
                "(see docs/emulator.md)") from None
        self._socket.setsockopt(zmq.RCVTIMEO, int(reply_timeout * 1000))
        # the server computes addr + len in an int: every range must end below 2**31
        self._heap = Heap(alignment=64, size=(1 << 31) - 4096 - 64)
        self._call_timeout = 10.0
        self._stuck_since: float | None = None
        self._drained = False  # see _drain_completions
        self._queue: queue.SimpleQueue[DeviceCall | None] = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # no call is queued behind close's sentinel
        self._runner = threading.Thread(target=self._run_calls, daemon=True,
                                        name=f"aaccl-emulator-{rank}")
        self._runner.start()

    # -- the wire -----------------------------------------------------------------------

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._gone is not None:
                raise self._gone
            try:
                self._socket.send_string(json.dumps(request, separators=(",", ":")))
                reply = json.loads(self._socket.recv_string())
            except self._zmq.Again:
                self._gone = DeviceError(
                    f"ACCL's emulator at {self.endpoint} (rank {self.rank}) did not answer: "
                    "is cclo_emu running for this rank, with this start port?")
                raise self._gone from None
        status = reply.get("status", 1)
        if status != 0 and request["type"] != _POLL:
            raise DeviceError(f"ACCL's emulator refused request {request['type']} "
                                f"(status {status}): {json.dumps(request)[:120]}")
        return reply

    # -- exchange memory and device memory ----------------------------------------------

    def mmio_read(self, offset: int) -> int:
        return int(self._request({"type": _MMIO_READ, "addr": offset})["rdata"])

    def mmio_write(self, offset: int, value: int) -> None:
        self._request({"type": _MMIO_WRITE, "addr": offset, "wdata": int(value) & 0xFFFFFFFF})

    def alloc(self, nbytes: int) -> int:
        address = self._heap.alloc(nbytes)
        try:
            self._request({"type": _MEM_ALLOC, "addr": address, "len": max(nbytes, 1),
                           "host": False})
        except BaseException:
            self._heap.free(address)
            raise
        return address

    def free(self, address: int) -> None:
        self._heap.free(address)  # the emulator's memory only grows; the range is reused

    def write(self, address: int, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        for start in range(0, raw.size, CHUNK):
            chunk = raw[start:start + CHUNK].tolist()
            self._request({"type": _MEM_WRITE, "addr": address + start, "wdata": chunk,
                           "host": False})

    def read(self, address: int, out: np.ndarray) -> None:
        raw = out.view(np.uint8).reshape(-1)
        for start in range(0, raw.size, CHUNK):
            n = min(CHUNK, raw.size - start)
            reply = self._request({"type": _MEM_READ, "addr": address + start, "len": n,
                                   "host": False})
            # the server sends C chars, signed on x86: wrap them back to bytes
            raw[start:start + n] = np.array(reply["rdata"], np.int64).astype(np.uint8)

    # -- calls --------------------------------------------------------------------------

    def start(self, args: CallArgs, waitfor: Sequence[DeviceCall] = ()) -> DeviceCall:
        if args.scenario == Scenario.CONFIG and args.function == ConfigFunction.SET_TIMEOUT:
            self._call_timeout = args.count / self.timer_hz
        call = DeviceCall(args)
        if args.scenario in RENDEZVOUS_ONLY:
            # the firmware runs these through rendezvous notifications, which its TCP and
            # UDP stacks never deliver: the call would spin until the emulator restarts
            name = Scenario(args.scenario).name.lower()
            call.complete(error=DeviceError(
                f"ACCL's firmware cannot run {name} over the emulator's {self.protocol} stack "
                "(it needs the rendezvous protocol of an RDMA stack)"))
            return call
        return start_after(call, waitfor, self._enqueue)

    def _enqueue(self, call: DeviceCall) -> None:
        with self._closing:
            if not self._closed:
                self._queue.put(call)
                return
        call.complete(error=DeviceError(f"the emulator device of rank {self.rank} is closed"))

    def _run_calls(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                self._execute(call)
            except DeviceError as error:
                if not call.done():
                    call.complete(error=error)
            except Exception as error:  # a bug here must not strand the caller
                log.exception("emulator rank %d: call %s failed unexpectedly", self.rank, call.args)
                if not call.done():
                    call.complete(error=DeviceError(f"internal error: {error!r}"))

    def _execute(self, call: DeviceCall) -> None:
        if not self._drained:
            self._drain_completions()
            self._drained = True
        if self._stuck_since is not None and not self._unstuck():
            call.complete(error=DeviceStuck(
                f"ACCL's emulator (rank {self.rank}) is still running a call that timed out "
                f"{time.monotonic() - self._stuck_since:.1f} s ago; its firmware cannot "
                "abandon a call, so restart cclo_emu"))
            return
        a = call.args
        call.mark_started()
        self._request({"type": _START, "ctrl_id": 0, "scenario": a.scenario, "count": a.count,
                       "comm": a.comm, "root_src_dst": a.root_src_dst, "function": a.function,
                       "tag": a.tag, "arithcfg": a.arithcfg,
                       "compression_flags": a.compression_flags, "stream_flags": a.stream_flags,
                       "addr_0": a.addr_0, "addr_1": a.addr_1, "addr_2": a.addr_2})
        deadline = time.monotonic() + self._call_timeout + 1.0
        if a.scenario == Scenario.CONFIG:
            deadline = time.monotonic() + REPLY_TIMEOUT
        if self._wait_done(deadline):
            call.complete(retcode=self.mmio_read(xm.RETCODE))
            return
        log.warning("emulator rank %d: %s did not finish within the timeout; the firmware "
                    "keeps running it", self.rank, Scenario(a.scenario).name.lower())
        self._stuck_since = time.monotonic()
        call.complete(retcode=int(ErrorCode.RECEIVE_TIMEOUT_ERROR))

    def _drain_completions(self) -> None:
        """Pop completions an earlier client left in the firmware's status queue (it was
        killed mid-call, or closed after a call timed out that finished later): each
        would be taken for the next call's, putting every later call one completion
        early. Done before this device's first call, not on connecting, so that a
        probe (`available`) never takes a running client's completion."""
        for _ in range(1024):
            if self._request({"type": _POLL, "ctrl_id": 0})["status"] != 0:
                return
            log.warning("emulator rank %d: dropped a call's completion that an earlier "
                        "client left behind", self.rank)
        raise DeviceError(f"ACCL's emulator at {self.endpoint} (rank {self.rank}) reports "
                          "completions without end")

    def _wait_done(self, deadline: float) -> bool:
        """Poll the call in the firmware until it completes (True) or `deadline` (False)."""
        def finished() -> bool | None:
            return True if self._request({"type": _POLL, "ctrl_id": 0})["status"] == 0 else None

        return poll(finished, deadline) is not None

    def _unstuck(self) -> bool:
        """True once the firmware has finished the call that timed out."""
        if not self._wait_done(time.monotonic()):
            return False
        log.info("emulator rank %d: the call that timed out finished after all", self.rank)
        self._stuck_since = None
        return True

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._runner.join(timeout=REPLY_TIMEOUT)
        with self._lock:
            self._gone = DeviceError(f"the emulator device of rank {self.rank} is closed")
            self._socket.close(linger=0)
            self._context.term()


def available(port: int = DEFAULT_PORT, host: str = "127.0.0.1") -> tuple[bool, str]:
    """Whether an emulator answers at `port` (its rank 0), and a sentence saying why (not)."""
    try:
        import zmq  # noqa: F401
    except ImportError:
        return False, "pyzmq is not installed: pip install 'aaccl[emulator]'"
    binary = os.environ.get("AACCL_EMULATOR") or shutil.which("cclo_emu")
    built = f"cclo_emu at {binary}" if binary else "no cclo_emu binary named by AACCL_EMULATOR or on PATH"
    try:
        EmulatorDevice(0, port=port, host=host, connect_timeout=1.0).close()
    except DeviceError:
        return False, (f"no emulator answers at tcp://{host}:{port} ({built}; "
                       "see docs/emulator.md to build and start one)")
    return True, f"an emulator answers at tcp://{host}:{port} ({built})"
