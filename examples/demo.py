"""aaccl's demo: four ranks as tasks in one event loop, on the embedded soft CCLO.

    python examples/demo.py [--ranks N] [--backend asyncio|trio]
    aaccl launch -n 4 examples/demo.py         # one rank per process (pip install aaccl[mpi])

Each rank runs `main` below. Every operation returns a Call; awaiting it waits for
the CCLO. Chained calls (`waitfor=[...]`) run as one dependency graph on the device.
"""

from __future__ import annotations

import argparse

import numpy as np

import aaccl
from aaccl import ReduceFunction


async def main(accl: aaccl.ACCL) -> list[str]:
    rank, size = accl.rank, accl.size
    said: list[str] = []
    src = accl.allocate(8, np.float32)
    dst = accl.allocate(8, np.float32)

    # 1. allreduce: every rank contributes rank+1 everywhere.
    src[:] = rank + 1
    await accl.allreduce(src, dst, 8, ReduceFunction.SUM)
    said.append(f"allreduce SUM of {rank + 1} from each rank -> {dst[0]:g}")

    # 2. a chain on the device, one await: allreduce MAX, then broadcast from the last rank.
    src[:] = np.arange(8) * (rank + 1)
    first = accl.allreduce(src, dst, 8, ReduceFunction.MAX, to_fpga=True)
    await accl.bcast(dst, 8, root=size - 1, from_fpga=True, waitfor=[first])
    said.append(f"allreduce MAX -> bcast chain gives {dst[:4].tolist()}...")

    # 3. scatter from rank 0, square locally, gather back on rank 0.
    table = accl.allocate(2 * size, np.int64)
    mine = accl.allocate(2, np.int64)
    if rank == 0:
        table[:] = np.arange(2 * size)
    await accl.scatter(table, mine, 2, root=0)
    mine[:] = mine ** 2
    await accl.gather(mine, table, 2, root=0)
    if rank == 0:
        said.append(f"scatter -> square -> gather: {table.tolist()}")

    # 4. point to point around a ring, with half precision on the wire.
    token = accl.allocate(4, np.float32)
    inbox = accl.allocate(4, np.float32)
    token[:] = rank + 0.1
    sent = accl.send(token, 4, (rank + 1) % size, tag=7, compress_dtype=np.float16)
    await accl.recv(inbox, 4, (rank - 1) % size, tag=7, compress_dtype=np.float16)
    await sent
    said.append(f"ring: got {inbox[0]:.4f} from rank {(rank - 1) % size} (float16 on the wire)")

    await accl.barrier()
    return said


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks in this process (default 4; under mpiexec: the job's size)")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    ranks = args.ranks if args.ranks or aaccl.mpi_launched() else 4
    results = aaccl.run(main, world_size=ranks, backend=args.backend)
    if aaccl.process_rank() != 0:
        return  # under MPI every process has every rank's results: one prints them
    where = "one process per rank (MPI)" if aaccl.mpi_launched() else "in this process"
    print(f"aaccl {aaccl.__version__}: {len(results)} ranks on the soft CCLO, {where} "
          f"({args.backend})")
    for rank, lines in enumerate(results):
        for line in lines:
            print(f"  rank {rank}: {line}")


if __name__ == "__main__":
    cli()
