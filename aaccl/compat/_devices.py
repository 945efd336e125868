"""The device behind each pyaccl-style instance: the soft CCLO, ACCL's emulator, or
a card. Soft ranks made one at a time in a process meet in shared worlds."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from .. import _exchmem as xm
from ..devices import Device
from ..soft import InProcessFabric, SoftDevice


class _SoftWorld:
    """The fabric of `size` soft ranks, filled as instances of this size are made."""

    def __init__(self, size: int) -> None:
        self.fabric = InProcessFabric(size)
        self.taken = [False] * size


_worlds: dict[int, list[_SoftWorld]] = {}
_worlds_lock = threading.Lock()


def soft_device(size: int, rank: int) -> SoftDevice:
    """Rank `rank` of the oldest world of `size` ranks where it is still free (a new
    world if none is): `accl(4, i, sim_mode=True)` for i in 0..3 makes one world, and
    running that again makes the next. A rank's place is never reused after deinit:
    its peers may still hold messages for it."""
    with _worlds_lock:
        worlds = _worlds.setdefault(size, [])
        world = next((w for w in worlds if not w.taken[rank]), None)
        if world is None:
            world = _SoftWorld(size)
            worlds.append(world)
        world.taken[rank] = True
        if all(world.taken):
            worlds.remove(world)  # complete: later instances start the next world
    return SoftDevice(rank, world.fabric.port(rank))


def emulator_device(sim_sock: str, rank: int, protocol: str) -> Device:
    """Rank `rank` of ACCL's emulator at pyaccl's `sim_sock` ("tcp://localhost:5500"
    is this rank's own command socket)."""
    from ..devices._emulator import EmulatorDevice

    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", sim_sock)
    if match is None:
        raise ValueError(f"sim_sock {sim_sock!r} is not a ZMQ TCP address such as "
                         "'tcp://localhost:5500'")
    host = "127.0.0.1" if match[1] == "localhost" else match[1]
    return EmulatorDevice(rank, port=int(match[2]) - rank, host=host, protocol=protocol.lower())


def card_device(xclbin: str, board_idx: int | None, cclo_idx: int) -> Device:
    from ..devices._pynq import PynqDevice

    return PynqDevice(xclbin, device_index=board_idx or 0, cclo_index=cclo_idx)


def rank_records(nranks: int, ranks: Sequence[dict[str, Any]] | None, bufsize: int,
                 soft: bool) -> list[xm.RankRecord]:
    """pyaccl's rank dicts as communicator records. The soft CCLO addresses its peers
    by session, so there each rank's session is its index."""
    if ranks is None:
        ranks = [{"ip": "127.0.0.1", "port": 9000 + i, "session_id": i,
                  "max_segment_size": bufsize} for i in range(nranks)]
    return [xm.RankRecord(ip=xm.ip_encode(r["ip"]), port=int(r["port"]),
                          session=i if soft else int(r.get("session_id", xm.NO_SESSION)),
                          max_segment_size=int(r.get("max_segment_size", bufsize)))
            for i, r in enumerate(ranks)]
