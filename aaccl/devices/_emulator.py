"""A client of ACCL's emulator, `cclo_emu`: ACCL's real firmware, run on the host.

Each emulated rank answers JSON requests on a ZMQ REP socket at start port + rank
(Xilinx/ACCL test/model/zmq): exchange-memory reads and writes, device-memory
allocation, reads and writes, a call's start, and polls for its completion. The
firmware runs one call at a time and cannot take a wait list, so calls go through
`SerialDevice`'s host-side queue, which also enforces the timeout the firmware
never acts on (a call whose peer never comes spins in the firmware forever).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _exchmem as xm
from .._constants import Scenario
from .._errors import DeviceError
from ._base import CallArgs, DeviceCall
from ._heap import Heap
from ._poll import poll
from ._serial import SerialDevice

log = logging.getLogger("aaccl")

DEFAULT_PORT = 5500  # cclo_emu's and ACCL's run.py default start port
PROTOCOLS = {"tcp": "tcp", "udp": "udp", "rdma": "cyt_rdma"}
"""aaccl's names for the emulator's network stacks, and cclo_emu's (its -c)."""
RENDEZVOUS_ONLY = frozenset({Scenario.BARRIER, Scenario.ALLTOALL})
"""Calls ACCL's firmware always runs with rendezvous, whatever their size."""
REPLY_TIMEOUT = 30.0
"""Seconds one request may take before the emulator counts as gone."""
CONNECT_TIMEOUT = 5.0
"""Seconds the first request may take: the emulator's many busy threads make it slow."""
CHUNK = 1 << 20
"""Bytes per memory request: the protocol sends every byte as a JSON number."""
_START, _POLL, _MMIO_READ, _MMIO_WRITE, _MEM_READ, _MEM_WRITE, _MEM_ALLOC = 5, 6, 0, 1, 2, 3, 4


class EmulatorDevice(SerialDevice):
    """One rank of a running `cclo_emu` world, driven over ZMQ. `protocol` is the
    network stack it was started with: "tcp", "udp", or "rdma" (`-c cyt_rdma`)."""

    config_timeout = REPLY_TIMEOUT
    stuck_remedy = "restart cclo_emu"

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
                f"e.g. `cclo_emu -s <world size> -r {rank} -p {port} "
                f"-c {PROTOCOLS[protocol]}` "
                "(see docs/emulator.md)") from None
        self._socket.setsockopt(zmq.RCVTIMEO, int(reply_timeout * 1000))
        # the server computes addr + len in an int: every range must end below 2**31
        self._heap = Heap(alignment=64, size=(1 << 31) - 4096 - 64)
        self._drained = False  # see _drain_completions
        self._start_runner(f"aaccl-emulator-{rank}")

    def __repr__(self) -> str:
        return f"<EmulatorDevice rank {self.rank} at {self.endpoint}>"

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
        if args.scenario not in RENDEZVOUS_ONLY or self.protocol == "rdma":
            return super().start(args, waitfor)
        # the firmware runs these through rendezvous notifications, which its TCP and UDP
        # stacks never deliver: the call would spin until the emulator restarts
        call = DeviceCall(args)
        call.complete(error=DeviceError(
            f"ACCL's firmware cannot run {Scenario(args.scenario).name.lower()} over the "
            f"emulator's {self.protocol} stack (it needs the rendezvous protocol of an RDMA "
            "stack)"))
        return call

    def _launch(self, args: CallArgs) -> None:
        if not self._drained:
            self._drain_completions()
            self._drained = True
        # the request's fields are the 12 call arguments under ACCL's names
        self._request({"type": _START, "ctrl_id": 0, **args._asdict()})

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

    def _wait(self, handle: None, deadline: float) -> bool | None:
        """Poll the firmware's one call until it completes (True) or `deadline` (None)."""
        def finished() -> bool | None:
            return True if self._request({"type": _POLL, "ctrl_id": 0})["status"] == 0 else None

        return poll(finished, deadline)

    def close(self) -> None:
        if not self._stop_runner():
            return
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
