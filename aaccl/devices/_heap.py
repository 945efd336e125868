"""Address bookkeeping for device memory that aaccl manages itself (pure logic).

ACCL's emulator exposes one flat device memory that grows when written; the host
decides where buffers go. First fit over a sorted free list keeps freed space
reusable, so long-running programs do not grow the emulator's memory forever.
"""

from __future__ import annotations

import bisect
import threading

ALIGNMENT = 4096  # a page, as XRT aligns buffer objects


class Heap:
    """Hands out aligned, non-overlapping ranges of [base, base + size)."""

    def __init__(self, base: int = ALIGNMENT, size: int = 1 << 40,
                 alignment: int = ALIGNMENT) -> None:
        if base % alignment:
            raise ValueError("base must be aligned")
        self.alignment = alignment
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(base, size)]  # (start, length), sorted
        self._used: dict[int, int] = {}  # start -> length

    def alloc(self, nbytes: int) -> int:
        length = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        with self._lock:
            for i, (start, free) in enumerate(self._free):
                if free >= length:
                    if free == length:
                        del self._free[i]
                    else:
                        self._free[i] = (start + length, free - length)
                    self._used[start] = length
                    return start
        raise MemoryError(f"no room for {nbytes} bytes of device memory")

    def free(self, address: int) -> None:
        with self._lock:
            length = self._used.pop(address, None)
            if length is None:
                raise ValueError(f"no device allocation at {address:#x}")
            i = bisect.bisect(self._free, (address, 0))
            if i < len(self._free) and address + length == self._free[i][0]:
                length += self._free.pop(i)[1]  # merge with the range after
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == address:
                address, length = self._free[i - 1][0], self._free[i - 1][1] + length
                i -= 1
                del self._free[i]
            self._free.insert(i, (address, length))

    def size_of(self, address: int) -> int:
        """The usable length of the allocation at `address` (KeyError if none)."""
        with self._lock:
            return self._used[address]

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(self._used.values())
