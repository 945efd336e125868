"""`Buffer`: host memory (a numpy array) with a twin in the CCLO's device memory."""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

if TYPE_CHECKING:
    from ..devices import Device

_addressof, _char_at = ctypes.addressof, ctypes.c_char.from_buffer


class _Allocation:
    """One device allocation and the host array it mirrors; freed with its last view."""

    __slots__ = ("device", "owner", "address", "host_ptr", "nbytes", "__weakref__")

    def __init__(self, device: Device, owner: object, address: int, host: np.ndarray) -> None:
        self.device, self.owner, self.address = device, owner, address
        self.host_ptr, self.nbytes = host.ctypes.data, host.nbytes


class Buffer(np.ndarray):
    """A numpy array whose contents also live in one rank's device memory.

    The two copies are separate, as on an FPGA: `sync_to_device` and
    `sync_from_device` move data between them (operations do it for you unless
    `from_fpga` / `to_fpga` say the data lives on the device). Contiguous slices are
    Buffers too, at the matching device address.
    """

    _allocation: _Allocation | None
    _address: int | None

    def __array_finalize__(self, obj: Any) -> None:
        self._allocation = getattr(obj, "_allocation", None)
        self._address = None

    @property
    def device_address(self) -> int:
        """Device address of this (view's) first element."""
        at = self._address
        if at is None:
            at = self._locate()  # a view's memory never moves: looked up once
            if at is None:
                self._not_device_memory()
        return at

    def _locate(self) -> int | None:
        """This view's device address (kept in `_address`), or None if it is no
        C-contiguous view of its allocation's host array. The host pointer comes from
        a ctypes view of the buffer, C calls only (numpy's `ctypes.data` takes two
        Python calls): a fresh slice is looked up for every call it takes part in."""
        alloc = self._allocation
        if alloc is None:
            return None
        try:  # (needs a writable C-contiguous view of at least one byte)
            pointer = _addressof(_char_at(self))  # type: ignore[arg-type]  # (an ndarray)
        except (TypeError, ValueError, BufferError):  # read-only, empty or strided
            if not self.flags.c_contiguous:
                return None
            pointer = self.ctypes.data
        offset = pointer - alloc.host_ptr
        if offset < 0 or offset + self.nbytes > alloc.nbytes:
            return None
        self._address = at = alloc.address + offset
        return at

    def _not_device_memory(self) -> NoReturn:
        """Why `_locate` found no device address, as the error to raise."""
        alloc = self._allocation
        offset = -1 if alloc is None else self.ctypes.data - alloc.host_ptr
        if alloc is None or offset < 0 or offset + self.nbytes > alloc.nbytes:
            raise TypeError("this array is not a view of a device buffer (a computed result "
                            "is a new host array: copy it into a Buffer)")
        raise TypeError("device buffers must be C-contiguous: use a contiguous slice")

    def sync_to_device(self) -> None:
        """Copy these host elements to device memory."""
        address = self.device_address
        alloc = self._allocation
        assert alloc is not None
        if getattr(alloc.owner, "_released", False):
            _released(alloc)
        alloc.device.write(address, np.asarray(self))

    def sync_from_device(self) -> None:
        """Copy these elements from device memory into host memory."""
        address = self.device_address
        alloc = self._allocation
        assert alloc is not None
        if getattr(alloc.owner, "_released", False):
            _released(alloc)
        alloc.device.read(address, np.asarray(self))

    def __reduce__(self) -> Any:  # a pickled Buffer is plain host data
        return np.asarray(self).copy().__reduce__()


def _released(alloc: _Allocation) -> None:
    """A sync of a buffer whose rank closed: its device memory is gone (a card's is
    another program's by now), so nothing is copied, and the user hears why."""
    raise RuntimeError(f"this buffer's rank, {alloc.owner!r}, is closed: its device memory "
                       "is released, so the buffer can no longer be synced (its host "
                       "elements are still readable as a numpy array)")


def allocate(device: Device, owner: object, shape: int | tuple[int, ...],
             dtype: np.dtype) -> Buffer:
    host = np.zeros(shape, dtype)
    address = device.alloc(max(host.nbytes, 1))
    buf = host.view(Buffer)
    alloc = _Allocation(device, owner, address, host)
    buf._allocation = alloc
    buf._address = address
    weakref.finalize(alloc, _free, weakref.ref(device), address)
    return buf


def _free(device_ref: weakref.ref[Device], address: int) -> None:
    device = device_ref()
    if device is not None:
        try:
            device.free(address)
        except (ValueError, KeyError):  # the device was reset or closed
            pass
