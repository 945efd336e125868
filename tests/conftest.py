"""Shared fixtures: every async test runs on both event-loop backends."""

from __future__ import annotations

import numpy as np
import pytest

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def reference_inputs(rank: int, shape: int | tuple[int, ...], dtype: type,
                     seed: int = 0) -> np.ndarray:
    """Deterministic per-rank data that sums without overflow or rounding surprises."""
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(-50, 50, size=shape).astype(dtype)
