"""Several machines on this one: Linux network namespaces as the hosts of an MPI job.

Each simulated host is a network namespace with an `eth0` on a bridge (one veth pair
per host) and an address of its own; the launcher wrapper gives every process it
starts there the host's name as hostname (a UTS namespace) and, as machines have, a
/tmp of its own (a mount namespace with a fresh tmpfs: files the launching machine
writes there are not on the other hosts). The rest of the file system is shared, as
a cluster's shared home would be, and so are the directories under /tmp that hold
this Python, the working directory and PYTHONPATH (a clone checked out in /tmp).

MPICH's launcher (hydra) reaches a host through that wrapper instead of ssh, with a
hostfile naming the hosts, so it runs one proxy per host and MPICH takes every host
for a machine of its own: between hosts it sends with its network module (UCX), and
`UCX_TLS=tcp,self` keeps UCX on TCP over the bridge (left alone, UCX sees one kernel
and uses shared memory). Ranks of one host talk through MPICH's shared memory, as on
a real machine.

Links can be shaped: a rate limit (tc tbf, both directions of each host's link) and
a delay added to every packet a host sends (tc netem, where the kernel has it;
without netem the delay is left out and `Cluster.notes` says why).

    with Cluster(hosts=2, slots=2, network=Network(rate="1gbit")) as cluster:
        subprocess.run(["aaccl", "launch", "-n", "4", "--hostfile", str(cluster.hostfile),
                        "app.py"], env={**os.environ, **cluster.env})
        print(cluster.traffic())  # bytes each host sent and received over its link

As a script, it runs one command on a fresh cluster (`{hostfile}` in it is replaced):

    python benchmarks/_netns.py --hosts 2 --slots 2 --rate 1gbit -- \\
        aaccl launch -n 4 --hostfile {hostfile} -m aaccl bench

Needs Linux, root, iproute2 (`ip`, `tc`) and util-linux's `unshare`: `unavailable()`
says what is missing. Every cluster has names of its own (parallel runs do not clash)
and is torn down on exit, failure included; one whose creator died without tearing it
down (SIGKILL) is removed by the next cluster made on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import ipaddress
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STATE = Path("/run/aaccl-netns")
"""One file per live cluster: who made it and what to remove once its maker is gone."""
PREFIX = "aa"
NIC = "eth0"  # every host's interface: one name for UCX_NET_DEVICES on every host
SUBNETS = ipaddress.ip_network("10.200.0.0/13")  # a /24 per cluster is picked from here
RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)bit", re.IGNORECASE)
DELAY = re.compile(r"\d+(?:\.\d+)?(us|ms|s)")


class Unavailable(RuntimeError):
    """Simulated hosts cannot be made here; the message says which step failed."""


# -- pure logic -------------------------------------------------------------------------


def parse_rate(rate: str) -> float:
    """Bits per second of a tc rate such as "1gbit", "100mbit" or "512kbit"."""
    found = RATE.fullmatch(rate.strip())
    if found is None:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit, gbit or tbit "
                         "(tc's units), e.g. 1gbit")
    value, unit = float(found[1]), found[2].lower()
    if value <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return value * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[unit]


def tbf_burst(rate: str) -> int:
    """Bytes a tbf bucket holds: a millisecond of the rate (the kernel refills it at
    timer ticks), and never less than a 64 KiB segment (veth hands TCP segments over
    unsplit)."""
    return max(64 << 10, int(parse_rate(rate) / 8 / 1000))


@dataclass(frozen=True)
class Network:
    """How each host's link is shaped: `rate` (tc units, "1gbit"), limited in both
    directions; `delay` ("50us", "1ms") added to every packet a host sends, so the
    one-way latency between two hosts grows by `delay` and the round trip by twice."""

    rate: str | None = None
    delay: str | None = None

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate)
        if self.delay is not None and not DELAY.fullmatch(self.delay):
            raise ValueError(f"delay {self.delay!r}: expected a number and us, ms or s "
                             "(tc's units), e.g. 50us")

    def describe(self) -> str:
        return ", ".join(filter(None, [self.rate and f"{self.rate} links",
                                       self.delay and f"+{self.delay} per packet sent"])) \
            or "unshaped links"


def shaping_commands(dev: str, network: Network, netem: bool) -> list[list[str]]:
    """tc commands (without `ip netns exec`) that shape the egress of `dev`: with
    `netem`, one netem qdisc for the delay and the rate; else tbf for the rate alone."""
    base = ["tc", "qdisc", "replace", "dev", dev, "root"]
    if netem and network.delay:
        rate = ["rate", network.rate] if network.rate else []
        return [[*base, "netem", "delay", network.delay, *rate, "limit", "100000"]]
    if network.rate:
        return [[*base, "tbf", "rate", network.rate, "burst", str(tbf_burst(network.rate)),
                 "latency", "100ms"]]
    return []


def shared_under_tmp() -> list[str]:
    """The directories under /tmp every host must see, as a cluster's shared file
    system would hold them: this Python's installation, the working directory and
    PYTHONPATH (a clone checked out in /tmp, say)."""
    paths = [sys.prefix, os.getcwd(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    under = {os.path.realpath(p) for p in paths if p}
    under = {p for p in under if p.startswith("/tmp/")}
    return sorted(p for p in under if not any(p.startswith(q + "/") for q in under))


def wrapper_script(hosts: dict[str, str], private_tmp: bool = True,
                   shared: Sequence[str] = ()) -> str:
    """The stand-in for ssh that hydra runs as `WRAPPER [-x ...] HOST COMMAND...`: it
    runs COMMAND with a shell (as sshd would) in HOST's namespace, with HOST's
    hostname and (`private_tmp`) a /tmp of the host's own, in which the `shared`
    directories are the launching machine's. `hosts` maps each name hydra may use
    (host name, address) to a namespace."""
    mount = "--mount " if private_tmp else ""
    # the shared directories wait under /mnt while a fresh /tmp covers the old one
    tmp = ('mount -t tmpfs tmpfs /mnt && i=0 && for p in "$@"; do i=$((i+1)); '
           'mkdir /mnt/$i && mount --bind "$p" /mnt/$i || exit 255; done && '
           'mount -t tmpfs -o mode=1777 tmpfs /tmp && i=0 && for p in "$@"; do i=$((i+1)); '
           'mkdir -p "$p" && mount --move /mnt/$i "$p" || exit 255; done && '
           if private_tmp else "")
    keep = " ".join(shlex.quote(p) for p in shared) if private_tmp else ""
    cases = "\n".join(f"    {shlex.quote(name)}) ns={shlex.quote(ns)} ;;"
                      for name, ns in hosts.items())
    return f"""#!/bin/sh
# written by aaccl's benchmarks/_netns.py: ssh to a simulated host
while [ $# -gt 0 ]; do
    case "$1" in -*) shift ;; *) break ;; esac
done
[ $# -ge 2 ] || {{ echo "usage: $0 [ssh options] HOST COMMAND..." >&2; exit 255; }}
host=$1
shift
case "$host" in
{cases}
    *) echo "$0: no simulated host named $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts {mount}sh -c 'cmd=$1; shift; {tmp}hostname "$0" && exec sh -c "$cmd"' "$ns" "$*" {keep}
"""


def hostfile_text(names: list[str], slots: int) -> str:
    return "".join(f"{name}:{slots}\n" for name in names)


# -- the machine ---------------------------------------------------------------------------


def _run(cmd: list[str], netns: str | None = None) -> subprocess.CompletedProcess[str]:
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=30, check=False)


def _must(cmd: list[str], netns: str | None = None) -> None:
    done = _run(cmd, netns)
    if done.returncode != 0:
        where = f" (in namespace {netns})" if netns else ""
        raise Unavailable(f"`{shlex.join(cmd)}`{where} failed: "
                          f"{(done.stderr or done.stdout).strip() or done.returncode}")


@functools.cache
def unavailable() -> str | None:
    """Why simulated hosts cannot be made here (None: they can)."""
    if not sys.platform.startswith("linux"):
        return f"simulated hosts need Linux network namespaces, not {sys.platform}"
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth pairs, a bridge)"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"simulated hosts need {' and '.join(missing)} (iproute2, util-linux)"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _must(["ip", "netns", "add", probe])
        _must(["unshare", "--uts", "true"], netns=probe)
    except Unavailable as exc:
        return str(exc)
    finally:
        _run(["ip", "netns", "delete", probe])
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _empty_namespace(netns: str) -> None:
    """SIGKILL what still runs in `netns` (a job's processes): a namespace outlives
    its name while anything runs in it."""
    for pid in _run(["ip", "netns", "pids", netns]).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove(namespaces: list[str], bridge: str) -> None:
    """Remove a cluster's namespaces (their veth pairs go with them) and its bridge;
    what is already gone is fine."""
    for netns in namespaces:
        _empty_namespace(netns)
        _run(["ip", "netns", "delete", netns])
    _run(["ip", "link", "delete", bridge])


def sweep_orphans() -> list[str]:
    """Remove the clusters whose makers have died; the bridges removed."""
    removed = []
    for path in STATE.glob("*.json") if STATE.is_dir() else []:
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(state["pid"])):
            continue
        _remove(list(state["namespaces"]), str(state["bridge"]))
        path.unlink(missing_ok=True)
        removed.append(str(state["bridge"]))
    return removed


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """One cluster at a time picks its subnet and claims it (runs in parallel would
    otherwise pick the same one now and then)."""
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    """A /24 no address or route of this machine's own namespace touches."""
    used = [ipaddress.ip_network(word, strict=False)
            for line in _run(["ip", "-4", "-o", "addr", "show"]).stdout.splitlines()
            + _run(["ip", "-4", "route", "show"]).stdout.splitlines()
            for word in line.split() if re.fullmatch(r"\d+\.\d+\.\d+\.\d+(/\d+)?", word)]
    candidates = list(SUBNETS.subnets(new_prefix=24))
    for _ in range(100):
        net = rng.choice(candidates)
        if not any(net.overlaps(other) for other in used):
            return net
    raise Unavailable(f"no free /24 in {SUBNETS} for the simulated hosts")


@dataclass
class Host:
    name: str  # hostname, namespace and hostfile entry
    address: str
    link: str  # the veth end on the bridge, in this machine's own namespace


@dataclass
class Cluster:
    """`hosts` simulated machines of `slots` ranks each, for as long as the `with`
    block lasts (see the module's docstring)."""

    hosts: int = 2
    slots: int = 1
    network: Network = field(default_factory=Network)
    private_tmp: bool = True
    members: list[Host] = field(default_factory=list, init=False)
    notes: list[str] = field(default_factory=list, init=False)
    shaped: Network = field(default_factory=Network, init=False)
    """The shaping in effect: `network` without what the kernel could not do."""
    bridge: str = field(default="", init=False)
    hostfile: Path = field(default=Path(), init=False)
    wrapper: Path = field(default=Path(), init=False)
    _namespaces: list[str] = field(default_factory=list, init=False, repr=False)
    _dir: Path | None = field(default=None, init=False, repr=False)
    _state: Path | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise ValueError(f"hosts={self.hosts}: between 1 and 200")
        if self.slots < 1:
            raise ValueError(f"slots={self.slots}: at least 1")

    @property
    def size(self) -> int:
        """Ranks the hostfile holds."""
        return self.hosts * self.slots

    @property
    def env(self) -> dict[str, str]:
        """What mpiexec (and the ranks, which inherit it) needs: hydra's launcher
        settings and UCX on TCP between hosts."""
        return {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(self.wrapper),
                # hydra's proxies reach mpiexec at this machine's address on the bridge
                "HYDRA_IFACE": self.bridge,
                "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": NIC}

    def __enter__(self) -> Cluster:  # noqa: PYI034 - not meant to be subclassed
        why = unavailable()
        if why is not None:
            raise Unavailable(why)
        sweep_orphans()
        try:
            self._create()
        except BaseException:
            self._destroy()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._destroy()

    def traffic(self) -> dict[str, tuple[int, int]]:
        """host -> (bytes it sent, bytes it received) over its link since it was made."""
        def counter(link: str, name: str) -> int:
            return int(Path(f"/sys/class/net/{link}/statistics/{name}").read_text())

        # the bridge's end of a host's link receives what the host sends
        return {h.name: (counter(h.link, "rx_bytes"), counter(h.link, "tx_bytes"))
                for h in self.members}

    def describe(self) -> str:
        return (f"{self.hosts} simulated host{'s' * (self.hosts > 1)} x {self.slots} "
                f"rank{'s' * (self.slots > 1)} ({', '.join(h.name for h in self.members)}; "
                f"{self.shaped.describe()}"
                f"{'; delay left out' if self.shaped.delay != self.network.delay else ''})")

    # -- making and removing ---------------------------------------------------------------

    def _names(self) -> tuple[str, list[str]]:
        """A token no existing link or namespace uses: bridge and namespace names."""
        taken = _run(["ip", "-o", "link", "show"]).stdout + _run(["ip", "netns", "list"]).stdout
        rng = random.Random()
        for _ in range(100):
            token = f"{rng.randrange(16 ** 6):06x}"
            if f"{PREFIX}{token}" not in taken:
                return f"{PREFIX}{token}br", [f"{PREFIX}{token}h{i + 1}" for i in range(self.hosts)]
        raise Unavailable("no unused name for the simulated hosts")

    def _create(self) -> None:
        self.bridge, self._namespaces = self._names()
        names = self._namespaces
        self._dir = Path(tempfile.mkdtemp(prefix=f"{self.bridge}-"))
        STATE.mkdir(parents=True, exist_ok=True)
        self._state = STATE / f"{self.bridge}.json"
        self._state.write_text(json.dumps({"pid": os.getpid(), "bridge": self.bridge,
                                           "namespaces": names}))
        with _machine_lock():
            net = _free_subnet(random.Random())
            addresses = list(net.hosts())
            _must(["ip", "link", "add", self.bridge, "type", "bridge"])
            _must(["ip", "addr", "add", f"{addresses[0]}/{net.prefixlen}", "dev", self.bridge])
        _must(["ip", "link", "set", self.bridge, "up"])
        for i, name in enumerate(names):
            host = Host(name, str(addresses[i + 1]), f"{self.bridge[:-2]}v{i + 1}")
            _must(["ip", "netns", "add", name])
            self.members.append(host)
            _must(["ip", "link", "add", host.link, "type", "veth", "peer", "name", NIC,
                   "netns", name])
            _must(["ip", "link", "set", host.link, "master", self.bridge, "up"])
            _must(["ip", "addr", "add", f"{host.address}/{net.prefixlen}", "dev", NIC], name)
            _must(["ip", "link", "set", NIC, "up"], name)
            _must(["ip", "link", "set", "lo", "up"], name)
        self._shape()
        self.wrapper = self._dir / "ssh"
        self.wrapper.write_text(wrapper_script(
            {**{h.name: h.name for h in self.members},
             **{h.address: h.name for h in self.members}}, self.private_tmp,
            shared_under_tmp()))
        self.wrapper.chmod(0o755)
        self.hostfile = self._dir / "hosts"
        self.hostfile.write_text(hostfile_text([h.name for h in self.members], self.slots))

    def _shape(self) -> None:
        """Shape both directions of every link; netem if the kernel has it (tried once),
        else the rate alone, with a note saying what failed."""
        netem = bool(self.network.delay)
        if netem:
            first = self.members[0].name
            cmd = shaping_commands(NIC, self.network, netem=True)[0]
            done = _run(cmd, first)
            if done.returncode != 0:
                netem = False
                why = (done.stderr or done.stdout).strip()
                missing = " (this kernel has no sch_netem)" if "unknown" in why else ""
                self.notes.append(f"no delay added: `{shlex.join(cmd)}` failed: {why}"
                                  f"{missing}: the links carry no delay")
        self.shaped = self.network if netem or not self.network.delay \
            else Network(rate=self.network.rate)
        for host in self.members:
            # what a host sends (its eth0) and what it receives (the bridge's end)
            for cmd in shaping_commands(NIC, self.network, netem):
                _must(cmd, host.name)
            back = Network(rate=self.network.rate)  # the delay once per packet
            for cmd in shaping_commands(host.link, back, netem=False):
                _must(cmd)

    def _destroy(self) -> None:
        if self.bridge:
            _remove(self._namespaces, self.bridge)
        if self._state is not None:
            self._state.unlink(missing_ok=True)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self.members = []


# -- command line ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a command with a hostfile of simulated hosts (network namespaces)",
        epilog="{hostfile} in the command is replaced by the hostfile's path; the command "
               "gets the environment hydra and UCX need (HYDRA_LAUNCHER_EXEC, ...).")
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    parser.add_argument("--slots", type=int, default=1, help="ranks per host (default 1)")
    parser.add_argument("--rate", help="rate limit of every link, e.g. 1gbit")
    parser.add_argument("--delay", help="delay added to every packet a host sends, e.g. 50us")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    try:
        with Cluster(args.hosts, args.slots, Network(args.rate, args.delay)) as cluster:
            print(f"{cluster.describe()}; hostfile {cluster.hostfile}", file=sys.stderr)
            for note in cluster.notes:
                print(f"note: {note}", file=sys.stderr)
            filled = [word.replace("{hostfile}", str(cluster.hostfile)) for word in command]
            status = subprocess.run(filled, env={**os.environ, **cluster.env},
                                    check=False).returncode
            for name, (sent, received) in cluster.traffic().items():
                print(f"{name}: sent {sent} B, received {received} B over its link",
                      file=sys.stderr)
    except Unavailable as exc:
        print(f"cannot simulate hosts: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
