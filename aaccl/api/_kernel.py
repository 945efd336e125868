"""`Kernel`: a compute kernel of one rank, whose runs are Calls in the CCLO's graphs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._buffer import Buffer

if TYPE_CHECKING:
    from ..devices import Device
    from ._accl import ACCL
    from ._call import Call


class Kernel:
    """A compute kernel bound to one rank. Calling it starts a run and returns the
    run's `Call`, which chains like a CCLO call: `kernel(a, b, waitfor=[recv])`,
    `allreduce(..., waitfor=[run])`.

    A Python callable runs on the device's worker threads (a thread of its own when
    all are busy, so a kernel that blocks holds back no other). Each `Buffer` argument
    reaches it as a numpy array of that buffer's *device* memory, where a kernel on
    the card would work: sync host data in first (`ACCL.sync_to_device`) and results
    out after. On the soft CCLO that array is the device memory itself; on ACCL's
    emulator and on cards it is a copy read before the run and written back after.
    Other arguments pass as they are. Code that releases the GIL (numpy on large
    arrays, lz4, zlib) runs in parallel with the event loop and with other kernels.

    Under `device="pynq"` a kernel of the overlay (`accl.kernel("vadd_1")`) runs on
    the card instead, started through XRT's scheduler with its arguments as PYNQ takes
    them, and chained there after the CCLO's calls.
    """

    __slots__ = ("name", "_accl", "_target", "_on_card")

    def __init__(self, accl: ACCL, target: Any, name: str, on_card: bool) -> None:
        self.name, self._accl, self._target, self._on_card = name, accl, target, on_card

    def __call__(self, *args: Any, waitfor: Iterable[Call] = (), **kwargs: Any) -> Call:
        """Start one run with these arguments once every call in `waitfor` succeeded.
        A Python kernel's return value is dropped: results go into its buffers."""
        if kwargs and self._on_card:
            raise TypeError(f"kernel {self.name} runs on the card: pass its arguments "
                            "by position, as PYNQ does")
        return self._accl._run_kernel(self, args, kwargs, waitfor)

    def __repr__(self) -> str:
        return f"<Kernel {self.name} of rank {self._accl.rank}>"

    def _start(self, device: Device, args: Sequence[Any], kwargs: dict[str, Any],
               waitfor: Sequence[Any]) -> Any:
        """The device call of one run (arguments checked by the caller)."""
        if self._on_card:
            return device.start_kernel(self._target, args, waitfor)
        return device.run(python_job(device, self._target, args, kwargs), waitfor)


def on_card(device: Device, target: Any) -> bool:
    """Whether `target` is a kernel of the card (True) or a Python callable (False)."""
    if device.is_card_kernel(target):
        return True
    if callable(target):
        return False
    raise TypeError(f"a kernel is a Python callable or, under device='pynq', a kernel of the "
                    f"overlay (such as overlay.vadd_1), not {type(target).__name__}")


def attach_stream(device: Device, target: Any, owner: object) -> None:
    """Route the soft CCLO's stream output through `target` (see ACCL.attach_stream)."""
    name = "loopback"
    if isinstance(target, Kernel):
        if target._accl is not owner:
            raise ValueError(f"kernel {target.name} belongs to another rank")
        name, target = target.name, (None if target._on_card else target._target)
        if target is None:
            raise TypeError(f"kernel {name} is the card's: on a card the CCLO's kernel "
                            "streams are wired to kernels when the bitstream is linked")
    elif target is not None:
        if not callable(target) or on_card(device, target):
            raise TypeError("a stream kernel is a Python callable, kernel(chunk, tag) -> "
                            f"array or None, or a Kernel of this rank, not {type(target).__name__}")
        name = str(getattr(target, "__name__", type(target).__name__))
    device.attach_stream(target, name)


def python_job(device: Device, fn: Callable[..., Any], args: Sequence[Any],
               kwargs: dict[str, Any]) -> Callable[[], None]:
    """The job that runs `fn(*args, **kwargs)` with Buffers seen as device memory: in
    place where the device has it in this process (`Device.array`: the soft CCLO),
    else on copies read before the run and written back after."""
    def job() -> None:
        copies: dict[int, tuple[Buffer, np.ndarray]] = {}

        def as_array(buf: Buffer) -> np.ndarray:
            view = device.array(buf.device_address, buf.dtype, buf.size)
            if view is not None:
                return view.reshape(buf.shape)
            if id(buf) not in copies:  # a buffer passed twice is one array
                copies[id(buf)] = buf, np.empty(buf.shape, buf.dtype)
                device.read(buf.device_address, copies[id(buf)][1])
            return copies[id(buf)][1]
        bound, named = _bind(args, kwargs, as_array)
        fn(*bound, **named)
        for buf, data in copies.values():
            device.write(buf.device_address, data)
    return job


def _bind(args: Sequence[Any], kwargs: dict[str, Any], as_array: Callable[[Buffer], np.ndarray],
          ) -> tuple[list[Any], dict[str, Any]]:
    def bind(value: Any) -> Any:
        return as_array(value) if isinstance(value, Buffer) else value
    return [bind(a) for a in args], {k: bind(a) for k, a in kwargs.items()}
