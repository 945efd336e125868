"""pyaccl 0.2's blocking API on aaccl: existing ACCL notebooks and scripts run with
`from pyaccl import accl` changed to `from aaccl.compat import accl`.

See docs/migrating.md for the differences (errors raise instead of passing
silently; `sim_mode=True` is aaccl's soft CCLO, whose ranks are instances of one
process, or one per process under mpiexec) and how to move to the async API.
"""

from .._constants import GLOBAL_COMM, TAG_ANY
from ._accl import Handle, accl
from ._tables import (
    ACCL_DEFAULT_ARITH_CONFIG,
    ACCLArithConfig,
    ACCLCommunicator,
    ACCLCompressionFlags,
    ACCLReduceFunctions,
    ACCLStreamFlags,
    CCLOp,
    ErrorCode,
)

__all__ = ["ACCLArithConfig", "ACCLCommunicator", "ACCLCompressionFlags", "ACCLReduceFunctions",
           "ACCLStreamFlags", "ACCL_DEFAULT_ARITH_CONFIG", "CCLOp", "ErrorCode", "GLOBAL_COMM",
           "Handle", "TAG_ANY", "accl"]
