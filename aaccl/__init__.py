"""aaccl: async/await collective communication for ACCL.

Every primitive and collective is an awaitable `Call`; calls chain through
`waitfor=[...]` into dependency graphs the device schedules. Runs on the embedded
software CCLO with no FPGA.
"""

from ._constants import (
    GLOBAL_COMM,
    TAG_ANY,
    CompressionFlags,
    ErrorCode,
    ReduceFunction,
    StreamFlags,
)
from ._errors import (Aborted, ACCLError, CCLOError, DependencyError, DeviceError, DeviceStuck,
                      KernelError, RankErrors)
from ._trace import Trace, tracing
from .api import (ACCL, Buffer, Call, Kernel, mpi_launched, open_world, process_count,
                  process_rank, run)

__version__ = "0.1.0"

__all__ = [
    "ACCL", "ACCLError", "Aborted", "Buffer", "CCLOError", "Call", "CompressionFlags", "DependencyError",
    "DeviceError", "DeviceStuck", "ErrorCode", "GLOBAL_COMM", "Kernel", "KernelError",
    "RankErrors", "ReduceFunction", "StreamFlags", "TAG_ANY", "mpi_launched", "open_world",
    "process_count", "process_rank", "run", "Trace", "tracing",
]
