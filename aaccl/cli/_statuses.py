"""The ranks' exit statuses, told to `aaccl launch` over TCP, and the end of a job.

Two things in hydra (MPICH's launcher) under `-disable-auto-cleanup`:
- its status for a job combines the ranks' raw statuses bitwise;
- whenever a rank ends, mpiexec tells every other machine's proxy. Once a proxy
  whose ranks are all done has exited, that write fails ("unable to send SIGUSR1
  downstream") and mpiexec gives up: it exits with 255 and its proxies kill the
  ranks still running. The more machines, the likelier.

So each rank's supervisor (_rank.py) connects to the launcher when it starts and,
once its program has ended, reports the program's status and waits to be let go:
the launcher lets every supervisor go once every rank has reported (or its
supervisor's connection dropped, or it never connected). No proxy exits while a
rank still runs; a rank that ended early costs its machine an idle supervisor.
The job's status is then the worst rank's, whatever mpiexec says.

Where a rank finds the launcher: where hydra's proxy found it (the address in the
proxy's `--control-port`, which honours HYDRA_IFACE and -iface), else the launching
machine's name, else this machine. Every message starts with a random token, so
nothing else that connects is taken for a rank. A rank that cannot reach the
launcher runs as before: its status is left to mpiexec's.
"""

from __future__ import annotations

import os
import secrets
import signal
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

VARIABLE = "AACCL_LAUNCH_STATUS"
PEERS_VARIABLE = "AACCL_LAUNCH_PEERS_FD"
"""In a program under `aaccl launch`: the pipe on which its supervisor writes a line
`RANK STATUS` whenever another rank's program ends (then sends it SIGUSR1)."""
CONNECT_TIMEOUT = 2.0  # per address a rank tries: the launcher answers at once or never
GRACE = 2.0  # how long the launcher waits for reports still in flight once mpiexec ended
LATE = 60.0  # a rank not connected this long after the first report is taken as absent
GO = b"go\n"
FAILURE_GRACE = 5.0
"""Seconds the ranks still running get, once a rank's program has failed (a non-zero
status), to end on their own before the launcher ends them (`Board`)."""
KILL_AFTER = 5.0
"""Seconds a program the launcher ended with SIGTERM has before its supervisor sends
SIGKILL."""


def how(status: int) -> str:
    """An exit status in words (128 + N: killed by signal N)."""
    if status > 128:
        try:
            return f"was killed by {signal.Signals(status - 128).name}"
        except ValueError:
            return f"was killed by signal {status - 128}"
    return f"exited with status {status}"


@dataclass
class _Rank:
    status: int | None = None
    gone: bool = False  # its connection dropped (a supervisor killed, say)

    @property
    def done(self) -> bool:
        """Nothing more to wait for from it: it reported, or never will."""
        return self.status is not None or self.gone


class Board:
    """The launcher's side: a listening socket and a thread that serves the ranks.

    Use as a context manager around the job; `env` goes into the ranks' environment.
    Leaving it lets every supervisor still held go.

    Once a rank's program has failed (a non-zero status, told to the others at once),
    the ranks still running get `grace` seconds to end on their own (an open aaccl
    world fails its calls within milliseconds and its program exits); then the
    launcher tells their supervisors to end them (SIGTERM, SIGKILL KILL_AFTER seconds
    later), and says so. A rank that cannot learn of the failure would otherwise run
    forever: MPI_Init waits for every process of the job, and a process that exits
    before it starts MPI makes hydra wait forever too."""

    def __init__(self, nprocs: int, grace: float = FAILURE_GRACE) -> None:
        self.nprocs = nprocs
        self.grace = grace
        self.failed: tuple[int, int, float] | None = None  # the first (rank, status, when)
        self.ended: set[int] = set()  # the ranks this launcher ended
        self._conns: dict[int, socket.socket] = {}
        self._token = secrets.token_hex(8)
        self._ranks: dict[int, _Rank] = {}
        self._held: list[socket.socket] = []
        self._first_report: float | None = None
        self._changed = threading.Condition()
        self._listener = listen()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="aaccl-launch-statuses",
                                        daemon=True)

    @property
    def env(self) -> dict[str, str]:
        port = self._listener.getsockname()[1]
        return {VARIABLE: f"{port}:{self._token}:{socket.gethostname()}"}

    def __enter__(self) -> Board:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._closing = True
        self._wake_w.send(b"x")
        self._thread.join()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def statuses(self, grace: float = GRACE) -> list[int]:
        """The statuses reported, after waiting up to `grace` seconds for the rest
        (reports still in flight when mpiexec itself ended early)."""
        deadline = time.monotonic() + grace
        with self._changed:
            while self._missing():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            # a rank this launcher ended counts as failed, not as its signal: the job's
            # status is the failure's that made it end them
            return [min(r.status, 1) if rank in self.ended else r.status
                    for rank, r in self._ranks.items() if r.status is not None]

    def _missing(self) -> bool:
        return sum(r.done for r in self._ranks.values()) < self.nprocs

    def _settled(self, now: float) -> bool:
        """Whether every rank has reported, dropped, or is too late to count on."""
        if not self._missing():
            return True
        if self._first_report is None or now - self._first_report < LATE:
            return False
        return all(r.done for r in self._ranks.values())

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        pending: dict[socket.socket, bytes] = {}  # connection -> what it sent so far
        ranks: dict[socket.socket, int] = {}
        released = False
        while not self._closing:
            wait = 1.0
            if self.failed is not None and not self.ended:
                wait = min(wait, max(0.0, self.failed[2] + self.grace - time.monotonic()))
            for key, _ in sel.select(timeout=wait):
                sock = key.fileobj
                if sock is self._wake_r:
                    continue
                if sock is self._listener:
                    try:
                        conn, _ = self._listener.accept()
                    except OSError:
                        continue
                    pending[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                assert isinstance(sock, socket.socket)
                try:
                    chunk = sock.recv(256)
                except OSError:
                    chunk = b""
                lines = (pending.get(sock, b"") + chunk)
                if chunk and len(lines) <= 1024:
                    *complete, pending[sock] = lines.split(b"\n")
                    for line in complete:
                        self._take(sock, line, ranks)
                    continue
                sel.unregister(sock)  # closed, or talking nonsense
                pending.pop(sock, None)
                rank = ranks.pop(sock, None)
                with self._changed:
                    if rank is not None and self._ranks[rank].status is None:
                        self._ranks[rank].gone = True
                    self._changed.notify_all()
                if sock in self._held:
                    self._held.remove(sock)
                sock.close()
            with self._changed:
                self._end_the_rest(time.monotonic())
                if not released and self._held and self._settled(time.monotonic()):
                    released = True
                    self._warn_absent()
                if released:
                    self._release()
        for sock in list(pending):
            sel.unregister(sock)
            sock.close()
        sel.close()

    def _end_the_rest(self, now: float) -> None:
        """`grace` seconds after a rank failed: end the ranks still running."""
        if self.failed is None or self.ended or now < self.failed[2] + self.grace:
            return
        running = sorted(rank for rank, r in self._ranks.items() if not r.done)
        if not running:
            return
        self.ended.update(running)
        rank, status, _ = self.failed
        names = ", ".join(map(str, running[:10])) + (" ..." if len(running) > 10 else "")
        print(f"aaccl launch: rank {rank}'s program {how(status)}; "
              f"{'rank' if len(running) == 1 else 'ranks'} {names} still "
              f"{'runs' if len(running) == 1 else 'run'} {self.grace:g} s later: ending "
              f"{'it' if len(running) == 1 else 'them'} (SIGTERM, then SIGKILL "
              f"{KILL_AFTER:g} s later; --grace sets how long to wait)", file=sys.stderr)
        for each in running:
            try:
                self._conns[each].sendall(f"{self._token} stop {each}\n".encode())
            except (KeyError, OSError):
                pass

    def _warn_absent(self) -> None:
        absent = sorted(set(range(self.nprocs)) - set(self._ranks))
        if absent:
            shown = ", ".join(map(str, absent[:10])) + (" ..." if len(absent) > 10 else "")
            print(f"aaccl launch: rank(s) {shown} never reached the launcher (port "
                  f"{self._listener.getsockname()[1]}) within {LATE:.0f} s of the first "
                  "rank's end; the others are let go, and the job's status is left to "
                  "mpiexec's", file=sys.stderr)

    def _take(self, sock: socket.socket, line: bytes, ranks: dict[socket.socket, int]) -> None:
        message = parse(self._token, line)
        if message is None:
            return
        kind, rank, status = message
        with self._changed:
            if kind == "hello" and 0 <= rank < self.nprocs:
                ranks[sock] = rank
                self._ranks[rank] = _Rank()
                self._conns[rank] = sock
            elif kind == "status" and ranks.get(sock) == rank:
                self._ranks[rank].status = status
                self._held.append(sock)
                if self._first_report is None:
                    self._first_report = time.monotonic()
                if status and self.failed is None:
                    self.failed = (rank, status, time.monotonic())
                news = f"{self._token} ended {rank} {status}\n".encode()
                for other in ranks if status else ():
                    # the others' programs learn who ended abnormally, and how (a
                    # job's normal end costs one message per rank, not one per pair)
                    if other is not sock:
                        try:
                            other.sendall(news)
                        except OSError:
                            pass
            self._changed.notify_all()

    def _release(self) -> None:
        for sock in self._held:
            try:
                sock.sendall(GO)
            except OSError:
                pass
        self._held.clear()


def listen() -> socket.socket:
    """A socket on every address of this machine, IPv6 too where it has it."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                        backlog=socket.SOMAXCONN)
        except OSError:  # IPv6 switched off
            pass
    return socket.create_server(("", 0), backlog=socket.SOMAXCONN)


def parse(token: str, line: bytes) -> tuple[str, int, int] | None:
    """A message, `TOKEN hello RANK` or `TOKEN status RANK STATUS` (a rank's), or
    `TOKEN ended RANK STATUS` or `TOKEN stop RANK` (the launcher's), as (kind, rank,
    status); None for anything else."""
    parts = line.decode("ascii", "replace").split()
    if len(parts) < 3 or parts[0] != token or not all(p.isdigit() for p in parts[2:]):
        return None
    if parts[1] in ("hello", "stop") and len(parts) == 3:
        return parts[1], int(parts[2]), 0
    if parts[1] in ("status", "ended") and len(parts) == 4:
        return parts[1], int(parts[2]), int(parts[3]) & 0xFF
    return None


def launcher_addresses(proxy_cmdline: list[str], hostname: str) -> Iterator[str]:
    """Where to look for the launcher, best first (see the module's docstring)."""
    if "--control-port" in proxy_cmdline[:-1]:
        host, _, _ = proxy_cmdline[proxy_cmdline.index("--control-port") + 1].rpartition(":")
        if host:
            yield host.strip("[]")
    yield hostname
    yield "localhost"


def proxy_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:  # not Linux, or the proxy is gone
        return []


class Launcher:
    """A supervisor's connection to `aaccl launch` (see the module's docstring)."""

    def __init__(self, conn: socket.socket, token: str, rank: int,
                 on_ended: Callable[[int, int], None],
                 on_stop: Callable[[], None] = lambda: None) -> None:
        self._conn, self._token, self._rank = conn, token, rank
        self._on_ended, self._on_stop = on_ended, on_stop
        self._released = threading.Event()
        threading.Thread(target=self._listen, name="aaccl-launcher", daemon=True).start()

    @classmethod
    def connect(cls, rank: int, proxy: int,
                on_ended: Callable[[int, int], None] = lambda rank, status: None,
                on_stop: Callable[[], None] = lambda: None) -> Launcher | None:
        """Say hello to the launcher, if this rank runs under one and reaches it;
        `on_ended(rank, status)` runs (on a thread of its own) whenever another
        rank's program ends, and `on_stop()` when the launcher ends this rank's."""
        port, _, rest = os.environ.get(VARIABLE, "").partition(":")
        token, _, hostname = rest.partition(":")
        if not port.isdigit() or not token:
            return None
        tried: set[str] = set()
        for host in launcher_addresses(proxy_cmdline(proxy), hostname):
            if host in tried:
                continue
            tried.add(host)
            try:
                conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT)
            except OSError:
                continue
            try:
                conn.settimeout(None)
                conn.sendall(f"{token} hello {rank}\n".encode())
            except OSError:
                conn.close()
                continue
            return cls(conn, token, rank, on_ended, on_stop)
        return None

    def _listen(self) -> None:
        pending = b""
        try:
            while chunk := self._conn.recv(4096):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line + b"\n" == GO:
                        self._released.set()
                    elif (message := parse(self._token, line)) and message[0] == "ended":
                        self._on_ended(message[1], message[2])
                    elif message and message[0] == "stop" and message[1] == self._rank:
                        self._on_stop()
        except OSError:
            pass
        self._released.set()  # the launcher is gone: nobody to wait for

    def finish(self, status: int) -> None:
        """Report the program's status, then wait until the launcher lets this rank
        go (or is gone)."""
        try:
            self._conn.sendall(f"{self._token} status {self._rank} {status}\n".encode())
        except OSError:
            return
        self._released.wait()
        self._conn.close()
