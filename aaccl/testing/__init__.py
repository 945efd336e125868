"""Testing code written on aaccl: a pytest plugin that runs a test once per rank.

```python
import numpy as np, pytest
from aaccl import ReduceFunction

@pytest.mark.aaccl(world_size=4)
async def test_sum(accl):
    buf = accl.allocate(8)
    buf[:] = accl.rank
    await accl.allreduce(buf, buf, 8, ReduceFunction.SUM)
    assert (buf == 0 + 1 + 2 + 3).all()
```

The plugin comes with aaccl (pytest's `pytest11` entry point `aaccl`; `-p no:aaccl`
turns it off) and acts on marked tests only. The body runs once per rank, as tasks
of one world in this process; under `mpiexec -n 4 python -m pytest` one rank per
process, and rank 0 reports. A rank that fails ends the others at once, and the
report shows each rank's traceback and where the others were waiting. See
docs/testing.md.
"""

from ._report import Outcome, WorldFailed

__all__ = ["Outcome", "WorldFailed"]
