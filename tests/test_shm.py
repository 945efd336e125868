"""MPICH's shared-memory segments that a job whose ranks died leaves behind go with
the job (`aaccl launch`) or the test session: only those nobody uses."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

from aaccl.cli import _shm
from test_mpi_fabric import MPIEXEC


def test_reap_removes_what_appeared_since_and_nobody_uses(tmp_path: Path) -> None:
    (tmp_path / "mpich_shm_old").write_bytes(b"x")  # there before: not ours to judge
    before = _shm.segments(tmp_path)
    (tmp_path / "mpich_shm_stale").write_bytes(b"x" * 4096)
    (tmp_path / "mpich_shm_open").write_bytes(b"x" * 4096)
    (tmp_path / "mpich_shm_mapped").write_bytes(b"x" * 4096)
    (tmp_path / "other").write_bytes(b"x")
    opened = open(tmp_path / "mpich_shm_open", "rb")
    with open(tmp_path / "mpich_shm_mapped", "r+b") as file:
        mapped = mmap.mmap(file.fileno(), 4096)
    try:
        assert _shm.reap(before, tmp_path) == 1
        assert sorted(os.listdir(tmp_path)) == ["mpich_shm_mapped", "mpich_shm_old",
                                                "mpich_shm_open", "other"]
    finally:
        mapped.close()
        opened.close()
    assert _shm.reap(before, tmp_path) == 2  # no longer in use


def test_reap_without_a_shm_folder_does_nothing(tmp_path: Path) -> None:
    assert _shm.segments(tmp_path / "none") == set()
    assert _shm.reap(set(), tmp_path / "none") == 0


@pytest.mark.skipif(MPIEXEC is None or not os.path.isdir("/dev/shm"),
                    reason="no mpiexec, or no /dev/shm")
def test_a_job_whose_rank_is_killed_leaves_no_segment_behind(tmp_path: Path) -> None:
    """A rank SIGKILLed in the middle of a job under `aaccl launch`: whatever MPICH
    leaves under /dev/shm goes with the job."""
    from test_mpi_faults import WORKER, assert_contained, run_trial

    worker = tmp_path / "allreduce_until_killed.py"
    worker.write_text(WORKER)
    for seed in range(3):
        before = _shm.segments()
        trial = run_trial(worker, "aaccl", 3, "KILL", random.Random(seed))
        assert_contained(trial)
        left = (_shm.segments() - before) - _shm.in_use()
        assert not left, f"left behind: {sorted(left)}{trial.explain()}"
