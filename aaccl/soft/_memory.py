"""The soft CCLO's device memory: separate from host memory, addressed by integers."""

from __future__ import annotations

import bisect
import threading

import numpy as np

BASE_ADDRESS = 0x1_0000_0000  # above 4 GiB, so that both address words are exercised
ALIGNMENT = 4096


class DeviceMemory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._blocks: dict[int, np.ndarray] = {}
        self._next = BASE_ADDRESS

    def alloc(self, nbytes: int) -> int:
        with self._lock:
            address = self._next
            self._next += max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
            self._blocks[address] = np.zeros(nbytes, np.uint8)
            self._bases.append(address)  # addresses only grow: the list stays sorted
        return address

    def free(self, address: int) -> None:
        with self._lock:
            if self._blocks.pop(address, None) is None:
                raise ValueError(f"no device allocation at {address:#x}")
            # found by bisection: list.remove compared every base before it, so freeing
            # n buffers took time n**2 (20,000 outstanding calls' buffers: 70 us each)
            del self._bases[bisect.bisect_left(self._bases, address)]

    def view(self, address: int, nbytes: int) -> np.ndarray:
        """The bytes [address, address + nbytes) of one allocation; KeyError if they
        are not all inside one."""
        block = self._blocks.get(address)  # a whole buffer: no search, and no lock (the
        if block is not None and nbytes <= block.nbytes:  # dict lookup is atomic)
            return block[:nbytes]
        with self._lock:
            i = bisect.bisect_right(self._bases, address) - 1
            if i >= 0:
                base = self._bases[i]
                block = self._blocks[base]
                start = address - base
                if start + nbytes <= block.nbytes:
                    return block[start:start + nbytes]
        raise KeyError(f"[{address:#x}, +{nbytes}) is not in device memory")
