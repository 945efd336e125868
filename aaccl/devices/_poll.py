"""Waiting for a device by polling, without holding up other threads for long.

The emulator answers completion polls over ZMQ, and pyxrt's blocking wait holds
the GIL: both devices poll from their own thread instead, sleeping 20 us at first
and twice as long each time up to 2 ms, so short calls are seen at once and long
ones cost little CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
FIRST_SLEEP, LONGEST_SLEEP = 20e-6, 2e-3


def poll(check: Callable[[], T | None], deadline: float) -> T | None:
    """`check()`'s first result that is not None, or None once `deadline` (a
    time.monotonic() value) has passed."""
    delay = 0.0
    while (result := check()) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(delay)
        delay = min(2 * delay or FIRST_SLEEP, LONGEST_SLEEP)
    return result
