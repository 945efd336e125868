"""The public API: ACCL, Buffer, Call, and worlds of ranks."""

from ._accl import ACCL
from ._buffer import Buffer
from ._call import Call
from ._kernel import Kernel
from ._world import mpi_launched, open_world, process_count, process_rank, run

__all__ = ["ACCL", "Buffer", "Call", "Kernel", "mpi_launched", "open_world", "process_count",
           "process_rank", "run"]
