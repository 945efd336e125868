"""A long mixed run that watches memory, threads and file descriptors.

    python benchmarks/soak.py --seconds 180                    # 3 in-process ranks
    aaccl launch -n 3 benchmarks/soak.py --seconds 180         # one rank per process
    python benchmarks/soak.py --seconds 20 --check             # exit 1 if anything grew

Every round, every rank runs a mix that touches each record a call or message can
leave behind: a ring of sends and receives with specific tags and TAG_ANY on either
side, small and larger than an rx buffer; small and 256 KiB allreduces; a bcast on
a sub-communicator; a collective that one rank rejects (bad count), which aborts the
others' calls of it; and a receive whose await is cancelled then awaited again.
Each round's results are checked against numpy, so a leak fix that loses messages
fails here too.

After a warm-up (a fifth of the run, at least 5 s), the process's RSS, thread count
and open file descriptors are sampled every `--every` seconds; the verdict compares
the last sample with the first one after warm-up. Under `aaccl launch`, every rank
reports its own process; in process, the one process holds every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import anyio
import numpy as np

import aaccl
from aaccl import TAG_ANY, ReduceFunction

MiB = 1 << 20
SMALL, LARGE = 16, 4096  # float32 elements: 64 B, and 16 KiB (16 rx buffers of 1 KiB)
BIG_ALLREDUCE = 64 * 1024  # 256 KiB of float32


def rss() -> int:
    """This process's resident set size, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def sample() -> tuple[float, int, int, int]:
    return time.monotonic(), rss(), threading.active_count(), fds()


async def one_round(accl: aaccl.ACCL, n: int, bufs: dict[str, aaccl.Buffer],
                    sub: int | None) -> None:
    rank, size = accl.rank, accl.size
    right, left = (rank + 1) % size, (rank - 1) % size

    # a ring of point-to-point messages: specific tags, TAG_ANY on the receiving side
    for count in (SMALL, LARGE):
        src, dst = bufs[f"src{count}"], bufs[f"dst{count}"]
        src[:] = rank * 1000 + n % 997
        tags = (n % 5, TAG_ANY if n % 3 == 0 else n % 5)
        send = accl.send(src, count, right, tag=tags[0])
        await accl.recv(dst, count, left, tag=tags[1])
        await send
        assert dst[0] == left * 1000 + n % 997 and dst[-1] == dst[0], (n, dst[0])

    # allreduces, small and large
    for count in (SMALL, BIG_ALLREDUCE):
        src, dst = bufs[f"ar{count}"], bufs[f"ard{count}"]
        src[:] = rank + 1
        await accl.allreduce(src, dst, count, ReduceFunction.SUM)
        assert dst[0] == size * (size + 1) // 2 and dst[-1] == dst[0]

    # a bcast on a sub-communicator (the ranks but the last)
    if sub is not None:
        buf = bufs[f"src{SMALL}"]
        buf[:] = n if rank == 0 else -1
        await accl.bcast(buf, SMALL, root=0, comm_id=sub)
        assert buf[0] == n

    # a collective rank 0 rejects: the others' calls of it are aborted
    buf = bufs[f"dst{SMALL}"]
    if rank == 0:
        try:
            accl.bcast(buf, SMALL + 1_000_000, root=0)
        except ValueError:
            pass
        else:
            raise AssertionError("a bcast past its buffer was not rejected")
    elif size > 1:
        try:
            await accl.bcast(buf, SMALL, root=0)
        except aaccl.Aborted:
            pass
        else:
            raise AssertionError("a bcast that rank 0 rejected did not abort")

    # an await cancelled, then awaited again (its receive stays posted)
    if size > 1:
        dst = bufs[f"dst{SMALL}"]
        recv = accl.recv(dst, SMALL, left, tag=7)
        with anyio.move_on_after(0):
            await recv
        await accl.send(bufs[f"src{SMALL}"], SMALL, right, tag=7)
        await recv


async def soak(accl: aaccl.ACCL, seconds: float, every: float) -> dict:
    size = accl.size
    bufs = {}
    for count in (SMALL, LARGE):
        bufs[f"src{count}"] = accl.allocate(count, np.float32)
        bufs[f"dst{count}"] = accl.allocate(count, np.float32)
    for count in (SMALL, BIG_ALLREDUCE):
        bufs[f"ar{count}"] = accl.allocate(count, np.float32)
        bufs[f"ard{count}"] = accl.allocate(count, np.float32)
    members = list(range(size - 1))  # only members split a communicator
    sub = accl.split_communicator(members) if size > 2 and accl.rank in members else None

    start = time.monotonic()
    warm = start + max(5.0, seconds / 5)
    samples: list[tuple[float, int, int, int]] = []
    n = 0
    while True:
        await one_round(accl, n, bufs, sub)
        n += 1
        now = time.monotonic()
        # every rank decides to stop from rank 0's clock, so all run the same rounds
        flag = bufs["ar16"]
        flag[:] = 1.0 if (accl.rank == 0 and now - start >= seconds) else 0.0
        await accl.allreduce(flag, bufs["ard16"], SMALL, ReduceFunction.MAX)
        if now >= warm and (not samples or now - samples[-1][0] >= every):
            samples.append(sample())
        if bufs["ard16"][0] > 0:
            break
    samples.append(sample())
    return {"rank": accl.rank, "pid": os.getpid(), "rounds": n, "samples": samples,
            "start": start}


def growth(samples: list[tuple[float, int, int, int]]) -> tuple[float, int, int]:
    (_, r0, t0, f0), (_, r1, t1, f1) = samples[0], samples[-1]
    return (r1 - r0) / MiB, t1 - t0, f1 - f0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("-n", "--ranks", type=int, default=3, help="in-process ranks")
    parser.add_argument("--max-growth-mib", type=float, default=20.0,
                        help="RSS growth after warm-up that --check still accepts")
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 if RSS, threads or fds grew")
    args = parser.parse_args()

    results = aaccl.run(lambda accl: soak(accl, args.seconds, args.every),
                        world_size=args.ranks)
    # every rank of this process took the same samples: report the process once
    # (under mpiexec every process gets every rank's results, and reports its own)
    result = next(r for r in results if r["pid"] == os.getpid())
    under_mpi = len({r["pid"] for r in results}) > 1
    who = f"rank {result['rank']}" if under_mpi else f"{len(results)} in-process ranks"
    print(f"{who} (pid {os.getpid()}): {result['rounds']} rounds")
    print(f"  {'t (s)':>7} {'RSS (MiB)':>10} {'threads':>8} {'fds':>5}")
    for t, r, threads, files in result["samples"]:
        print(f"  {t - result['start']:7.1f} {r / MiB:10.1f} {threads:8d} {files:5d}")
    mib, threads, files = growth(result["samples"])
    ok = mib <= args.max_growth_mib and threads <= 0 and files <= 0
    print(f"  after warm-up: RSS {mib:+.1f} MiB, threads {threads:+d}, fds {files:+d}: "
          f"{'flat' if ok else 'GREW'}")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
