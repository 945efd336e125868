"""What a small collective over MPI is made of (issue 28): one object in the lane
(`Op`: its place, the wait for its opening and its call's part in the collective),
no body (it parks on its opening, which settles it), and one engine event beside its
admission's (its opening's end, which ends the call). tests/mpi/budget.py counts them."""

from __future__ import annotations

import pytest
from test_mpi_fabric import MPIEXEC, assert_passed, launch


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install 'aaccl[mpi]')")
def test_a_small_allreduce_over_mpi_is_one_op_one_event_and_no_body() -> None:
    job = launch(2, "budget.py", "pieces", limit=120)
    assert_passed(job, 2)
    counts = [{key: float(value) for key, value in (word.split("=") for word in line.split()[2:])}
              for line in job.stdout.splitlines() if line.startswith("budget ")]
    assert len(counts) == 2, job.explain()
    for count in counts:
        assert count["ops"] == 1, count
        assert count["bodies"] == 0, count
        assert count["posts"] <= 2, count  # its admission's, and its opening's end
