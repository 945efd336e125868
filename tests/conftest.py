"""Shared fixtures: every async test runs on both event-loop backends."""

from __future__ import annotations

import importlib.util
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import anyio
import numpy as np
import pytest

import aaccl

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    # Started in the background by a shell without job control (`pytest &` in a
    # script), which ignores SIGINT for it: every program the tests start would
    # inherit that, and the tests that send one Ctrl-C would see it do nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _mpich_segments_reaped() -> object:
    """The tests kill MPI ranks on purpose, and MPICH leaves the shared-memory file of
    a job whose rank died early (/dev/shm/mpich_shm_*, a few MiB each, about 40 per
    run of the suite): what the session left and nobody uses goes at its end."""
    from aaccl.cli import _shm

    before = _shm.segments()
    yield
    _shm.reap(before)


def _script_module(folder: str, name: str) -> ModuleType:
    """FOLDER/NAME.py of this repository, loaded once (the folder is no package; the
    script imports its siblings, `_common` say, from the folder, as when it runs)."""
    key = f"aaccl_{folder}_{name}"
    if key not in sys.modules:
        where = Path(__file__).resolve().parents[1] / folder
        spec = importlib.util.spec_from_file_location(key, where / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up
        sys.path.insert(0, str(where))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(where))
    return sys.modules[key]


def benchmark_module(name: str) -> ModuleType:
    """benchmarks/NAME.py, for tests that share its code with a benchmark."""
    return _script_module("benchmarks", name)


def example_module(name: str) -> ModuleType:
    """examples/NAME.py, for tests of an example's pieces."""
    return _script_module("examples", name)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def reference_inputs(rank: int, shape: int | tuple[int, ...], dtype: type,
                     seed: int = 0) -> np.ndarray:
    """Deterministic per-rank data that sums without overflow or rounding surprises."""
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(-50, 50, size=shape).astype(dtype)


async def wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> None:
    """Wait (polling) until `predicate()` holds: a real condition, not a guess of time."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.002)


def on_device(buf: aaccl.Buffer) -> np.ndarray:
    """What the device holds for `buf`, leaving the host copy alone: read from the
    device itself, so that a test can look after its rank closed (a soft CCLO keeps
    its memory; the Buffer's own syncs refuse by then)."""
    out = np.empty_like(np.asarray(buf))
    assert buf._allocation is not None
    buf._allocation.device.read(buf.device_address, out)
    return out


async def run_ranks(accls, fn) -> list:
    """Run `fn(accl)` for every rank as tasks of one task group; results in rank order."""
    results: list = [None] * len(accls)

    async def rank(accl: aaccl.ACCL) -> None:
        results[accl.rank] = await fn(accl)

    async with anyio.create_task_group() as tasks:
        for accl in accls:
            tasks.start_soon(rank, accl)
    return results
