"""ACCL's emulator for tests marked `device="emulator"`: one started for the test from
the `cclo_emu` binary AACCL_EMULATOR names, or one already answering at the test's
`emulator_port`; otherwise the reason the test is skipped."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .._errors import DeviceError
from ..devices._emulator import DEFAULT_PORT, PROTOCOLS, EmulatorDevice, available

START_WITHIN = 60.0  # seconds the emulator's ranks may take to answer (they sleep on purpose)
VARIABLE = "AACCL_EMULATOR"


def binary() -> str | None:
    """The cclo_emu that AACCL_EMULATOR names, if it does."""
    return os.environ.get(VARIABLE) or None


@functools.cache
def answering(port: int = DEFAULT_PORT) -> tuple[bool, str]:
    """Whether an emulator answers at `port`, and why (not); asked once per port."""
    return available(port)


def skip_reason(port: int = DEFAULT_PORT, may_start: bool = True) -> str | None:
    """None if the test can run on an emulator (AACCL_EMULATOR, where it `may_start`
    one, or one answering at `port`), else why not and how to provide one."""
    path = binary() if may_start else None
    if path is not None:
        if not os.access(path, os.X_OK):
            return f"{VARIABLE}={path} is not an executable cclo_emu"
        try:
            import zmq  # noqa: F401
        except ImportError:
            return "the emulator device needs pyzmq: pip install 'aaccl[emulator]'"
        return None
    ok, why = answering(port)
    if ok:
        return None
    if not may_start:
        return f"device='emulator' under mpiexec: {why} (start one with a rank per process)"
    return (f"device='emulator': {why}; or set {VARIABLE} to a cclo_emu binary and each "
            "test starts its own (aaccl's docs/emulator.md)")


def _free_ports(n: int) -> int:
    """A start port with `n` free ports after it (the emulator binds 4 per rank)."""
    for base in range(23000, 60000, 89):
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise DeviceError("no range of free ports for the emulator")


@contextlib.contextmanager
def started(size: int, protocol: str = "tcp") -> Iterator[int]:
    """Run `size` ranks of the AACCL_EMULATOR binary on free ports with the network
    stack `protocol` ("tcp", "udp", "rdma"); yield their start port once every rank
    answers; stop them after."""
    path = binary()
    assert path is not None
    port = _free_ports(4 * size)
    with tempfile.TemporaryDirectory(prefix="aaccl-emulator-") as logs:
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(size):
                with open(Path(logs) / f"cclo_emu.{rank}.log", "wb") as log:
                    procs.append(subprocess.Popen(
                        [path, "-s", str(size), "-r", str(rank), "-p", str(port), "-c", PROTOCOLS[protocol],
                         "-l", "0"], stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL))
            _wait_until_answering(procs, port, protocol, Path(logs))
            yield port
        finally:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()


def _wait_until_answering(procs: list[subprocess.Popen[bytes]], port: int, protocol: str,
                          logs: Path) -> None:
    deadline = time.monotonic() + START_WITHIN
    for rank, proc in enumerate(procs):
        while True:
            if proc.poll() is not None:
                tail = (logs / f"cclo_emu.{rank}.log").read_text(errors="replace")[-2000:]
                raise DeviceError(f"{binary()} rank {rank} exited with status {proc.returncode} "
                                  f"before it answered:\n{tail}")
            try:
                EmulatorDevice(rank, port=port, protocol=protocol, connect_timeout=0.5).close()
                break
            except DeviceError:
                if time.monotonic() > deadline:
                    raise DeviceError(f"{binary()} rank {rank} did not answer within "
                                      f"{START_WITHIN:g} s") from None
